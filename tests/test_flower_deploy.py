"""A real Flower deployment on loopback: a SuperLink, two SuperNodes and
``flwr run`` of examples/flower, with CRAFT + SA-PEF Top-k. The final model has
the same bytes as ``fedloom run`` of the same config."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import fedloom

pytest.importorskip("flwr")
ROOT = Path(__file__).resolve().parents[1]

CFG = {"name": "deploy", "seed": 5, "rounds": 2,
       "data": {"name": "digits", "num_clients": 2,
                "partition": {"name": "dirichlet", "alpha": 1.0}},
       "model": {"name": "mlp", "hidden": [16]}, "cohort": {"size": 2},
       "client": {"lr": 0.1, "batch_size": 16, "epochs": 1},
       "aggregator": {"name": "craft"}, "server": {"lr": 0.5},
       "compression": {"name": "topk", "options": {"ratio": 0.05}, "feedback": "sapef",
                       "alpha": 0.85},
       "checkpoint": {"every": 0}}


def _free_base() -> int:
    """A port p with p and p + 100, p + 101 free on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p > 60000:
            continue
        try:
            for q in (p + 100, p + 101):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    pytest.skip("no free loopback ports")


@pytest.mark.slow
def test_local_superlink_and_supernodes_give_the_engine_model(tmp_path):
    bindir = Path(sys.executable).parent
    if not (bindir / "flower-superlink").exists() or shutil.which("bash") is None:
        pytest.skip("Flower's executables are not installed next to this Python")
    cfg_path = tmp_path / "deploy.yaml"
    cfg_path.write_text(yaml.safe_dump(CFG))
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "WORK": str(tmp_path),
           "FLOWER_PORT": str(_free_base())}
    res = subprocess.run(
        ["bash", str(ROOT / "examples/flower/run_local.sh"), "2", "--run-config",
         f'config="{cfg_path}"'], env=env, capture_output=True, text=True, timeout=400,
        check=False)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith('{"rounds"')]
    assert res.returncode == 0 and lines, (res.stdout[-3000:], res.stderr[-3000:])
    got = json.loads(lines[-1])
    ref = fedloom.run(CFG)
    assert got["rounds"] == 2
    assert got["model_sha256"] == ref.summary["model_sha256"]
    assert got["uplink_bytes_total"] == ref.summary["uplink_bytes_total"]
