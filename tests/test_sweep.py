"""Sweeps: tuning on its own seed, resumable runs, the report.

Each run of a sweep is ``python -m fedloom.cli run …``; here the runs go through
``fedloom.cli.main`` in this process (``conftest.cli_in_process``), since what is
tested is the sweep's bookkeeping. tests/test_plugin.py runs a sweep whose runs
are real subprocesses."""

import sys

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
    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")  # one process per run
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", cli_in_process)
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


# No tuning here: each phase of a sweep (tuning, then the main runs) starts its own
# workers, and a tuning trial is a run like any other (the tuning itself is tested
# above); one phase of 4 runs on 2 workers still gives each worker several runs.
UNTUNED = {"tune": {}, "methods": {"FedAvg": [], "CRAFT": ["aggregator.name=craft",
                                                          "server.lr=0.5"]}}


def test_worker_processes_give_the_subprocess_result(tmp_path, monkeypatch):
    """The default runner (long-lived spawned workers, several runs each) computes what
    a fresh process per run computes: the same model, bit for bit, on this machine."""
    import json

    path = _suite(tmp_path, seeds=[1, 2], **UNTUNED)
    run_suite(path, workers=2, log=lambda s: None)  # RUNNER = "worker": real processes
    runs = tmp_path / "runs" / "digits"
    worker = {p.parent.name + "/" + p.parent.parent.name: json.loads(p.read_text())
              for p in runs.rglob("summary.json")}
    assert len(worker) == 4  # FedAvg, CRAFT × 2 seeds
    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", cli_in_process)
    other = tmp_path / "again"
    path2 = _suite(tmp_path, seeds=[1, 2], out=str(other), **UNTUNED)
    run_suite(path2, workers=1, log=lambda s: None)
    fresh = {p.parent.name + "/" + p.parent.parent.name: json.loads(p.read_text())
             for p in (other / "digits").rglob("summary.json")}
    assert {k: v["model_sha256"] for k, v in worker.items()} == \
        {k: v["model_sha256"] for k, v in fresh.items()}


def test_a_dead_worker_fails_its_run_and_the_rest_run_in_subprocesses(monkeypatch):
    from concurrent.futures.process import BrokenProcessPool

    from fedloom.sweep.running import _Launcher

    class DeadPool:
        def submit(self, *a, **k):
            raise BrokenProcessPool("killed")

        def shutdown(self, **k):
            pass

    calls = []

    def fake_run(cmd, **kw):
        calls.append(cmd)
        import subprocess
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", fake_run)
    launcher = _Launcher.__new__(_Launcher)
    launcher.pool, launcher.broken = DeadPool(), False
    rc, err = launcher(["python", "-m", "fedloom.cli", "run", "x"], {})
    assert rc == 1 and "worker process died" in err and not calls
    assert launcher(["python", "-m", "fedloom.cli", "run", "y"], {})[0] == 0
    assert calls and calls[0][-1] == "y"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_workers_die_with_a_killed_sweep(tmp_path):
    """A sweep killed with SIGKILL leaves no worker running on (an orphan would go on
    writing a run directory that a continued sweep runs again)."""
    import os
    import signal
    import subprocess
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from fedloom.sweep.running import _Launcher\n"
        "if __name__ == '__main__':\n"
        "    launcher = _Launcher(1)\n"
        "    f = launcher.pool.submit(time.sleep, 60)\n"
        "    time.sleep(0.5)\n"
        "    print(*[p.pid for p in launcher.pool._processes.values()], flush=True)\n"
        "    f.result()\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in parent.stdout.readline().split()]
    assert pids
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 60  # PR_SET_PDEATHSIG acts at once; 60 s for a loaded machine
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in pids if _running(p)]
    assert not alive, f"worker {alive} outlived the killed sweep by 60 s"


def _running(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has finished
        return f.read().split(")")[-1].split()[0] != "Z"


def test_across_panel_tables_and_plots_a_metric_against_the_settings_number(tmp_path):
    """``report.across``: one table row per method, one column per setting ordered by its
    number (mean ± sd over the seeds, in %), a setting the table lacks left out, and the
    plot written beside the page."""
    from fedloom.report.sweep import _across_lines

    def runs(*vals):
        return {"runs": [{"_seed": i, "client_acc_mean": v} for i, v in enumerate(vals)]}

    table = {"lr1": {"A": runs(0.5, 0.7), "B": runs(0.9, 0.9)},
             "lr4": {"A": runs(0.8, 0.8)}}
    spec = {"title": "Sensitivity", "xlabel": "lr ×",
            "panels": [{"name": "p", "title": "P", "metric": "client_acc_mean",
                        "x": {"lr4": 4, "lr1": 1, "lr16": 16}, "methods": ["A", "B"]}]}
    out = _across_lines(spec, table, "t", tmp_path / "t.md")
    text = "\n".join(out)
    assert out[0] == "## Sensitivity"
    assert "× 1: lr1, × 4: lr4" in text and "lr16" not in text
    assert "| method | × 1 | × 4 |" in text
    # A: mean of 50 and 70 % is 60, sd (ddof 1) 14.1; B has no run at × 4
    assert "| A | 60.0 ± 14.1 | 80.0 ± 0.0 |" in text
    assert "| B | 90.0 ± 0.0 | – |" in text
    assert (tmp_path / "t-p.png").exists() and "(t-p.png)" in text
    assert _across_lines({"panels": [{"x": {"other": 1}}]}, table, "t", None) == []
