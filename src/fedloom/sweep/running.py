"""Running a sweep's runs: ``fedloom run`` commands, ``workers`` at a time.

:func:`_run_all` starts the runs not yet finished (one stopped mid-way resumes),
after refusing runs in ``out:`` that hold another config than the suite asks
(:func:`_stale`, :class:`~fedloom.sweep.suite.StaleRunsError`) or were trained on
other data than their setting names now (:mod:`fedloom.sweep.datacheck`). Commands go to
long-lived worker processes (:class:`_Launcher`) or, with ``RUNNER =
"subprocess"``, to a fresh process each through ``subprocess.run`` (what tests
replace: ``fedloom.sweep.running.RUNNER`` and
``fedloom.sweep.running.subprocess.run``). A run that fails does not stop the
others; :class:`~fedloom.sweep.suite.SweepError` then counts them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from fedloom.config import ConfigError
from fedloom.spawning import check_main_guard
from fedloom.sweep.datacheck import check_data
from fedloom.sweep.suite import RunSpec, StaleRunsError, SweepError


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the sweep that started it dies (killed,
    out of memory), so no orphaned worker goes on writing a run directory that a
    continued sweep is about to run again. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # no prctl: the worker may outlive a killed sweep
        return
    if os.getppid() == 1:  # the parent was gone before the call took effect
        os._exit(1)


def _worker_init() -> None:
    """A sweep worker: one thread, and a root log handler so that ``cli.main``'s
    ``basicConfig`` binds no stream of an earlier run."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    _die_with_parent()
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger().addHandler(logging.NullHandler())


