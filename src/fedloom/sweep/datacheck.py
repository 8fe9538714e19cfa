"""A sweep reuses a run in ``out:`` only if it was trained on the data its setting
names now.

A finished run (its ``summary.json`` stands in for the run asked) or a stopped one
with a checkpoint (the sweep resumes it) whose ``data.json``
(:mod:`fedloom.engine.runs.datarecord`) records other data than the setting's data now
— a CSV cut, an ``.npz`` replaced — stops the sweep before the runs it is one of
start, as a run of another config does (:class:`~fedloom.sweep.suite.StaleRunsError`,
one line naming the first run, the data and what changed). The data is loaded
and fingerprinted once for each data section and seed the runs share. A run with
no record (made before it existed), or a damaged one, or data that does not load
now, is left to the run or the report to say.
"""

from __future__ import annotations

import json
from typing import Any

from fedloom.sweep.suite import RunSpec, StaleRunsError

__all__ = ["check_data"]


def _now(spec: RunSpec, seen: dict[str, dict[str, Any] | None]) -> dict[str, Any] | None:
    """The fingerprint of ``spec``'s data as its config names it now (``None`` when
    it does not load), computed once per data section and seed (``seen``)."""
    from fedloom.config import config_to_dict, load_config
    from fedloom.data.fingerprint import fingerprint
    from fedloom.data.sources import DatasetUnavailable, load_dataset
    from fedloom.engine.runs.datarecord import data_path, data_source

    try:
        cfg = load_config(spec.config, [*spec.overrides, f"seed={spec.seed}"])
    except (OSError, ValueError):  # the run or its check says what is wrong
        return None
    key = json.dumps([config_to_dict(cfg)["data"], cfg.seed], sort_keys=True, default=str)
    if key not in seen:
        try:
            seen[key] = fingerprint(load_dataset(cfg.data, cfg.seed),
                                    data_source(cfg.data, False), data_path(cfg.data))
        except (DatasetUnavailable, OSError, ValueError):
            seen[key] = None
    return seen[key]


def check_data(specs: list[RunSpec]) -> None:
    """:class:`StaleRunsError` when a run of ``specs`` that the sweep would reuse or
    resume was trained on other data than its setting names now."""
    from fedloom.data.fingerprint import fingerprint_diff
    from fedloom.engine.runs.checkpoint import RunDirError
    from fedloom.engine.runs.datarecord import has_checkpoint, read_record

    seen: dict[str, dict[str, Any] | None] = {}
    changed: list[tuple[RunSpec, str]] = []
    for s in specs:
        if not (s.out.is_dir() and (s.done or has_checkpoint(s.out))):
            continue
        try:
            rec = read_record(s.out)
        except RunDirError:
            continue
        now = _now(s, seen) if rec is not None else None
        why = fingerprint_diff(rec["fingerprint"], now) if rec and now else None
        if why is not None:
            changed.append((s, f"{now['source'] if now else '?'}: {why}"))
    if changed:
        s, why = changed[0]
        done = sum(sp.done for sp, _ in changed)
        what = " and ".join([*([f"{done} finished"] if done else []),
                             *([f"{len(changed) - done} stopped"] if done < len(changed)
                               else [])])
        raise StaleRunsError(f"{what} runs were trained on other data than their setting "
                             f"names now (first: {s.out}: {why}); remove them or give the "
                             "suite its own out:")
