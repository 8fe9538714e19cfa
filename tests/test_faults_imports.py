"""Reading results runs no code: a run folder's ``config.yaml`` may be anyone's, and
a plug-in it names (``module:attr``, an entry point) is code.

``fedloom compare``, a sweep's ``--report-only`` page (its halving plan included)
and a sweep's stale-run checks read a run's config as data: a plug-in is compared by
its name and options, never imported. Each test puts a module in a folder on the
import path (the current directory, for the commands run as a user runs them) whose
import writes a marker file; the marker must never appear, and the command must
still work. Running a config imports what it names (tests/test_plugin.py,
``test_sweep_runs_the_plugins``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import TINY
from fedloom.config import config_to_dict, load_config

# server.lr is left at auto: a plug-in aggregator's default step is not looked up either
CONFIG: dict[str, Any] = {**TINY, "rounds": 1, "checkpoint": {"every": 0}}

Evil = Callable[[str], tuple[str, Path]]


@pytest.fixture
def evil(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Evil]:
    """``evil(NAME)`` writes ``NAME.py`` into ``tmp_path`` (put on ``sys.path``; the
    current directory too) and returns its reference ``NAME:Agg`` and the marker its
    import writes. ``Agg`` is a working factory: only the marker tells it was imported."""
    names: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)

    def make(name: str) -> tuple[str, Path]:
        marker = tmp_path / f"{name}.imported"
        (tmp_path / f"{name}.py").write_text(
            f"open({str(marker)!r}, 'w').close()\n"
            "from fedloom.aggregate.mean import FedAvg as Agg\n")
        names.append(name)
        return f"{name}:Agg", marker

    yield make
    for name in names:  # an import (the defect) must not reach the next test
        sys.modules.pop(name, None)


def _saved(aggregator: str, seed: int = 1) -> dict[str, Any]:
    """The config.yaml a run of CONFIG (seed ``seed``) saves, naming ``aggregator``:
    the config as a run resolves it (server.lr: auto is FedAvg's 1.0)."""
    from fedloom.engine.build import resolve_auto

    saved = config_to_dict(resolve_auto(load_config(CONFIG, [f"seed={seed}"])))
    saved["aggregator"]["name"] = aggregator
    return saved


def _run_folder(out: Path, config: dict[str, Any], acc: float) -> Path:
    """A finished run's folder: its config, summary and one round of metrics."""
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    (out / "summary.json").write_text(json.dumps({
        "rounds": 1, "test_acc": acc, "client_acc_mean": acc, "client_acc_worst10": acc / 2,
        "uplink_bytes_total": 1000}))
    (out / "metrics.jsonl").write_text(json.dumps({
        "round": 1, "test_acc": acc, "uplink_bytes": 1000, "uplink_bytes_total": 1000}) + "\n")
    return out


def _cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``fedloom ARGS`` in ``cwd`` as a user runs it (``python -m`` puts the current
    directory on the import path)."""
    return subprocess.run([sys.executable, "-m", "fedloom.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def _suite(tmp_path: Path, setting_aggregator: str, tuning: dict[str, Any] | None = None
           ) -> Path:
    """Setting ``digits`` (CONFIG naming ``setting_aggregator``), method ``M`` whose
    client.lr is tuned on a grid of one value (CONFIG's own 0.1, on seed 0): a report
    checks the tuning runs' configs (``--report-only`` reads the main runs' results only).
    ``tuning``: that protocol instead."""
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**CONFIG, "aggregator": {"name": setting_aggregator}}))
    tune = ({"methods": {"M": ["client.lr=$TUNE"]},
             "tune": {"M": {"key": "client.lr", "grid": [0.1]}}} if tuning is None
            else {"methods": {"M": []}, "tuning": tuning})
    suite = {"name": "t", "out": str(tmp_path / "runs"), "doc": None, "seeds": [1],
             "settings": {"digits": {"config": str(cfg)}}, **tune}
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


TRIAL = Path("runs", "digits", "M@tune=0.1", "seed0")  # the tuning run (tune_seed 0)
MAIN = Path("runs", "digits", "M", "seed1")


def test_compare_reads_a_run_folder_naming_a_plugin_without_importing_it(tmp_path, evil):
    ref, marker = evil("evil_compare")
    _run_folder(tmp_path / "R1", _saved(ref), 0.5)
    _run_folder(tmp_path / "R2", _saved("fedavg"), 0.7)
    p = _cli(tmp_path, "compare", "R1", "R2")
    assert p.returncode == 0, p.stderr
    assert not marker.exists()
    # the plug-in is compared by its name: the two runs are two groups, labelled by it
    assert "2 runs in 2 groups" in p.stdout and ref in p.stdout and "fedavg" in p.stdout


def test_compare_does_not_load_an_entry_point_a_run_folder_names(tmp_path, evil, monkeypatch):
    from importlib.metadata import EntryPoint

    from fedloom import registry
    from fedloom.report.compare import compare

    ref, marker = evil("evil_ep")
    registry.available("aggregator")  # entry points found
    ep = EntryPoint(name="evil-ep", value=ref, group="fedloom.aggregators")
    monkeypatch.setitem(registry._ENTRY_POINTS["aggregator"], "evil-ep", ep)
    _run_folder(tmp_path / "R1", _saved("evil-ep"), 0.5)
    _run_folder(tmp_path / "R2", _saved("fedavg"), 0.7)
    text, _ = compare([tmp_path / "R1", tmp_path / "R2"])
    assert not marker.exists()
    assert "2 runs in 2 groups" in text and "evil-ep" in text


def test_a_sweep_report_of_a_suite_naming_a_plugin_imports_nothing(tmp_path, evil):
    """``fedloom sweep --report-only``: the suite's own config names the plug-in too;
    the page is made from the finished run (its stale check reads both configs as data)."""
    ref, marker = evil("evil_page")
    path = _suite(tmp_path, ref)
    _run_folder(tmp_path / TRIAL, _saved(ref, seed=0), 0.4)
    _run_folder(tmp_path / MAIN, _saved(ref), 0.5)
    p = _cli(tmp_path, "sweep", str(path), "--report-only")
    assert p.returncode == 0, p.stderr
    assert not marker.exists()
    assert "50.0" in p.stdout  # the run's client accuracy, in %, on the page


def test_a_stale_check_reads_the_run_folder_as_data(tmp_path, evil, monkeypatch):
    """A run folder whose config.yaml was changed to name a plug-in: the report and the
    sweep that would run both find it stale (one line naming the key) and import
    nothing; the sweep starts no run."""
    from fedloom.sweep import StaleRunsError, run_suite

    ref, marker = evil("evil_stale")
    path = _suite(tmp_path, "fedavg")
    _run_folder(tmp_path / TRIAL, _saved(ref, seed=0), 0.4)
    started: list[Any] = []
    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run",
                        lambda cmd, **kw: started.append(cmd))
    why = rf"aggregator\.name: {ref} → fedavg"
    with pytest.raises(StaleRunsError, match=why):
        run_suite(path, log=lambda s: None, report_only=True)
    with pytest.raises(StaleRunsError, match=why):
        run_suite(path, workers=1, log=lambda s: None)
    assert not marker.exists() and not started


def test_a_halving_report_plans_without_importing(tmp_path, evil):
    """``--report-only`` of a halving protocol reads each setting's config for its plan
    (rounds, cohort, schedule): as data, before any trial has run."""
    from fedloom.sweep import run_suite

    ref, marker = evil("evil_plan")
    tuning = {"budget": 3, "seeds": [7], "metric": "test_acc", "rounds": 3,
              "sampler": "halving", "eta": 3, "min_rounds": 1,
              "space": {"client.lr": [0.05, 0.1, 0.2]}}
    suite = run_suite(_suite(tmp_path, ref, tuning=tuning), log=lambda s: None,
                      report_only=True)
    assert not marker.exists()
    assert suite.report_text
