"""A real Flower deployment on loopback: a SuperLink, two SuperNodes and
``flwr run`` of examples/flower, with CRAFT + SA-PEF Top-k, its ClientApp the
warm relay (fedloom.integrations.warm). The final model has the same bytes as
``fedloom run`` of the same config. Then, without a
federation: the ClientApp's per-process caches and the ServerApp's reply
polling (docs/deploy.md, "Round time")."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

import fedloom
from conftest import FLOWER_NODE_TIMEOUT_S

pytest.importorskip("flwr")
ROOT = Path(__file__).resolve().parents[1]

CFG = {"name": "deploy", "seed": 5, "rounds": 2,
       "data": {"name": "digits", "num_clients": 2,
                "partition": {"name": "dirichlet", "options": {"alpha": 1.0}}},
       "model": {"name": "mlp", "options": {"hidden": [16]}}, "cohort": {"size": 2},
       "client": {"lr": 0.1, "batch_size": 16, "epochs": 1},
       "aggregator": {"name": "craft"}, "server": {"lr": 0.5},
       "compression": {"name": "topk", "options": {"ratio": 0.05}, "feedback": "sapef",
                       "alpha": 0.85},
       "checkpoint": {"every": 0},
       # one torch thread on both sides: run_local.sh gives each SuperNode nproc / N
       # threads, and float32 sums over another thread count round differently
       "backend": {"threads": 1}}


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
    warm_dir = Path(tempfile.mkdtemp(prefix="fw"))  # short: AF_UNIX paths ≤ ~100 bytes
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "WORK": str(tmp_path),
           "FLOWER_PORT": str(_free_base()), "FEDLOOM_WARM_DIR": str(warm_dir)}
    sources = _source_stamp()
    # Ceilings, not waits: the ServerApp asks the SuperNodes as soon as they connect
    # and the run ends with its rounds; a loaded machine only makes each step later.
    res = subprocess.run(
        ["bash", str(ROOT / "examples/flower/run_local.sh"), "2", "--run-config",
         f'config="{cfg_path}" node-timeout={FLOWER_NODE_TIMEOUT_S}'], env=env,
        capture_output=True, text=True, timeout=FLOWER_NODE_TIMEOUT_S + 900, check=False)
    edited = _source_stamp() != sources
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith('{"rounds"')]
    assert res.returncode == 0 and lines, (res.stdout[-3000:], res.stderr[-3000:])
    got = json.loads(lines[-1])
    ref = fedloom.run(CFG)
    assert got["rounds"] == 2
    assert got["model_sha256"] == ref.summary["model_sha256"]
    assert got["uplink_bytes_total"] == ref.summary["uplink_bytes_total"]
    # The example's ClientApp is the warm relay: one worker per SuperNode ran all
    # three of its messages (the strategy's client-id query and two rounds), and
    # exited when the federation stopped.
    # A worker is keyed by fedloom's source files (warm.worker_key): an edit of them
    # during the run (another engineer's, in a shared working tree) rightly starts a
    # new worker for the next message. Then only the total of messages is checked.
    logs = sorted(warm_dir.glob("*.log"))
    served = []
    for log in logs:
        text = ""
        end = time.monotonic() + 60  # the worker notices its SuperExec is gone within ~1 s idle
        while time.monotonic() < end:
            text = log.read_text()
            if "exiting after" in text or "stopped after" in text:
                break
            time.sleep(0.1)
        else:
            pytest.fail(f"warm worker {log.name} still running 60 s after the federation "
                        f"stopped (its SuperExec gone):\n{text}")
        assert text.count("listening on") == 1, text
        m = re.search(r"after (\d+) messages \(0 failed\)", text)
        assert m, text
        served.append(int(m.group(1)))
    assert sum(served) == 2 * 3, (served, [p.name for p in logs])
    if not edited:
        assert len(logs) == 2 and served == [3, 3], [p.name for p in warm_dir.iterdir()]
    shutil.rmtree(warm_dir, ignore_errors=True)


def _source_stamp() -> list[tuple[str, int, int]]:
    """What warm.worker_key reads of fedloom's sources: path, mtime and size."""
    out = []
    for p in sorted(Path(fedloom.__file__).parent.rglob("*.py")):
        try:
            st = p.stat()
        except FileNotFoundError:  # removed while we looked: an edit too
            continue
        out.append((str(p), st.st_mtime_ns, st.st_size))
    return out


# ------------------------------------------------ warm ClientApp and reply polling
# Unit tests, no federation: a ClientApp called twice in one process, and the
# ServerApp's pull loop against a grid that answers on the third pull.

