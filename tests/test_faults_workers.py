"""Dead process-backend workers: killed between rounds, or killed holding a group.

float64 runs, so the process backend gives the sequential backend's bits
(tests/test_backends.py): a run whose lost work was redone must end with the
uninterrupted run's ``model_sha256``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
import yaml

import fedloom
from conftest import TINY
from fedloom.config import load_config
from fedloom.engine.experiment import Experiment
from fedloom.engine.trainers.backends import balanced_groups

PROC = ["dtype=float64", "backend=process", "backend.options.workers=2"]


def _kill_a_worker_after_round_1(state, metrics):
    """SIGKILL one worker once round 1 is done, and wait until it is gone, so the
    next round finds a dead worker before any work is sent to it."""
    if state.next_round != 1:
        return
    workers = multiprocessing.active_children()  # the pool's processes
    assert workers, "no worker process to kill"
    os.kill(workers[0].pid, signal.SIGKILL)
    workers[0].join(60)  # SIGKILL is immediate; 60 s for a loaded machine
    assert workers[0].exitcode == -signal.SIGKILL, (
        f"worker {workers[0].pid} not gone 60 s after SIGKILL (exit code {workers[0].exitcode})")


@pytest.mark.parametrize("policy", ["retry", "drop"])
def test_worker_killed_between_rounds_is_replaced_and_nothing_is_lost(policy):
    """Before the fix: the next round's submit raised BrokenProcessPool (exit 1) with
    either policy. Now the dead worker is replaced before work is sent, so no client
    is dropped or rerun, and the run is bit-identical to the uninterrupted one."""
    ref = fedloom.run(TINY, ["dtype=float64"])
    res = fedloom.run(TINY, [*PROC, f"backend.options.on_failure={policy}"],
                      callbacks=[_kill_a_worker_after_round_1])
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    assert [m.get("dropped_clients", 0) for m in res.metrics] == [0, 0, 0]


def test_drop_drops_only_the_dead_workers_clients(tmp_path, monkeypatch):
    """The worker holding client 4 dies at the start of its group (round 1). Only
    that group's clients are dropped; the other worker's group — still training
    when the death is seen (300 local steps per client) — is kept. Before the
    fix every unfinished group was dropped with it."""
    over = ["dtype=float64", "client.steps=300"]
    exp = Experiment.from_config(load_config(TINY, over))
    jobs = exp.plan_round(exp.init()).jobs
    groups = [[jobs[i].client for i in g] for g in balanced_groups(jobs, 2)]
    dead = next(g for g in groups if 4 in g)
    assert len(groups) == 2 and len(dead) < len(jobs)  # the other group is not empty

    marker = tmp_path / "killed"
    monkeypatch.setenv("FEDLOOM_KILL_ONCE", f"4:{marker}")  # client 4: round 1 only
    res = fedloom.run(TINY, [*over, *PROC[1:], "backend.options.on_failure=drop"])
    assert marker.exists()
    dropped = [m.get("dropped_client_ids", []) for m in res.metrics]
    assert sorted(dropped[0]) == sorted(dead)
    assert dropped[1:] == [[], []]
    assert res.metrics[0]["dropped_clients"] == len(dead)


@pytest.mark.parametrize("policy", ["retry", "drop"])
def test_worker_dying_mid_stream(tmp_path, monkeypatch, policy):
    """Plain FedAvg: each worker sends every client's result as it is trained, and
    the parent starts that client's uplink at once. The worker dies at its group's
    last client, after sending the others: retried, the clients sent twice are
    redone and the run is the sequential one; dropped, the whole group is dropped,
    the clients it had sent included."""
    exp = Experiment.from_config(load_config(TINY, ["dtype=float64"]))
    jobs = exp.plan_round(exp.init()).jobs
    groups = [[jobs[i].client for i in g] for g in balanced_groups(jobs, 2)]
    exp.close()
    dead = next(g for g in groups if len(g) > 1)  # a client before the victim is sent
    marker = tmp_path / "killed"
    monkeypatch.setenv("FEDLOOM_KILL_ONCE", f"{dead[-1]}:{marker}")  # round 1 only
    res = fedloom.run(TINY, [*PROC, f"backend.options.on_failure={policy}"])
    assert marker.exists()
    dropped = [m.get("dropped_client_ids", []) for m in res.metrics]
    if policy == "retry":
        ref = fedloom.run(TINY, ["dtype=float64"])
        assert res.summary["model_sha256"] == ref.summary["model_sha256"]
        assert dropped == [[], [], []]
    else:
        assert sorted(dropped[0]) == sorted(dead) and dropped[1:] == [[], []]


@pytest.mark.parametrize("spec", ["abc", "4", "x:/tmp/m", "4:", "-1:/tmp/m"])
def test_a_malformed_kill_once_is_one_line_naming_it(tmp_path, monkeypatch, capsys, spec):
    """``FEDLOOM_KILL_ONCE`` not ``CLIENT:MARKER_FILE``: one line naming the variable
    and the form, exit 2, checked when the backend is built (it failed inside a
    worker, as ``invalid literal for int()``)."""
    from fedloom import cli

    monkeypatch.setenv("FEDLOOM_KILL_ONCE", spec)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "rounds": 1, "logging": {"plots": False}}))
    capsys.readouterr()
    rc = cli.main(["run", str(cfg), *PROC, "--out", str(tmp_path / "run"), "--quiet"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1, err
    assert f"FEDLOOM_KILL_ONCE={spec!r}" in err[0] and "CLIENT:MARKER_FILE" in err[0], err
