"""Runs: what a run directory holds, read and checked, and the numbers a run gives.

Runs. A run directory is one that holds ``summary.json`` (a finished run) or
``metrics.jsonl`` (one still running or stopped); a directory that is neither is
searched below for run directories, except folders whose name holds ``@tune=`` or
``@sens=`` (a sweep's tuning runs: pass one explicitly to include it). From a run
this module reads ``config.yaml`` (the resolved config), ``summary.json``,
``metrics.jsonl`` (a torn last line, what a killed run leaves, is skipped) and
``client_acc.json`` (the final model's accuracy on each client's test split).
What this module computes with is checked as it is read, and anything else is one
line naming the file (and line) and the field, never a traceback.

Numbers. For each metric, each run gives one value: its ``final`` value (the
run's ``summary.json``, which holds the last logged value of every metric, plus
the derived ``test_acc_peak``, ``uplink_mb_total``, ``conflict_rate_mean`` …
of :func:`run_stats`), its ``best`` value over the logged rounds (the minimum
for a metric whose name says loss, bytes or seconds, else the maximum), or its
value at round ``R`` (the last logged at or before ``R``: evaluation metrics
exist only on evaluation rounds). A group shows the mean and the sample standard
deviation (``ddof=1``; 0 for one run) over its runs that have a value (not NaN), and
``(k/n)`` when only ``k`` of its ``n`` runs have one.

What is checked as it is read: docs/howto/cli.md (Comparing runs).
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from fedloom import bounded
from fedloom.config import safe_load_bounded


@dataclass
class Run:
    """What one run directory holds (see the module docstring)."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    metrics: list[dict[str, Any]]
    client_acc: dict[str, list[float | None]] = field(default_factory=dict)
    metric_lines: list[int] = field(default_factory=list)  # each record's line in the file

    @property
    def seed(self) -> Any:
        return self.config.get("seed", self.summary.get("seed"))

    @property
    def finished(self) -> bool:
        return bool(self.summary)


def is_run_dir(path: Path) -> bool:
    return (path / "summary.json").is_file() or (path / "metrics.jsonl").is_file()


def find_run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """The run directories named by ``paths`` or found below them (sorted, each once)."""
    found: dict[Path, None] = {}
    for p in map(Path, paths):
        if not p.exists():
            raise ValueError(f"{p}: not found")
        if not p.is_dir():
            raise ValueError(f"{p}: not a directory (give a run directory or a folder of runs)")
        if is_run_dir(p):
            found.setdefault(p, None)
            continue
        mine: list[Path] = []
        for root, dirs, _ in os.walk(p):
            here = Path(root)
            if here != p and is_run_dir(here):
                mine.append(here)
                dirs[:] = []  # a run's own folders (checkpoints, state, tensorboard)
                continue
            dirs[:] = sorted(d for d in dirs if "@tune=" not in d and "@sens=" not in d)
        if not mine:
            raise ValueError(f"{p}: holds no run directory (one with summary.json or "
                             "metrics.jsonl)")
        for r in sorted(mine):
            found.setdefault(r, None)
    return list(found)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None


class _NotJSON(ValueError):
    """Text that is not JSON; ``str(err)`` is why, in parentheses, or empty."""


def _parse_json(data: bytes) -> Any:
    """``json.loads`` whose every failure is :class:`_NotJSON`: malformed text, text
    nested deeper than Python's recursion limit (the decoder recurses per level: a
    RecursionError) or an integer longer than Python's int-parsing limit (a
    ValueError that names no file)."""
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _NotJSON("") from None
    except RecursionError:
        raise _NotJSON(" (nested too deeply)") from None
    except ValueError:
        raise _NotJSON(f" (an integer of more than {sys.get_int_max_str_digits()} "
                       "digits)") from None


def _read_json(path: Path) -> Any:
    try:
        return _parse_json(_read_bytes(path))
    except _NotJSON as e:
        raise ValueError(f"{path}: not valid JSON{e}") from None


