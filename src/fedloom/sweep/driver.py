"""A sweep from the suite file to its page: :func:`run_suite`.

It loads and checks the suite, holds ``out:`` for its whole life (an exclusive
lock on ``OUT/.fedloom-sweep.lock``: :func:`_lock_out`), tunes, runs the main and
sensitivity runs, and writes the report (:mod:`fedloom.report.sweep`), keeping
the sweep's wall time over its invocations in ``OUT/NAME.sweep.json``, with the
runs that resumed from ``prev.pt`` because their ``last.pt`` was refused
(``checkpoint_fallbacks``). With ``report_only`` it makes the page of the runs
finished so far and takes no lock.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedloom.sweep.checks import drop_missing_data, validate_suite
from fedloom.sweep.running import _run_all
from fedloom.sweep.sequential import finished_only, first_seeds, sequential_runs
from fedloom.sweep.suite import (
    SWEEP_LOCK,
    RunSpec,
    StaleRunsError,
    Suite,
    SweepError,
    SweepFolderError,
    load_suite,
)
from fedloom.sweep.tune import _tune, main_specs, sensitivity_specs


def _state_file(suite: Suite) -> Path:
    """``OUT/NAME.sweep.json`` (the sweep's wall time over its invocations); a sweep
    written before suites named theirs kept ``OUT/sweep.json``."""
    named = suite.out / f"{suite.name}.sweep.json"
    legacy = suite.out / "sweep.json"
    return named if named.exists() or not legacy.exists() else legacy


def _lock_out(out: Path) -> int:
    """Create ``out`` if needed and take an exclusive ``flock`` on
    ``OUT/.fedloom-sweep.lock`` (as :func:`fedloom.engine.runs.checkpoint.lock_run_dir`
    locks a run directory); return its descriptor, to close when the sweep ends. The
    kernel drops the lock when the process ends in any way (``SIGKILL`` included), so
    a killed sweep leaves no stale lock. Another sweep holding it:
    :class:`SweepFolderError` naming its pid, and nothing in ``out`` is touched but
    the lock file. A lock file that is a link, not a regular file, has a second name
    or holds something other than a pid: :class:`SweepFolderError` naming it, nothing
    written (:func:`fedloom.files.lock_pid_file`)."""
    from fedloom.files import NotInPlace, lock_pid_file

    try:
        out.mkdir(parents=True, exist_ok=True)
        return lock_pid_file(out / SWEEP_LOCK, lambda pid: SweepFolderError(
            f"out: {out}: in use by another fedloom sweep (pid {pid}); wait for it to end "
            "or give this suite its own out:"))
    except NotInPlace as e:
        raise SweepFolderError(f"out: {e}") from None
    except OSError as e:  # cannot create it, or a file system without locks
        raise SweepFolderError(f"out: {out}: cannot use it as a sweep's folder "
                               f"({e.strerror or type(e).__name__})") from None


# OUT/NAME.sweep.json: the lines of the runs that resumed from prev.pt because their
# last.pt was refused (fedloom.sweep.running), over every invocation
FALLBACKS_KEY = "checkpoint_fallbacks"


def _read_state(suite: Suite) -> dict[str, Any]:
    """The sweep's state file (:func:`_state_file`) of its earlier invocations; {} when
    there is none. One that is not a regular file, cannot be read or is not a JSON
    object: :class:`SweepFolderError` naming it (what a rerun would meet again)."""
    from fedloom.files import file_kind

    state = _state_file(suite)
    again = "remove it (the sweep's wall time then starts again from 0)"
    if not (state.exists() or state.is_symlink()):
        return {}
    if not state.is_file():  # a folder made there, a FIFO: never read
        kind = file_kind(state.lstat().st_mode)
        raise SweepFolderError(f"{state}: is {kind}, not the sweep's state file; {again}")
    try:
        with open(state, "rb") as f:
            rec = json.loads(f.read(1 << 20))  # a few numbers and lines: 1 MiB is plenty
    except (OSError, ValueError, RecursionError) as e:
        why = e.strerror if isinstance(e, OSError) else type(e).__name__
        raise SweepFolderError(f"{state}: cannot be read as the sweep's state ({why}); "
                               f"{again}") from None
    if not isinstance(rec, dict):
        raise SweepFolderError(f"{state}: holds a {type(rec).__name__}, not the sweep's "
                               f"state; {again}")
    return rec


def _write_state(suite: Suite, rec: dict[str, Any]) -> None:
    """``OUT/NAME.sweep.json``, replaced whole (:func:`fedloom.files.write_output`: a
    link there is replaced, not written through; a folder there is one line)."""
    from fedloom.files import write_output

    if not rec.get(FALLBACKS_KEY):
        rec = {k: v for k, v in rec.items() if k != FALLBACKS_KEY}
    write_output(suite.out / f"{suite.name}.sweep.json", json.dumps(rec, indent=2))


def run_suite(path: str | Path, workers: int = 2, log: Callable[[str], None] = print,
              report_only: bool = False, csv: str | Path | None = None) -> Suite:
    """Run (or continue) a suite, then make its report (``report_only``: from the runs
    that have finished, running nothing); ``suite.report_text`` holds it, and
    ``doc:`` gets it when the suite names one. ``csv``: the results tables as CSV.

    A sweep that runs holds ``out:`` for its whole life (:func:`_lock_out`): a second
    sweep on the same folder is refused (:class:`SweepFolderError`) before it writes
    anything, so runs of two suites never mix. ``report_only`` reads and takes no lock (a page of
    the runs finished so far, while the sweep goes on). Runs in ``out:`` that hold
    another config than the suite asks stop the sweep before anything runs
    (:class:`StaleRunsError`), and no page is made from them."""
    suite = load_suite(path)
    if report_only:
        return _report_only(suite, workers, log, csv)
    validate_suite(suite)  # every config, before the first run starts
    drop_missing_data(suite, log)
    fd = _lock_out(suite.out)
    try:
        return _run_locked(suite, workers, log, csv)
    finally:
        os.close(fd)  # the lock ends with it


def _report_only(suite: Suite, workers: int, log: Callable[[str], None],
                 csv: str | Path | None) -> Suite:
    from fedloom.report.sweep import write_report

    prior = _read_state(suite)
    try:
        chosen = _tune(suite, 0, log)
    except (FileNotFoundError, ValueError):
        chosen = {}
    tunes = suite.tuning.grids or suite.tuning.protocol
    specs = main_specs(suite, chosen) if chosen or not tunes else []
    suite.sensitivity_specs = first_seeds(suite, sensitivity_specs(suite, chosen)) if specs \
        else {}
    if suite.sequential is not None and specs:
        # the batches replayed as far as their runs have finished
        specs, _ = sequential_runs(suite, specs, finished_only, log)
    suite.report_text = write_report(suite, chosen, specs, float(prior.get("elapsed_s", 0.0)),
                                     workers, csv)
    return suite


def _run_locked(suite: Suite, workers: int, log: Callable[[str], None],
                csv: str | Path | None) -> Suite:
    from fedloom.report.sweep import write_report

    t0 = time.perf_counter()
    prior = _read_state(suite)
    spent = float(prior.get("elapsed_s", 0.0))
    # the runs that resumed from prev.pt in earlier invocations stay on record
    earlier = [str(x) for x in prior.get(FALLBACKS_KEY, [])]

    def record() -> float:
        """The sweep's wall time so far, summed over continued invocations, written
        after every batch: a sweep that is killed keeps what it had spent."""
        total = spent + time.perf_counter() - t0
        _write_state(suite, {"elapsed_s": total, "workers": workers,
                             FALLBACKS_KEY: [*earlier, *suite.fallbacks]})
        return total

    def run_batch(batch: list[RunSpec]) -> None:
        try:
            _run_all(batch, workers, log, suite.fallbacks)
        finally:
            record()

    try:
        chosen = _tune(suite, workers, log)
    except SweepError as e:  # no tuned value, no main runs: nothing to report
        e.suite = suite
        raise
    specs = main_specs(suite, chosen)
    suite.sensitivity_specs = first_seeds(suite, sensitivity_specs(suite, chosen))
    extra = [sp for rows in suite.sensitivity_specs.values() for _, sps in rows for sp in sps
             if sp.out not in {m.out for m in specs}]
    failure: SweepError | None = None
    try:
        if suite.sequential is None:
            run_batch([*specs, *dict.fromkeys(extra)])
        else:
            # the claims' runs first, batch by batch, the seeds going to the pairs whose
            # claims are still open; then the sensitivity runs (a fixed set, which no
            # verdict waits for)
            specs, failure = sequential_runs(suite, specs, run_batch, log)
            if extra:
                try:
                    run_batch(list(dict.fromkeys(extra)))
                except StaleRunsError:
                    raise
                except SweepError as e:
                    failure = failure or e
    except StaleRunsError as e:  # no page made of runs of another config
        e.suite = suite
        raise
    except SweepError as e:
        failure = e  # still report the runs that finished ("Incomplete" counts the rest)
    total = record()  # wall time of the whole sweep: the sum over continued invocations
    suite.report_text = write_report(suite, chosen, specs, total, workers, csv)
    if failure is not None:
        failure.suite = suite
        raise failure
    return suite
