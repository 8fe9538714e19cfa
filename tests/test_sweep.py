"""Sweeps: tuning on its own seed, resumable runs, the report.

Each run of a sweep is ``python -m fedloom.cli run …``; here the runs go through
``fedloom.cli.main`` in this process (``conftest.cli_in_process``), since what is
tested is the sweep's bookkeeping. tests/test_plugin.py runs a sweep whose runs
are real subprocesses."""

import pytest
import yaml

from conftest import TINY, cli_in_process
from fedloom.config import ConfigError
from fedloom.sweep import load_suite, main_specs, run_suite


def _suite(tmp_path, **extra):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "rounds": 2}))
    suite = {
        "name": "t", "out": str(tmp_path / "runs"), "doc": str(tmp_path / "doc" / "t.md"),
        "seeds": [1], "tune_seed": 0,
        "settings": {"digits": {"config": str(cfg)}},
        "methods": {"FedAvg": [], "CRAFT": ["aggregator.name=craft", "server.lr=$TUNE"]},
        "tune": {"CRAFT": {"key": "server.lr", "grid": [0.5, 1.0]}},
        "report": {"compare": {"baseline": "FedAvg", "candidates": ["CRAFT"]}},
        **extra,
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def test_sweep_tunes_runs_reports_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr("fedloom.sweep.subprocess.run", cli_in_process)
    path = _suite(tmp_path)
    logs = []
    run_suite(path, workers=2, log=logs.append)
    doc = (tmp_path / "doc" / "t.md").read_text()
    assert "CRAFT: `server.lr` =" in doc and "| FedAvg |" in doc and "| CRAFT |" in doc
    assert (tmp_path / "runs" / "digits" / "CRAFT@tune=0.5" / "seed0" / "summary.json").exists()
    again = []
    run_suite(path, workers=2, log=again.append)  # everything finished: nothing runs
    assert any("0 of 2 runs to do" in s for s in again)


def test_suite_errors(tmp_path):
    path = _suite(tmp_path, bogus=1)
    with pytest.raises(ConfigError, match="bogus: unknown key"):
        load_suite(path)
    path = _suite(tmp_path, tune={})
    with pytest.raises(ConfigError, match=r"uses \$TUNE but has no tune entry"):
        main_specs(load_suite(path), {})