def _what(v: Any) -> str:
    """A JSON value as a message shows it: short, whatever its size."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)
    if isinstance(v, dict):
        return "a mapping"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, str):
        return f"the string {v[:40]!r}" + ("…" if len(v) > 40 else "")
    if isinstance(v, int) and abs(v) >= 10**30:
        return f"an integer of {len(str(abs(v)))} digits"  # parsed, so under the limit
    if isinstance(v, float) and not math.isfinite(v):
        return json.dumps(v)  # NaN, Infinity, -Infinity
    return repr(v)


def _as_float(v: Any) -> float | None:
    """``v`` as a float when it is a JSON number (NaN and ±Infinity included) in
    float's range; else None (null, a boolean, a string, a list, a mapping, 10**400)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        return float(v)
    except OverflowError:
        return None


# What every metrics record holds (fedloom.engine.stages.tally.round_metrics): counts that
# run_stats and the plots compute with. And the metrics run_stats reads when present.
_COUNTS = ("uplink_bytes", "uplink_bytes_total")
_READ = ("test_acc", "conflict_rate", "grad_mismatch", "density", "residual_norm")


def check_number(where: str, key: str, v: Any) -> None:
    """Raise ``ValueError`` ("``where``, field ``key``: …", one line) unless ``v`` is a
    number; NaN is one (fedloom logs it for a metric without a value: no test split)
    and so is an infinite value (a diverged loss)."""
    if _as_float(v) is None:
        raise ValueError(f"{where}, field {key!r}: must be a number, got {_what(v)}")


def _check_row(path: Path, no: int, row: dict[str, Any]) -> None:
    """A metrics record's fields that this module computes with (module docstring):
    ``round`` an integer >= 1, the uplink counts finite numbers >= 0, the metrics
    run_stats reads numbers; ``ValueError`` naming the file, line and field."""
    where = f"{path}: line {no}"
    for key in ("round", *_COUNTS):
        if key not in row:
            raise ValueError(f"{where}, field {key!r}: missing (every metrics record has it)")
    r = row["round"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}, field 'round': must be an integer >= 1, got {_what(r)}")
    for key in _COUNTS:
        x = _as_float(row[key])
        if x is None or not math.isfinite(x) or x < 0:
            raise ValueError(f"{where}, field {key!r}: must be a finite number >= 0, got "
                             f"{_what(row[key])}")
    for key in _READ:
        if key in row:
            check_number(where, key, row[key])


def _read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The records of ``metrics.jsonl``, each checked (:func:`_check_row`), and the
    line of each; a last line that is not JSON is skipped (a torn line: what a killed
    run leaves)."""
    if not path.is_file():
        return [], []
    try:
        with open(path, "rb") as f:
            return _metrics_records(path, bounded.jsonl_lines(f))
    except OSError as e:
        raise ValueError(f"{path}: cannot be read ({e.strerror or e})") from None


def _metrics_records(path: Path, lines: Iterable[bytes | None]
                     ) -> tuple[list[dict[str, Any]], list[int]]:
    rows: list[dict[str, Any]] = []
    where: list[int] = []
    for no, line in enumerate(lines, 1):
        if line is None:  # read past, never held: a damaged file, not a record
            raise ValueError(f"{path}: line {no} is longer than {bounded.MAX_JSONL_LINE:,} "
                             "bytes, the bound on a metrics line (fedloom.bounded."
                             "MAX_JSONL_LINE): the file is damaged")
        if not line.strip():
            continue
        try:
            obj = _parse_json(line)
        except _NotJSON as e:
            if not line.endswith(b"\n") and not str(e):  # the last line, torn (not deep or long)
                continue
            raise ValueError(f"{path}: line {no} is "
                             + (f"not valid JSON{e}" if str(e) else "not a metrics record")
                             ) from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}: line {no} is not a metrics record")
        _check_row(path, no, obj)
        rows.append(obj)
        where.append(no)
    return rows, where


def _read_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object ({} when there is no file)."""
    if not path.is_file():
        return {}
    obj = _read_json(path)
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {_what(obj)}")
    return obj


