"""The run directory's record of its data, ``data.json``: what a resume checks.

A run writes ``data.json`` when it starts: the fingerprint of the data it trains
on (:func:`fedloom.data.fingerprint.fingerprint`), ``since_round`` (0, or N for a
run from before the record resumed at round N: the data of rounds 1 … N was
never recorded) and ``changes``. A resume from a checkpoint compares the data
it loaded with the record as soon as the data is loaded, before anything in the
directory is written: other data is refused in one line naming it and what
changed (:class:`DataChangedError`), unless the change is allowed
(``allow_data_change``, ``--allow-data-change``); the record then keeps the
change, ``{"round": N, "what": …, "was": <the fingerprint before>}``: rounds
after N trained on the new data. A run with no record (made before it existed)
resumes unchecked. A resume with no checkpoint starts again at round 1 on
whatever data it is given, so it is not checked either.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from fedloom.config import DataConfig
from fedloom.data.fingerprint import fingerprint, fingerprint_diff
from fedloom.data.sources import Dataset
from fedloom.engine.runs.checkpoint import RunDirError, atomic_write_json, check_regular
from fedloom.engine.runs.directory import CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE

__all__ = ["DATA_FILE", "DataChangedError", "DataRecord", "data_path", "data_source",
           "has_checkpoint", "read_record"]

log = logging.getLogger("fedloom")

DATA_FILE = "data.json"
# A record is well under a kilobyte; anything bigger in its place is not one, and is
# never read whole.
_MAX_BYTES = 1 << 20


class DataChangedError(RunDirError):
    """A resume given other data than the run's rounds so far were trained on; one
    line naming the data and what changed."""


def data_source(cfg: DataConfig, given: bool) -> str:
    """How a message names the data: ``data.options.path``, else ``data.name=…``; data
    given in Python as such (``data.name`` then names nothing)."""
    if given:
        return "the data given in Python (run(data=...))"
    return data_path(cfg) or f"data.name={cfg.name}"


def data_path(cfg: DataConfig) -> str:
    """``data.options.path``, the file or folder a source is read from ("" when none)."""
    return str(cfg.options.get("path", ""))


def has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` keeps trained rounds to continue (a checkpoint, damaged or not:
    a resume from it says what is wrong)."""
    return any((run_dir / n).exists() or (run_dir / n).is_symlink()
               for n in (CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE))


def _damaged(path: Path, why: str) -> RunDirError:
    return RunDirError(f"{path}: {why}: the run's data record is damaged (remove it to resume "
                       "without the data check, as a run from before the record)")


def read_record(run_dir: Path) -> dict[str, Any] | None:
    """``data.json`` of ``run_dir`` checked, or ``None`` when there is none (a run from
    before the record); :class:`RunDirError`, one line naming it, when it is damaged."""
    path = run_dir / DATA_FILE
    if not (path.exists() or path.is_symlink()):
        return None
    check_regular(path, "the run's data record")
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_BYTES + 1)
    except OSError as e:
        raise RunDirError(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(raw) > _MAX_BYTES:
        raise _damaged(path, f"over {_MAX_BYTES} bytes")
    try:
        rec = json.loads(raw.decode("utf-8"))
    # ValueError: malformed JSON (or an integer past the parsing limit); RecursionError:
    # nesting deeper than the parser's stack
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise _damaged(path, "not UTF-8 JSON") from None
    fp = rec.get("fingerprint") if isinstance(rec, dict) else None
    if not (isinstance(fp, dict) and isinstance(fp.get("sha256"), str)
            and isinstance(rec.get("changes", []), list)
            and isinstance(rec.get("since_round", 0), int)):
        raise _damaged(path, "no fingerprint with its sha256, changes and since_round")
    return rec


class DataRecord:
    """The data check of one run in ``run_dir``: :meth:`check` when the data is
    loaded (refuses other data on a resume), :meth:`write` once the round the run
    starts from is known."""

    def __init__(self, run_dir: Path, resume: bool, allow_change: bool, source: str,
                 path: str = "") -> None:
        self.run_dir, self.resume, self.allow_change = run_dir, resume, allow_change
        self.source, self.path = source, path
        self.fingerprint: dict[str, Any] | None = None
        self.old: dict[str, Any] | None = None  # the record a resume compared with
        self.changed: str | None = None  # what changed, when allowed

    def check(self, ds: Dataset) -> None:
        """Fingerprint ``ds``; on a resume from a checkpoint, compare it with the record.
        Raises :class:`DataChangedError` for other data unless the change is allowed."""
        self.fingerprint = fingerprint(ds, self.source, self.path)
        if not (self.resume and has_checkpoint(self.run_dir)):
            return
        self.old = read_record(self.run_dir)
        if self.old is None:
            return
        why = fingerprint_diff(self.old["fingerprint"], self.fingerprint)
        if why is not None and not self.allow_change:
            raise DataChangedError(
                f"{self.source}: not the data the run in {self.run_dir} was trained on: {why}; "
                "resume needs the same data (--allow-data-change, or run(..., "
                f"allow_data_change=True), continues on this data and notes it in {DATA_FILE})")
        self.changed = why

    def write(self, next_round: int) -> None:
        """Write ``data.json`` for a run that starts from round ``next_round + 1``: the
        changes of the rounds it keeps, and this one's if the data changed (logged)."""
        assert self.fingerprint is not None, "check() runs when the data is loaded"
        path = self.run_dir / DATA_FILE
        old = self.old if next_round > 0 else None
        if next_round > 0 and old is None:
            log.info("%s: no record of the data of rounds 1–%d (a run from before %s): "
                     "not checked; recorded from round %d on", path, next_round, DATA_FILE,
                     next_round + 1)
        # A change noted at a later round was of rounds run again now: not this run's.
        changes = [c for c in (old or {}).get("changes", [])
                   if isinstance(c, dict) and isinstance(c.get("round"), int)
                   and c["round"] <= next_round]
        if old is not None and self.changed is not None:
            changes.append({"round": next_round, "what": self.changed,
                            "was": old["fingerprint"]})
            log.warning("%s: the data changed after round %d (%s); rounds from %d on train "
                        "on it (allowed; noted in %s)", self.source, next_round, self.changed,
                        next_round + 1, path)
        since = next_round if old is None else min(int(old.get("since_round", 0)), next_round)
        atomic_write_json(path, {"fingerprint": self.fingerprint, "since_round": since,
                                 "changes": changes})