def _run_in_worker(cmd_module: str, argv: list[str]) -> tuple[int, str]:
    """``python -m <cmd_module> <argv>`` in this (long-lived) worker: its exit code and
    stderr, as the command line would give them (log lines included)."""
    import contextlib
    import importlib
    import io
    import logging

    # The command line by its module name, as `python -m fedloom.cli` names it for a
    # subprocess: a sweep runs commands; it does not build on the CLI's code.
    cli = importlib.import_module(cmd_module)
    err = io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("fedloom: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # argparse's exits
                rc = e.code if isinstance(e.code, int) else 1
            except Exception as e:  # what would be a traceback: its last line
                print(f"{type(e).__name__}: {e}", file=err)
                rc = 1
    finally:
        root.removeHandler(handler)
    return rc, err.getvalue()


class _Launcher:
    """Runs ``python -m fedloom.cli …`` commands: in ``workers`` long-lived worker
    processes (spawned, one thread each, a fresh one after 20 runs), so each run
    does not pay Python's, torch's and the data libraries' start-up again — on a
    sweep of short runs that was half the time. A worker that dies (killed, out
    of memory) fails only the run it held; the runs after it go to a fresh
    ``python -m fedloom.cli`` subprocess each, as before. Results are the same as
    a subprocess's: every random stream is derived from the config
    (tests/test_tuning.py compares the two)."""

    def __init__(self, workers: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        check_main_guard("sweep")
        self.pool: Any = ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init, max_tasks_per_child=20)
        self.broken = False

    def __call__(self, cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
        from concurrent.futures.process import BrokenProcessPool

        if not self.broken:
            try:
                # cmd is [python, "-m", module, *argv]: the same command, in a worker
                return self.pool.submit(_run_in_worker, cmd[2], list(cmd[3:])).result()
            except BrokenProcessPool:
                self.broken = True
                return 1, "a sweep worker process died during this run"
        return _launch_subprocess(cmd, env)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _launch_subprocess(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    return p.returncode, p.stderr


# How a sweep starts its runs: "worker" (long-lived worker processes) or "subprocess"
# (one fresh process per run: what tests that replace subprocess.run rely on).
RUNNER = "worker"


def _stale(spec: RunSpec, imports: bool = False) -> str | None:
    """What differs between a finished run's saved config and the one the suite asks of
    it (``key: saved → asked``), else None. A run directory is named by setting, method
    and seed, not by its tuned values: when a tuning choice or a method's overrides
    change, the old run must not stand in for the new one.

    The saved config is read as data, importing no plug-in it names (the folder may be
    anyone's); so is the asked one unless ``imports`` (a sweep about to run it, whose
    checks have imported its plug-ins already): a report runs no code."""
    import contextlib

    from fedloom import registry
    from fedloom.accounting import as_it_ran
    from fedloom.aggregate.base import recorded_config
    from fedloom.config import config_from_dict, config_to_dict, load_config, safe_load_bounded
    from fedloom.engine.build import resolve_auto
    from fedloom.report.compare.groups import _flatten

    try:
        # bounded: a run folder's file may be anyone's (an alias bomb, deep nesting)
        saved = safe_load_bounded((spec.out / "config.yaml").read_text(),
                                  str(spec.out / "config.yaml"))
        # resolved as a run resolves it (server.lr: auto, a method's buffer policy: FedBN)
        with contextlib.nullcontext() if imports else registry.no_imports():
            asked = config_to_dict(resolve_auto(load_config(
                spec.config, [*spec.overrides, f"seed={spec.seed}"])))
        # its aggregator's options as the run used them (CRAFT's step before issue 54)
        with registry.no_imports():
            saved = recorded_config(config_to_dict(config_from_dict(as_it_ran(saved),
                                                                    plugins=False)))
    except (OSError, yaml.YAMLError, ConfigError, ValueError, TypeError):
        return None  # unreadable: resuming or rerunning it reports the problem
    a, b = _flatten(saved), _flatten(asked)
    for key in sorted(set(a) | set(b)):
        if key.split(".")[0] in ("name", "logging", "checkpoint"):
            continue
        if b.get(key) == "auto":  # the run saved what auto resolved to (server.lr: 1.0)
            continue
        if (key == "rounds" and not spec.done and isinstance(a.get(key), int)
                and isinstance(b.get(key), int) and a[key] < b[key]):
            # a stopped run of fewer rounds: its resume extends it (the engine refuses
            # what cannot be: a cosine schedule); halving continues trials so
            continue
        if a.get(key) != b.get(key):
            return f"{key}: {a.get(key)} → {b.get(key)}"
    return None


def _check_not_stale(specs: list[RunSpec], imports: bool) -> None:
    """:class:`StaleRunsError` when a run of ``specs`` in ``out:`` holds another config:
    a finished one would stand in for the run asked, a stopped one could not resume.
    ``imports``: the suite's configs may import their plug-ins (:func:`_stale`)."""
    stale = [(s, why) for s in specs if s.out.exists() and (why := _stale(s, imports))]
    if stale:
        s, why = stale[0]
        done = sum(sp.done for sp, _ in stale)
        what = " and ".join([*([f"{done} finished"] if done else []),
                             *([f"{len(stale) - done} stopped"] if done < len(stale) else [])])
        raise StaleRunsError(f"{what} runs hold another config than the suite asks "
                             f"(first: {s.out}: {why}); remove them or give the suite its own "
                             "out:")


# What a run logs when it resumed from prev.pt because its last.pt was refused
# (fedloom.engine.runs.directory._set_aside: "…; resumed from RUN/checkpoints/prev.pt (round R)…")
_FALLBACK = re.compile(r"; resumed from .*prev\.pt \(round \d+\)")


def _fallback_lines(stderr: str) -> list[str]:
    """The lines of a run's stderr that say it resumed from ``prev.pt`` (:data:`_FALLBACK`)."""
    return [ln.strip().removeprefix("fedloom: ") for ln in stderr.splitlines()
            if _FALLBACK.search(ln)]


def _run_all(specs: list[RunSpec], workers: int, log: Callable[[str], None],
             fallbacks: list[str] | None = None) -> None:
    """Run the runs of ``specs`` not finished, ``workers`` at a time (module docstring).
    A run's stderr is kept only when it fails, so a run that resumed from ``prev.pt``
    because its ``last.pt`` was refused would pass unseen: its line is logged, naming
    the run, and appended to ``fallbacks`` (the sweep keeps them in its state file)."""
    _check_not_stale(specs, imports=workers > 0)  # workers 0: a report, which runs no code
    todo = [s for s in specs if not s.done]
    if workers <= 0:  # report only: run nothing
        if todo:
            raise FileNotFoundError(f"{len(todo)} runs have not finished")
        return
    # the data each run to reuse or resume was trained on (data.json): loading it runs
    # code (a plug-in source), so not for a report
    check_data(specs)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    launcher: Any = _Launcher(workers) if RUNNER == "worker" and todo else _launch_subprocess

    def one(spec: RunSpec) -> None:
        if spec.out.exists() and not spec.done:
            # A run stopped mid-way: continue it from its checkpoint if it has one.
            cmd = [*spec.command(), "--resume"]
        else:
            cmd = spec.command()
        t0 = time.perf_counter()
        rc, stderr = launcher(cmd, env)
        for line in _fallback_lines(stderr):
            note = f"{spec.setting}/{spec.out.parent.name}/seed{spec.seed}: {line}"
            log(note)
            if fallbacks is not None:
                fallbacks.append(note)
        if rc != 0:
            msg = (f"{spec.setting}/{spec.method}/seed{spec.seed} failed: "
                   f"{(stderr.strip().splitlines() or ['?'])[-1]}")
            failed.append(msg)  # the other runs go on; the report shows what finished
            log(msg)
            return
        log(f"done {spec.setting}/{spec.out.parent.name}/seed{spec.seed} "
            f"in {time.perf_counter() - t0:.0f} s")

    failed: list[str] = []
    log(f"{len(todo)} of {len(specs)} runs to do, {workers} at a time")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        try:
            for f in [pool.submit(one, s) for s in todo]:
                f.result()
        finally:
            # Closed while the threads that started the workers are alive: a worker gets
            # SIGTERM when the *thread* that spawned it ends (_die_with_parent's
            # PR_SET_PDEATHSIG), which would kill it before its clean exit and leave its
            # semaphores to the resource tracker's "leaked semaphore" warning.
            if isinstance(launcher, _Launcher):
                launcher.close()
    if failed:
        raise SweepError(f"{len(failed)} of {len(todo)} runs failed; first: {failed[0]}")


def read_summary(out: Path) -> dict[str, Any]:
    """A finished run's ``summary.json``; :class:`SweepError` (one line naming it)
    when it cannot be read or is not a JSON object."""
    path = out / "summary.json"
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    # ValueError: malformed JSON, or an integer past the int-parsing limit;
    # RecursionError: nesting deeper than the parser's stack
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SweepError(f"{path}: cannot be read ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise SweepError(f"{path}: holds a {type(obj).__name__}, not a run summary")
    return obj
