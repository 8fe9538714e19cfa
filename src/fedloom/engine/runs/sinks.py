"""Where a run's per-round metrics go besides ``metrics.jsonl``.

``metrics.jsonl`` stays the record: a resume validates it against the checkpoint
and truncates it to the rounds the checkpoint covers (``loop._read_metrics``).
The sinks here are views of it, rebuilt from it whenever they could disagree:

- ``metrics.csv`` (``logging.csv``, on by default): the same rows, one a round.
  Its columns are the union of the rows' keys in the order they first appear
  (round 1's keys in its order, then each later new key where it first shows
  up), so the file is a function of the jsonl alone: a resumed run rebuilds it
  from the validated, truncated jsonl, and a run resumed with ``logging.csv``
  off removes it rather than keep a copy that disagrees. A key first seen in a later round
  (``test_acc`` when ``eval.every > 1``, ``rejected_reasons`` when a client is
  rejected) makes the file be rewritten with the wider header (atomically);
  otherwise a round appends one line (:func:`append_text`: never through a
  link, never to a file with a second name). A cell holds ``json.dumps`` of the value
  (``NaN``/``Infinity`` for non-finite floats, which pandas reads as floats;
  lists and mappings as JSON), a string as it is, and nothing where the round
  lacks the key.
- TensorBoard (``logging.tensorboard``): every numeric value of a round as a
  scalar at step ``round`` in ``RUN/tensorboard``, written with
  ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package,
  the ``tensorboard`` extra). A resumed run opens the writer with
  ``purge_step`` = its first round, so events a killed run wrote after its last
  checkpoint are hidden, as TensorBoard documents for that argument.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from fedloom.engine.runs.checkpoint import atomic_write_bytes
from fedloom.files import open_in_place

__all__ = ["METRICS_CSV_FILE", "TENSORBOARD_DIR", "MetricsCSV", "TensorBoardSink",
           "csv_columns", "csv_text"]

METRICS_CSV_FILE = "metrics.csv"
TENSORBOARD_DIR = "tensorboard"


def csv_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The union of the rows' keys, in order of first appearance."""
    seen: dict[str, None] = {}
    for row in rows:
        for k in row:
            seen.setdefault(k, None)
    return list(seen)


def _cell(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value)


def _lines(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    for row in rows:
        w.writerow(["" if c not in row else _cell(row[c]) for c in columns])
    return buf.getvalue()


def csv_text(rows: Sequence[dict[str, Any]]) -> str:
    """The whole CSV of ``rows`` (header first)."""
    columns = csv_columns(rows)
    return _lines([{c: c for c in columns}], columns) + _lines(rows, columns)


def append_text(path: Path) -> TextIO:
    """``path`` opened to append text (UTF-8), created if missing; a link, anything
    but a regular file, or a file with a second name is refused
    (:class:`fedloom.files.NotInPlace`, one line): the rows of a run are appended
    to its own files only, never to what a link there points to."""
    return os.fdopen(open_in_place(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "a",
                     encoding="utf-8")


class MetricsCSV:
    """``metrics.csv`` kept equal to the rows of ``metrics.jsonl``.

    ``rows`` is the run's history list (the caller appends to it); construction
    writes the file from it (a resumed run's truncated history included), and
    :meth:`write_last` adds its newest row.
    """

    def __init__(self, path: Path, rows: list[dict[str, Any]]) -> None:
        self.path = path
        self.rows = rows
        self._rewrite()

    def _rewrite(self) -> None:
        self.columns = csv_columns(self.rows)
        atomic_write_bytes(self.path, csv_text(self.rows).encode() if self.rows else b"")

    def write_last(self) -> None:
        row = self.rows[-1]
        if any(k not in self.columns for k in row) or not self.columns:
            self._rewrite()  # a new key: the header widens, earlier rows get empty cells
            return
        with append_text(self.path) as f:
            f.write(_lines([row], self.columns))


class TensorBoardSink:
    """Scalars of each round in ``log_dir`` (see the module docstring)."""

    def __init__(self, log_dir: Path, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def write(self, row: dict[str, Any]) -> None:
        step = int(row["round"])
        for k, v in row.items():
            # bool is an int: a flag is not a curve; lists and mappings are per-client detail
            if k == "round" or isinstance(v, bool) or not isinstance(v, int | float):
                continue
            self.writer.add_scalar(k, float(v), step)
        self.writer.flush()  # people watch a run live: each round is on disk when it ends

    def close(self) -> None:
        self.writer.close()