def _check_client_acc(path: Path, acc: dict[str, Any]) -> None:
    """``client_acc.json``: each entry a list of accuracies, null for a client
    without a test split."""
    for key, values in acc.items():
        if not isinstance(values, list):
            raise ValueError(f"{path}: field {key!r}: must be a list of numbers, got "
                             f"{_what(values)}")
        for i, v in enumerate(values):
            if v is not None and _as_float(v) is None:
                raise ValueError(f"{path}: field '{key}[{i}]': must be a number or null, got "
                                 f"{_what(v)}")


def check_metric(run: Run, metric: str) -> None:
    """Raise ``ValueError`` (one line naming the file, line and field) when ``run``
    holds ``metric`` as anything but a number, in ``summary.json`` or a record of
    ``metrics.jsonl``."""
    if metric in run.summary:
        v = run.summary[metric]
        if _as_float(v) is None:
            raise ValueError(f"{run.path / 'summary.json'}: field {metric!r}: must be a "
                             f"number, got {_what(v)}")
    lines = run.metric_lines or list(range(1, len(run.metrics) + 1))
    for no, m in zip(lines, run.metrics, strict=True):
        if metric in m:
            check_number(f"{run.path / 'metrics.jsonl'}: line {no}", metric, m[metric])


def load_run(path: str | Path) -> Run:
    """Read one run directory (raises ``ValueError`` naming a damaged file)."""
    p = Path(path)
    cfg_file = p / "config.yaml"
    config: dict[str, Any] = {}
    if cfg_file.is_file():
        try:
            # bounded: a saved config with an alias bomb is refused, not expanded
            loaded = safe_load_bounded(_read_bytes(cfg_file).decode("utf-8"), str(cfg_file))
        except (UnicodeDecodeError, yaml.YAMLError):
            raise ValueError(f"{cfg_file}: not valid YAML") from None
        config = loaded if isinstance(loaded, dict) else {}
    summary = _read_object(p / "summary.json")
    client_acc = _read_object(p / "client_acc.json")
    _check_client_acc(p / "client_acc.json", client_acc)
    rows, lines = _read_metrics(p / "metrics.jsonl")
    return Run(p, config, summary, rows, client_acc, lines)


def run_stats(run: Run) -> dict[str, Any]:
    """The run's final values (``summary.json``, or the last logged values of a run
    that has not finished) and derived ones: ``{conflict_rate, grad_mismatch,
    density, residual_norm}_mean`` (mean over rounds), ``uplink_mb_total``,
    ``uplink_bytes_per_round``, ``test_acc_peak``; private keys ``_curve``
    (round, test_acc, cumulative uplink MB), ``_client_acc`` and ``_metrics``."""
    ms = run.metrics
    if run.summary:
        stats = dict(run.summary)
    else:
        stats = {}
        for m in ms:
            stats.update(m)
    for key in ("conflict_rate", "grad_mismatch", "density", "residual_norm"):
        vals = [m[key] for m in ms if key in m]
        stats[f"{key}_mean"] = float(np.nanmean(vals)) if vals else float("nan")
    stats["uplink_mb_total"] = ms[-1]["uplink_bytes_total"] / 1e6 if ms else float("nan")
    stats["uplink_bytes_per_round"] = (float(np.mean([m["uplink_bytes"] for m in ms]))
                                       if ms else float("nan"))
    accs = [m["test_acc"] for m in ms if "test_acc" in m]
    stats["test_acc_peak"] = max(accs) if accs else float("nan")
    stats["_curve"] = [(m["round"], m["test_acc"], m["uplink_bytes_total"] / 1e6)
                       for m in ms if "test_acc" in m]
    stats["_client_acc"] = run.client_acc
    stats["_metrics"] = ms
    stats.update(window_stats(run))
    return stats