SMALL = {**CFG, "compression": {"name": "topk", "options": {"ratio": 0.05},
                                "feedback": "none"}}


def _train_message(layout, w, k: int, r: int):
    from flwr.app import ConfigRecord, Message, MessageType, RecordDict

    from fedloom.integrations.flower import to_arrays

    conf = ConfigRecord({"server-round": r + 1, "fedloom-round": r, "client-id": k, "lr": 0.1})
    return Message(RecordDict({"arrays": to_arrays(layout, w), "config": conf}),
                   dst_node_id=1, message_type=MessageType.TRAIN)


def _context():
    from flwr.app import Context, RecordDict

    return Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(),
                   run_config={})


def test_client_app_loads_data_once_per_process_and_the_cache_changes_nothing(monkeypatch):
    """The second message to the same ClientApp process neither builds the
    Experiment (data, model, trainer) nor gathers the client's slice again; a
    third for another client gathers only that client's slice. The update sent
    from the cache equals the one a cold process sends (same payload bytes)."""
    from flwr.supercore.task_identity import TaskIdentity

    from fedloom.config import load_config
    from fedloom.integrations import flower as fl
    from fedloom.integrations.flower import cache

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 1)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(cache, "_EXPERIMENTS", {})
    monkeypatch.setattr(cache, "_CLIENT_DATA", {})
    monkeypatch.setattr(cache, "LOADS", {"experiment": 0, "client_data": 0})

    app = fl.client_app(SMALL)
    layout = cache._experiment(load_config(SMALL)).layout  # the first (and only) build
    w = torch.linspace(-0.1, 0.1, layout.size)

    def payload(k: int, r: int) -> bytes:
        reply = app(message=_train_message(layout, w, k, r), context=_context())
        assert not reply.has_error(), reply.error
        return bytes(reply.content["fedloom"]["payload"])

    first = payload(0, 0)
    assert cache.LOADS == {"experiment": 1, "client_data": 1}
    second = payload(0, 0)
    assert cache.LOADS == {"experiment": 1, "client_data": 1}  # both caches hit
    assert second == first
    payload(1, 1)
    assert cache.LOADS == {"experiment": 1, "client_data": 2}
    # a cold process (empty caches) sends the same bytes
    monkeypatch.setattr(cache, "_EXPERIMENTS", {})
    monkeypatch.setattr(cache, "_CLIENT_DATA", {})
    app = fl.client_app(SMALL)
    assert payload(0, 0) == first
    assert cache.LOADS == {"experiment": 2, "client_data": 3}


class _Grid:
    """push_messages gives ids "a" and "b"; "a" is answered on pull 1, "b" on pull
    ``b_on`` (never when 0)."""

    def __init__(self, b_on: int) -> None:
        self.b_on, self.pulls = b_on, 0

    def push_messages(self, messages):
        return ["a", "b"]

    def pull_messages(self, ids):
        from types import SimpleNamespace

        self.pulls += 1
        out = []
        for i in sorted(ids):
            if (i == "a" and self.pulls == 1) or (i == "b" and self.pulls == self.b_on):
                out.append(SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)))
        return out


def test_poll_replies_waits_its_interval_until_every_reply_or_the_timeout(monkeypatch):
    from fedloom.integrations import flower as fl
    from fedloom.integrations.flower import server

    clock = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:  # a fake clock: no real waiting in this test
        sleeps.append(s)
        clock[0] += s

    monkeypatch.setattr(server.time, "sleep", sleep)
    monkeypatch.setattr(server.time, "monotonic", lambda: clock[0])

    grid = fl.poll_replies(_Grid(b_on=3), 0.25)
    got = grid.send_and_receive([], timeout=60)
    assert sorted(m.metadata.reply_to_message_id for m in got) == ["a", "b"]
    assert grid.pulls == 3 and sleeps == [0.25, 0.25]  # stops at the last reply
    # "b" never answers: pulls every 0.25 s until the 1 s timeout, returns what came
    sleeps.clear()
    grid = fl.poll_replies(_Grid(b_on=0), 0.25)
    got = grid.send_and_receive([], timeout=1.0)
    assert [m.metadata.reply_to_message_id for m in got] == ["a"]
    assert grid.pulls == 4 and sum(sleeps) == 1.0
    # timeout=0 pulls nothing (Flower's grid does the same)
    grid = fl.poll_replies(_Grid(b_on=1), 0.25)
    assert list(grid.send_and_receive([], timeout=0.0)) == [] and grid.pulls == 0
    with pytest.raises(ValueError, match="interval: must be > 0"):
        fl.poll_replies(_Grid(b_on=1), 0.0)