# The evaluation metrics (fedloom.engine.stages.evaluation): logged on evaluation rounds.
EVAL_PREFIXES = ("test_", "client_", "personal_", "finetune_")


def window_stats(run: Run) -> dict[str, Any]:
    """``KEY_window`` for each evaluation metric: its mean over the evaluations of the
    run's window, the last ``⌈eval.window · rounds⌉`` rounds (evaluated every round);
    with no window (``eval.window: 0``), or none of its rounds logged yet, its last
    evaluation. ``_window``: (rounds in the window, rounds). A NaN in the window (a
    diverged round) makes the mean NaN."""
    ms = run.metrics
    if not ms:
        return {}
    ev = run.config.get("eval")
    if not isinstance(ev, dict):
        ev = {}
    window = _as_float(ev.get("window", 0.0)) or 0.0
    rounds = run.config.get("rounds")
    if not (isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= 1):
        rounds = int(ms[-1]["round"])
    k = min(rounds, math.ceil(round(window * rounds, 9)))
    out: dict[str, Any] = {"_window": (k, rounds)}
    keys = [key for key in ms[-1] if key.startswith(EVAL_PREFIXES)]
    keys += [key for m in ms for key in m if key.startswith(EVAL_PREFIXES) and key not in keys]
    for key in dict.fromkeys(keys):
        logged = [(int(m["round"]), _number(m[key])) for m in ms if key in m]
        inside = [v for r, v in logged if r > rounds - k]
        out[f"{key}_window"] = float(np.mean(inside)) if inside else logged[-1][1]
    return out


def _number(v: Any) -> float:
    x = _as_float(v)
    return float("nan") if x is None else x


def lower_is_better(metric: str) -> bool:
    # perplexity (test_ppl, client_ppl_*): a causal LM's exp(loss); "ppl" as a word of
    # the name, so that a name such as "updates_applied" is not one
    return (any(w in metric for w in ("loss", "bytes")) or "ppl" in metric.split("_")
            or metric.endswith(("_s", "_s_total")))


def metric_value(run: Run, metric: str, at: str | int = "final",
                 stats: dict[str, Any] | None = None) -> float:
    """One run's value of ``metric``: ``final``, ``best`` or at a round (module
    docstring); NaN when the run has none."""
    logged = [(m["round"], _number(m[metric])) for m in run.metrics if metric in m]
    if at == "final":
        st = stats if stats is not None else run_stats(run)
        if metric in st:
            return _number(st[metric])
        return logged[-1][1] if logged else float("nan")
    if at == "best":
        vals = [v for _, v in logged if math.isfinite(v)]
        if not vals:
            return metric_value(run, metric, "final", stats)
        return min(vals) if lower_is_better(metric) else max(vals)
    rnd = int(at)
    before = [v for r, v in logged if r <= rnd]
    return before[-1] if before else float("nan")


def first_reach(rows: Sequence[dict[str, Any]], metric: str,
                target: float) -> tuple[int, float] | None:
    """``(round, uplink_bytes_total)`` of the first row whose ``metric`` is ``>= target``."""
    for m in rows:
        v = m.get(metric)
        if isinstance(v, int | float) and not isinstance(v, bool) and v >= target:
            return int(m["round"]), float(m.get("uplink_bytes_total", float("nan")))
    return None


def mean_sd(values: Iterable[float | None]) -> tuple[float, float]:
    """Mean and sample sd (``ddof=1``; 0 for one value) of the values that are not
    None or NaN (an infinite one is kept: a diverged run shows); NaNs when none."""
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], dtype=float)
    if v.size == 0:
        return float("nan"), float("nan")
    with np.errstate(invalid="ignore"):  # an infinite value: sd NaN, quietly
        return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0
