"""Compare runs: tables and plots across run directories, mean ± sd over seeds.

``fedloom compare RUN_OR_SWEEP_DIR …`` and the pages of ``fedloom sweep`` are
made by this module (one implementation of reading, grouping, aggregating and
plotting runs).

Runs. A run directory is one that holds ``summary.json`` (a finished run) or
``metrics.jsonl`` (one still running or stopped); a directory that is neither is
searched below for run directories, except folders whose name holds ``@tune=`` or
``@sens=``
(a sweep's tuning runs: pass one explicitly to include it). From a run this
module reads ``config.yaml`` (the resolved config), ``summary.json``,
``metrics.jsonl`` (a torn last line, what a killed run leaves, is skipped) and
``client_acc.json`` (the final model's accuracy on each client's test split).
What this module computes with is checked as it is read, and anything else is one
line naming the file (and line) and the field, never a traceback: each metrics
record has ``round`` (an integer >= 1) and the uplink counts (finite numbers >= 0),
the metrics a table shows are numbers wherever they appear (NaN is one: fedloom
logs it for a metric without a value; so is an infinite, diverged loss), and
``client_acc.json`` holds lists of numbers or nulls. JSON nested deeper than
Python's recursion limit or holding an integer longer than its int-parsing limit
(4300 digits) is refused naming the file (and line).

Groups. Runs whose resolved configs are equal except for ``seed``, ``name``,
``logging`` and ``checkpoint`` (none of which changes what is computed) form one
group: the seeds of one experiment. A config is first brought to this version's
schema (missing keys get their defaults) so that runs written before a key
existed still group with new ones. ``--group-by KEY …`` groups by those dotted
keys instead (runs that differ elsewhere are then pooled). A group is labelled
by the keys whose values differ between groups.

Numbers. For each metric, each run gives one value: its ``final`` value (the
run's ``summary.json``, which holds the last logged value of every metric, plus
the derived ``test_acc_peak``, ``uplink_mb_total``, ``conflict_rate_mean`` …
of :func:`run_stats`), its ``best`` value over the logged rounds (the minimum
for a metric whose name says loss, bytes or seconds, else the maximum), or its
value at round ``R`` (the last logged at or before ``R``: evaluation metrics
exist only on evaluation rounds). A group shows the mean and the sample standard
deviation (``ddof=1``; 0 for one run) over its runs that have a value (not NaN), and
``(k/n)`` when only ``k`` of its ``n`` runs have one.

Targets. With a target ``T`` on a metric (default ``test_acc``), a run reaches
it at the first logged round whose value is ``>= T``; the group shows the mean
± sd of that round and of ``uplink_bytes_total`` at that round over the runs
that reach it, with ``(k/n)`` when some do not.

Plots (matplotlib, the ``report`` extra): the metric against the round and
against cumulative uplink, each group's mean over its seeds as a line and
mean ± sd as a band (over the rounds every run of the group logged; the uplink
axis is the seeds' mean cumulative uplink at each such round, logarithmic); and
the per-client accuracy CDF: the mean of the runs' empirical CDFs with a ± sd
band. (With equally many clients per run, that mean is the CDF of all seeds'
clients pooled.) Round axes have integer ticks; log axes label 1, 2, 5 × 10^k
(1 × 10^k only, over more than 2.5 decades) as plain numbers, minor ticks
unlabelled, so labels do not collide.

Facets. The plots of ``fedloom compare`` have one row per facet: per distinct
combination of the ``data.*`` keys that differ between groups (a setting is its
data; ``data.name`` first, then ``data.partition.*``, then the rest), or of the
keys of ``--facet KEY …`` (``--facet none``: one facet). A row holds the round and
the uplink panels (the CDF: one panel) under its facet's values
(``data.name=mnist, alpha=0.1``), its legend to the right of its panels, one
label a line, top-aligned with them: never over a curve; the figure widens for
the widest label and grows a row's height per facet. In a panel a group is
labelled by the keys that differ among that panel's groups only (``*.name`` keys
first, by their value; others by their last component unless two share it),
never by the facet's keys; a label keeps its colour across facets and plots
while the labels fit ten colours. One facet is the figure of a small comparison:
both panels side by side, the legend below them in as many columns as fit.
A panel draws at most ``--max-lines N`` groups (default 8; 0: all): the N whose
line ends highest (lowest for a loss, bytes or seconds metric), kept in their
order, the same ones in both plots; its title says how many of how many, and the
printed notes name the groups left out
(``plots: facet data.name=mnist: 12 groups, 8 drawn …; not drawn: a | b``).
"""

from __future__ import annotations

import csv
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

from fedloom.config import safe_load_bounded

__all__ = [
    "Group",
    "Run",
    "cap_lines",
    "cdf_facets_figure",
    "compare_table",
    "curves_facets_figure",
    "curves_figure",
    "facet_groups",
    "facet_keys",
    "find_run_dirs",
    "first_reach",
    "group_runs",
    "load_run",
    "mean_sd",
    "metric_value",
    "paired_table",
    "panel_labels",
    "plot_cdf",
    "plot_cdf_faceted",
    "plot_curves",
    "plot_curves_faceted",
    "run_stats",
    "write_csv",
]

# Keys of a resolved config that do not change what a run computes.
IGNORED_KEYS = ("seed", "name", "logging", "checkpoint")
DEFAULT_METRICS = ("test_acc", "client_acc_mean", "client_acc_worst10")


# ------------------------------------------------------------------------- reading
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


# What every metrics record holds (fedloom.engine.record.round_metrics): counts that
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
    lines = _read_bytes(path).split(b"\n")
    rows: list[dict[str, Any]] = []
    where: list[int] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = _parse_json(line)
        except _NotJSON as e:
            if no == len(lines) and not str(e):  # torn, not deep or long
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
    return stats


def _number(v: Any) -> float:
    x = _as_float(v)
    return float("nan") if x is None else x


def lower_is_better(metric: str) -> bool:
    return any(w in metric for w in ("loss", "bytes")) or metric.endswith(("_s", "_s_total"))


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


# ------------------------------------------------------------------------ grouping
def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))  # an empty mapping sets nothing
        else:
            # hashable and printable: a list as its JSON text
            out[key] = json.dumps(v) if isinstance(v, list) else v
    return out


def _normalised(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` in this version's schema (defaults filled in), else as it is."""
    if not config:
        return config
    from fedloom.config import ConfigError, config_from_dict, config_to_dict

    try:
        return config_to_dict(config_from_dict(config))
    except (ConfigError, ValueError, TypeError):
        return config


@dataclass
class Group:
    """Runs of one experiment (they differ by seed only, or share ``--group-by``)."""

    keys: dict[str, Any]     # the dotted keys that tell this group from the others
    runs: list[Run]
    label: str = ""

    @property
    def seeds(self) -> list[Any]:
        return [r.seed for r in self.runs]


def group_runs(runs: Sequence[Run], by: Sequence[str] | None = None) -> list[Group]:
    """Group ``runs`` (module docstring), in order of each group's first run."""
    flat = []
    for r in runs:
        f = _flatten(_normalised(r.config))
        for k in list(f):
            if k.split(".")[0] in IGNORED_KEYS:
                del f[k]
        flat.append(f)
    if by:
        for b in by:
            if not any(b in f for f in flat):
                raise ValueError(f"--group-by {b}: no run's config has that key")
        idents = [tuple((b, f.get(b)) for b in by) for f in flat]
    else:
        idents = [tuple(sorted(f.items(), key=lambda kv: kv[0])) for f in flat]
    order: dict[tuple[Any, ...], list[int]] = {}
    for i, ident in enumerate(idents):
        order.setdefault(ident, []).append(i)
    firsts = [flat[ix[0]] for ix in order.values()]
    if by:
        differ = list(by)
    else:
        all_keys: dict[str, None] = {}
        for f in firsts:
            all_keys.update(dict.fromkeys(f))
        differ = [k for k in all_keys if len({json.dumps(f.get(k), default=str)
                                               for f in firsts}) > 1]
    groups = []
    for ix, first in zip(order.values(), firsts, strict=True):
        keys = {k: first.get(k) for k in differ}
        # by seed within a group (seed10 after seed2); runs without one keep their place
        members = sorted((runs[i] for i in ix), key=lambda r: (
            not isinstance(r.seed, int), r.seed if isinstance(r.seed, int) else 0))
        label = _label(keys, differ) or str(members[0].config.get("name")
                                            or members[0].path.name)
        groups.append(Group(keys, members, label))
    return groups


def _show(v: Any) -> str:
    return "–" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def _label(keys: dict[str, Any], differ: Sequence[str]) -> str:
    """A short legend label: ``craft, clip_norm=1`` for ``aggregator.name=craft,
    server.clip_norm=1.0`` (a ``*.name`` key by its value, others by their last
    component unless two differing keys share it); keys the group lacks are left out."""
    tails = [k.rsplit(".", 1)[-1] for k in differ]
    parts = []
    for k, v in keys.items():
        if v is None:
            continue
        tail = k.rsplit(".", 1)[-1]
        if tail == "name" and "." in k:
            parts.append(_show(v))
        else:
            parts.append(f"{tail if tails.count(tail) == 1 else k}={_show(v)}")
    return ", ".join(parts)


# ------------------------------------------------------------------------ tables
def _fmt_value(mean: float, sd: float, k: int, n: int) -> str:
    if k == 0 or math.isnan(mean):
        return "–"
    if abs(mean) >= 1e5:
        text = f"{mean:,.0f}" + (f" ± {sd:,.0f}" if k > 1 else "")
    else:
        text = f"{mean:.4g}" + (f" ± {sd:.2g}" if k > 1 else "")
    return text + (f" ({k}/{n})" if k < n else "")


def compare_table(groups: Sequence[Group], metrics: Sequence[str], at: str | int = "final",
                  target: float | None = None, target_metric: str = "test_acc"
                  ) -> tuple[list[str], list[list[str]], list[dict[str, Any]]]:
    """``(header, text rows, CSV records)`` of the comparison (module docstring)."""
    key_cols = list(groups[0].keys) if groups and groups[0].keys else ["run"]
    header = [*key_cols, "seeds"]
    at_label = at if at in ("final", "best") else f"round {at}"
    header += [f"{m} ({at_label})" for m in metrics]
    if target is not None:
        header += [f"rounds to {target_metric} ≥ {target:g}", "uplink MB to target"]
    rows: list[list[str]] = []
    records: list[dict[str, Any]] = []
    for g in groups:
        stats = [run_stats(r) for r in g.runs]
        n = len(g.runs)
        cells = ([_show(g.keys[k]) for k in key_cols] if g.keys else [g.label])
        cells.append(",".join(str(s) for s in g.seeds))
        rec: dict[str, Any] = dict(g.keys) if g.keys else {"run": g.label}
        rec.update({"runs": n, "seeds": " ".join(str(s) for s in g.seeds)})
        for m in metrics:
            vals = [metric_value(r, m, at, s) for r, s in zip(g.runs, stats, strict=True)]
            k = sum(not math.isnan(v) for v in vals)
            mu, sd = mean_sd(vals)
            cells.append(_fmt_value(mu, sd, k, n))
            rec.update({f"{m}_mean": mu, f"{m}_sd": sd, f"{m}_n": k})
        if target is not None:
            hits = [h for h in (first_reach(r.metrics, target_metric, target) for r in g.runs)
                    if h is not None]
            rmu, rsd = mean_sd([h[0] for h in hits])
            bmu, bsd = mean_sd([h[1] for h in hits])
            if hits:
                cells.append(_fmt_value(rmu, rsd, len(hits), n))
                cells.append(_fmt_value(bmu / 1e6, bsd / 1e6, len(hits), n))
            else:
                cells += ["not reached", "–"]
            rec.update({"target": target, "target_metric": target_metric,
                        "target_reached": len(hits),
                        "rounds_to_target_mean": rmu, "rounds_to_target_sd": rsd,
                        "uplink_bytes_to_target_mean": bmu, "uplink_bytes_to_target_sd": bsd})
        rec["paths"] = ";".join(str(r.path) for r in g.runs)
        rows.append(cells)
        records.append(rec)
    return header, rows, records


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned plain-text columns (a terminal table)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(f"{h:<{w}}" for h, w in zip(header, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def esc(c: str) -> str:
        return str(c).replace("|", "\\|")

    lines = ["| " + " | ".join(esc(h) for h in header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: str | Path, records: Sequence[dict[str, Any]]) -> Path:
    """``records`` as CSV; columns are the union of their keys in first-seen order."""
    p = Path(path)
    cols: dict[str, None] = {}
    for rec in records:
        cols.update(dict.fromkeys(rec))
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(cols), lineterminator="\n")
        w.writeheader()
        for rec in records:
            w.writerow({k: ("" if v is None else v) for k, v in rec.items()})
    return p


# ------------------------------------------------------------------------- plots
DEFAULT_MAX_LINES = 8


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _round_axis(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def log_ticks(axis: Any, lo: float, hi: float) -> None:
    """Ticks of a log-scaled ``axis`` (``ax.xaxis`` / ``ax.yaxis``) spanning
    ``lo … hi``: 1, 2, 5 × 10^k (1 × 10^k over more than 2.5 decades) labelled as
    plain numbers, minor ticks unlabelled, so labels never crowd each other."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    decades = math.log10(hi / lo) if lo > 0 and hi > lo else 0.0
    subs = (1.0,) if decades > 2.5 else (1.0, 2.0, 5.0)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    axis.set_minor_formatter(NullFormatter())


def _log_axis(ax: Any, lo: float, hi: float) -> None:
    ax.set_xscale("log")
    log_ticks(ax.xaxis, lo, hi)


def _band_curves(runs: Sequence[dict[str, Any]], metric: str
                 ) -> tuple[list[int], np.ndarray, np.ndarray, np.ndarray] | None:
    """Rounds every run logged ``metric`` at; mean and sd of it; mean cumulative MB."""
    per_run = [{m["round"]: (_number(m[metric]), m.get("uplink_bytes_total", float("nan")))
                for m in r["_metrics"] if metric in m} for r in runs]
    if not per_run:
        return None
    common = sorted(set.intersection(*(set(d) for d in per_run)))
    if not common:
        return None
    vals = np.array([[d[k][0] for k in common] for d in per_run], dtype=float)
    mb = np.array([[d[k][1] for k in common] for d in per_run], dtype=float) / 1e6
    sd = vals.std(axis=0, ddof=1) if len(per_run) > 1 else np.zeros(len(common))
    return common, vals.mean(axis=0), sd, mb.mean(axis=0)


# Runs of one panel: legend label -> the run_stats dicts of that group's runs.
Panel = dict[str, Sequence[dict[str, Any]]]


def _varying(groups: Sequence[Group]) -> list[str]:
    """The keys of the groups' ``keys`` whose values are not all equal among
    ``groups``, in first-seen order."""
    seen = dict.fromkeys(k for g in groups for k in g.keys)
    return [k for k in seen
            if len({json.dumps(g.keys.get(k), default=str) for g in groups}) > 1]


def facet_keys(groups: Sequence[Group]) -> list[str]:
    """The keys to facet ``groups`` by when none are given: the ``data.*`` keys whose
    values differ between groups (a setting is its data), ``data.name`` first, then
    ``data.partition.*``, then the other ``data.*`` keys; [] (one facet) when none
    differ."""
    def rank(key: str) -> int:
        return 0 if key == "data.name" else 1 if key.startswith("data.partition.") else 2

    return sorted((k for k in _varying(groups) if k.startswith("data.")), key=rank)


def _facet_text(values: dict[str, Any]) -> str:
    """``data.name=mnist, partition.name=dirichlet, alpha=0.1``: each key by its
    shortest dotted suffix that no other key ends with and that is not a bare
    ``name`` (which would not say whose name); keys without a value are left out."""
    def short(key: str) -> str:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            tail = ".".join(parts[-n:])
            if tail != "name" and sum(o == tail or o.endswith("." + tail)
                                      for o in values) == 1:
                return tail
        return key

    return ", ".join(f"{short(k)}={_show(v)}" for k, v in values.items() if v is not None)


def facet_groups(groups: Sequence[Group], keys: Sequence[str] | None = None
                 ) -> dict[str, list[Group]]:
    """``groups`` split by the values of ``keys`` (dotted config keys; None: those of
    :func:`facet_keys`), one facet per distinct combination, named like
    ``data.name=mnist, alpha=0.1``, in order of each facet's first group; the groups
    keep their order. No keys: one facet named ``""``. A group's value is its
    ``keys`` entry, else its first run's (normalised) config's. A key no run's
    config has raises ``ValueError`` naming it."""
    keys = facet_keys(groups) if keys is None else list(keys)
    if not keys:
        return {"": list(groups)}
    flats: dict[int, dict[str, Any]] = {}

    def config_of(g: Group) -> dict[str, Any]:
        # as group_runs reads a config: in this version's schema, flattened
        if id(g) not in flats:
            flats[id(g)] = _flatten(_normalised(g.runs[0].config)) if g.runs else {}
        return flats[id(g)]

    for k in keys:
        if not any(k in g.keys or k in config_of(g) for g in groups):
            raise ValueError(f"--facet {k}: no run's config has that key")
    names: dict[tuple[str, ...], str] = {}
    facets: dict[str, list[Group]] = {}
    for g in groups:
        values = {k: g.keys[k] if k in g.keys else config_of(g).get(k) for k in keys}
        ident = tuple(json.dumps(v, default=str) for v in values.values())
        if ident not in names:
            name = _facet_text(values) or "–"
            # two value combinations that print alike still get a facet each
            names[ident] = name if name not in facets else f"{name} ({len(names) + 1})"
            facets[names[ident]] = []
        facets[names[ident]].append(g)
    return facets


def panel_labels(panel: Sequence[Group], facet: Sequence[str] = ()) -> list[str]:
    """Legend labels of the groups of one panel, in its order: :func:`_label` of the
    keys whose values differ among these groups (never the ``facet`` keys, which the
    panel's title names). A group still unlabelled (a panel of one) is labelled by
    all its keys but the facet's, else by its own label; a label that repeats gets
    `` #2``, `` #3`` …. ``*.name`` keys lead: what a group runs is read first."""
    def names_first(keys: Iterable[str]) -> list[str]:
        return sorted(keys, key=lambda k: not k.endswith(".name"))

    differ = names_first(k for k in _varying(panel) if k not in facet)
    out: list[str] = []
    for g in panel:
        text = _label({k: g.keys.get(k) for k in differ}, differ)
        if not text:
            rest = names_first(k for k in g.keys if k not in facet)
            text = _label({k: g.keys[k] for k in rest}, rest) or g.label
        n = sum(o == text or o.startswith(text + " #") for o in out)
        out.append(text if n == 0 else f"{text} #{n + 1}")
    return out


def cap_lines(panel: Panel, metric: str, max_lines: int) -> tuple[Panel, list[str]]:
    """The ``max_lines`` groups of ``panel`` whose line ends best (its mean of
    ``metric`` at the last round all its runs logged: the highest, or the lowest for
    a metric where lower is better); groups without a finite end come last, ties go
    to the earlier group. Returns those groups in the panel's order and the labels
    of the others, in the panel's order. ``max_lines`` 0 keeps every group."""
    labels = list(panel)
    if max_lines <= 0 or len(labels) <= max_lines:
        return dict(panel), []
    sign = 1.0 if lower_is_better(metric) else -1.0

    def rank(i: int) -> tuple[int, float, int]:
        bands = _band_curves(panel[labels[i]], metric)
        end = float(bands[1][-1]) if bands is not None else float("nan")
        return (0, sign * end, i) if math.isfinite(end) else (1, 0.0, i)

    keep = set(sorted(range(len(labels)), key=rank)[:max_lines])
    return ({lab: panel[lab] for i, lab in enumerate(labels) if i in keep},
            [lab for i, lab in enumerate(labels) if i not in keep])


def _palette(facets: dict[str, Panel]) -> dict[str, str] | None:
    """One colour per label across all facets (a method keeps its colour from panel
    to panel and between the curves and the CDF) when the labels fit the ten
    colours of the default cycle; None otherwise (colours by position in a panel)."""
    labels = dict.fromkeys(lab for panel in facets.values() for lab in panel)
    return {lab: f"C{i}" for i, lab in enumerate(labels)} if len(labels) <= 10 else None


def _line_style(i: int, label: str, colors: dict[str, str] | None) -> dict[str, Any]:
    """Colour (and dashes) of the ``i``-th group of a panel: its label's colour, else
    the cycle's ``i``-th, dashed anew on each pass through its ten colours so lines
    11 and up do not repeat lines 1 … 10."""
    if colors is not None and label in colors:
        return {"color": colors[label]}
    return {"color": f"C{i % 10}", "ls": ("-", "--", ":", "-.")[i // 10 % 4]}


def _facet_title(ax: Any, facet: str, note: str | None) -> None:
    """A facet's name (and note) over its row, from the row's left edge, running on
    above the next panel when long, broken into lines where wider than the figure.
    It is text, not the title: the layout counts a title's centre, which a title
    longer than its panel puts into the gap between the panels (widening that); a
    blank title of as many lines keeps its height."""
    import textwrap

    import matplotlib as mpl
    from matplotlib.textpath import TextPath

    text = facet + (f" · {note}" if note else "")
    room = (ax.figure.get_figwidth() - 0.8) * 72  # points from the panel's left edge on
    wide = TextPath((0, 0), text, size=10).get_extents().width
    lines = textwrap.wrap(text, max(20, int(len(text) * room / wide))) if wide > room else [text]
    ax.set_title("\n".join(" " * len(lines)), fontsize=10)
    ax.annotate("\n".join(lines), xy=(0.0, 1.0), xycoords="axes fraction",
                xytext=(0.0, mpl.rcParams["axes.titlepad"]), textcoords="offset points",
                ha="left", va="baseline", fontsize=10).set_in_layout(False)


def _legend_below(fig: Any, source: Any, max_cols: int) -> None:
    """``source``'s lines as a legend below ``fig``'s panels (7 pt), in as many
    columns (up to ``max_cols``) as the widest label lets fit across the figure; the
    figure widens for a label wider than itself and grows a line's height for each
    legend row past the first, so long or many labels are never cut off and do not
    squeeze the panels."""
    from matplotlib.textpath import TextPath

    handles, labels = source.get_legend_handles_labels()
    if not labels:
        return
    # a column: the label, its line (2 em), the pad and the column spacing (2 em)
    col = max(TextPath((0, 0), lab, size=7).get_extents().width for lab in labels) / 72 + 0.55
    width, height = fig.get_size_inches()
    ncols = max(1, min(max_cols, len(labels), int((width - 0.3) // col)))
    rows = -(-len(labels) // ncols)
    fig.set_size_inches(max(width, col + 0.3), height + 0.16 * (rows - 1))
    fig.legend(handles, labels, loc="outside lower center", ncols=ncols, fontsize=7,
               frameon=False)


def _legend_width(facets: dict[str, Panel]) -> float:
    """Inches a legend of :func:`_legend_right` takes for the facets' widest label
    (its 8 pt text, the line before it, the pads), at most 8: the figure widens by
    it rather than squeeze its panels."""
    from matplotlib.textpath import TextPath

    widest = max((TextPath((0, 0), lab, size=8).get_extents().width
                  for panel in facets.values() for lab in panel), default=0.0)
    return min(widest / 72 + 0.7, 8.0)


def _legend_right(ax: Any, source: Any) -> None:
    """``source``'s lines as a legend to the right of ``ax``, top-aligned with it,
    one label a line: never over a curve, beside the panels it names. In one
    constrained layout the widest row's legend sets the margin of every row, so
    the rows' panels stay aligned."""
    ax.legend(*source.get_legend_handles_labels(), loc="upper left",
              bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8, frameon=False)


def _draw_curves(axes: Sequence[Any], groups: Panel, metric: str, scale: float,
                 colors: dict[str, str] | None) -> tuple[float, float, bool]:
    """Each group's mean line and ± sd band on ``axes`` (vs round, vs uplink MB);
    returns the uplink axis' positive range and whether anything was drawn."""
    lo, hi, drawn = math.inf, 0.0, False
    for i, (label, runs) in enumerate(groups.items()):
        bands = _band_curves(runs, metric)
        if bands is None:
            continue
        rounds, mu, sd, mb = bands
        style = _line_style(i, label, colors)
        axes[0].plot(rounds, mu * scale, label=label, **style)
        axes[1].plot(mb, mu * scale, label=label, **style)
        if len(runs) > 1:
            for ax, x in ((axes[0], rounds), (axes[1], mb)):
                ax.fill_between(x, (mu - sd) * scale, (mu + sd) * scale,
                                color=style["color"], alpha=0.2, lw=0)
        pos = mb[np.isfinite(mb) & (mb > 0)]
        if pos.size:
            lo, hi = min(lo, float(pos.min())), max(hi, float(pos.max()))
        drawn = True
    return lo, hi, drawn


def _style_curve_axes(axes: Sequence[Any], metric: str, percent: bool,
                      target: float | None, lo: float, hi: float) -> None:
    name = {"test_acc": "test accuracy"}.get(metric, metric.replace("_", " "))
    ylabel = name + (" (%)" if percent else "")
    for ax, xl in zip(axes, ("round", "cumulative uplink (MB)"), strict=True):
        ax.set_xlabel(xl)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if target is not None:
            ax.axhline(target * (100.0 if percent else 1.0), color="grey", ls=":", lw=1)
    _round_axis(axes[0])
    if hi > 0:
        _log_axis(axes[1], lo, hi)


def _save(fig: Any, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    _pyplot().close(fig)


def plot_curves(path: str | Path, title: str, groups: dict[str, Sequence[dict[str, Any]]],
                metric: str = "test_acc", target: float | None = None,
                percent: bool = True) -> bool:
    """Two panels, ``metric`` vs round and vs cumulative uplink (MB): per group the
    mean over its runs (:func:`run_stats` dicts) with a mean ± sd band. False
    without matplotlib or without any data."""
    if _pyplot() is None:
        return False
    fig = curves_figure(title, groups, metric, target, percent)
    if fig is None:
        return False
    _save(fig, path)
    return True


def curves_figure(title: str, groups: dict[str, Sequence[dict[str, Any]]],
                  metric: str = "test_acc", target: float | None = None,
                  percent: bool = True) -> Any:
    """The figure of :func:`plot_curves` (None when no group logged ``metric``)."""
    return _curves_figure(title, groups, metric, target, percent)


def _curves_figure(title: str, groups: Panel, metric: str, target: float | None,
                   percent: bool, colors: dict[str, str] | None = None,
                   note: str = "") -> Any:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120, layout="constrained")
    lo, hi, drawn = _draw_curves(axes, groups, metric, 100.0 if percent else 1.0, colors)
    if not drawn:
        plt.close(fig)
        return None
    _style_curve_axes(axes, metric, percent, target, lo, hi)
    # Below both panels: labels of any length neither cover the curves nor squeeze them.
    _legend_below(fig, axes[0], 3)
    fig.suptitle(f"{title}: mean over seeds, band ± sd" + (f"\n{note}" if note else ""))
    return fig


def _has_curve(groups: Panel, metric: str) -> bool:
    return any(_band_curves(runs, metric) is not None for runs in groups.values())


def curves_facets_figure(title: str, facets: dict[str, Panel], metric: str = "test_acc",
                         target: float | None = None, percent: bool = True,
                         notes: dict[str, str] | None = None) -> Any:
    """The figure of :func:`plot_curves_faceted` (None when no group logged
    ``metric``)."""
    plt = _pyplot()
    notes = notes or {}
    facets = {f: p for f, p in facets.items() if _has_curve(p, metric)}
    colors = _palette(facets)
    if len(facets) <= 1:  # the figure of plot_curves, titled by its facet
        facet, groups = next(iter(facets.items()), ("", {}))
        return _curves_figure(f"{title}, {facet}" if facet else title, groups, metric,
                              target, percent, colors, notes.get(facet, ""))
    # the two panels as wide as plot_curves's, the legend's room beside them
    fig, grid = plt.subplots(len(facets), 2, figsize=(10 + _legend_width(facets),
                                                      0.6 + 3.1 * len(facets)),
                             dpi=120, layout="constrained", squeeze=False)
    for axes, (facet, groups) in zip(grid, facets.items(), strict=True):
        lo, hi, _ = _draw_curves(axes, groups, metric, 100.0 if percent else 1.0, colors)
        _style_curve_axes(axes, metric, percent, target, lo, hi)
        _facet_title(axes[0], facet, notes.get(facet))
        _legend_right(axes[1], axes[0])
    fig.suptitle(f"{title}: mean over seeds, band ± sd", fontsize=12)
    return fig


def plot_curves_faceted(path: str | Path, title: str, facets: dict[str, Panel],
                        metric: str = "test_acc", target: float | None = None,
                        percent: bool = True, notes: dict[str, str] | None = None) -> bool:
    """:func:`plot_curves` with one row per facet (facet name -> label -> runs): each
    row holds the vs-round and vs-uplink panels, titled by its facet (and its
    ``notes`` entry), its legend to the right; one facet is :func:`plot_curves`'s
    figure. Facets without ``metric`` are left out. False without matplotlib or
    without any data."""
    if _pyplot() is None:
        return False
    fig = curves_facets_figure(title, facets, metric, target, percent, notes)
    if fig is None:
        return False
    _save(fig, path)
    return True


def _draw_cdf(ax: Any, groups: Panel, field: str, colors: dict[str, str] | None) -> bool:
    """Each group's mean CDF of ``field`` with its ± sd band on ``ax``; whether any."""
    drawn = False
    for i, (label, runs) in enumerate(groups.items()):
        accs = [np.asarray([a for a in r["_client_acc"].get(field, []) if a is not None],
                           dtype=float) for r in runs]
        accs = [a for a in accs if a.size]
        if not accs:
            continue
        xs = np.unique(np.concatenate(accs))
        cdfs = np.array([np.searchsorted(np.sort(a), xs, side="right") / a.size for a in accs])
        mu = cdfs.mean(axis=0)
        style = _line_style(i, label, colors)
        ax.step(xs * 100, mu, where="post", label=label, **style)
        if len(accs) > 1:
            sd = cdfs.std(axis=0, ddof=1)
            ax.fill_between(xs * 100, np.clip(mu - sd, 0, 1), np.clip(mu + sd, 0, 1),
                            step="post", color=style["color"], alpha=0.2, lw=0)
        drawn = True
    ax.set_xlabel("per-client test accuracy (%)")
    ax.set_ylabel("fraction of clients ≤ x")
    ax.grid(alpha=0.3)
    return drawn


def _cdf_figure(title: str, groups: Panel, field: str,
                colors: dict[str, str] | None = None, note: str = "") -> Any:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120, layout="constrained")
    if not _draw_cdf(ax, groups, field, colors):
        plt.close(fig)
        return None
    ax.set_title(f"{title}: per-client accuracy, mean ± sd of the seeds' CDFs"
                 + (f"\n{note}" if note else ""), fontsize=9)
    _legend_below(fig, ax, 2)
    return fig


def plot_cdf(path: str | Path, title: str, groups: dict[str, Sequence[dict[str, Any]]],
             field: str = "client_acc") -> bool:
    """Per-client accuracy CDF per group: the mean of its runs' empirical CDFs with a
    ± sd band. False without matplotlib or without any per-client accuracy."""
    if _pyplot() is None:
        return False
    fig = _cdf_figure(title, groups, field)
    if fig is None:
        return False
    _save(fig, path)
    return True


def _has_cdf(groups: Panel, field: str) -> bool:
    return any(a is not None for runs in groups.values() for r in runs
               for a in r["_client_acc"].get(field, []))


def cdf_facets_figure(title: str, facets: dict[str, Panel], field: str = "client_acc",
                      notes: dict[str, str] | None = None) -> Any:
    """The figure of :func:`plot_cdf_faceted` (None without per-client accuracy)."""
    plt = _pyplot()
    notes = notes or {}
    facets = {f: p for f, p in facets.items() if _has_cdf(p, field)}
    colors = _palette(facets)
    if len(facets) <= 1:  # the figure of plot_cdf, titled by its facet
        facet, groups = next(iter(facets.items()), ("", {}))
        return _cdf_figure(f"{title}, {facet}" if facet else title, groups, field, colors,
                           notes.get(facet, ""))
    fig, grid = plt.subplots(len(facets), 1, figsize=(5.5 + _legend_width(facets),
                                                      0.6 + 3.1 * len(facets)),
                             dpi=120, layout="constrained", squeeze=False)
    for (ax,), (facet, groups) in zip(grid, facets.items(), strict=True):
        _draw_cdf(ax, groups, field, colors)
        _facet_title(ax, facet, notes.get(facet))
        _legend_right(ax, ax)
    fig.suptitle(f"{title}: per-client accuracy, mean ± sd of the seeds' CDFs", fontsize=12)
    return fig


def plot_cdf_faceted(path: str | Path, title: str, facets: dict[str, Panel],
                     field: str = "client_acc", notes: dict[str, str] | None = None) -> bool:
    """:func:`plot_cdf` with one panel per facet (two a row), each titled by its facet
    (and its ``notes`` entry), its legend to its right; one facet is
    :func:`plot_cdf`'s figure. False without matplotlib or without any per-client
    accuracy."""
    if _pyplot() is None:
        return False
    fig = cdf_facets_figure(title, facets, field, notes)
    if fig is None:
        return False
    _save(fig, path)
    return True


# --------------------------------------------------------------------------- CLI
def compare(paths: Sequence[str | Path], metrics: Sequence[str] = DEFAULT_METRICS,
            at: str | int = "final", target: float | None = None,
            target_metric: str = "test_acc", group_by: Sequence[str] | None = None,
            csv_path: str | Path | None = None, markdown_path: str | Path | None = None,
            plots_dir: str | Path | None = None, facet: Sequence[str] | None = None,
            max_lines: int = DEFAULT_MAX_LINES, baseline: str | None = None
            ) -> tuple[str, list[str]]:
    """Run ``fedloom compare``: return the terminal text and the notes (files written,
    plots skipped, groups a plot's panel left out). ``facet``: the keys to facet the
    plots by (None: :func:`facet_keys`; [] none); ``max_lines``: lines a panel draws
    at most (0: all). ``baseline``: a group's label; every other group is then compared
    with it seed by seed (:func:`paired_table`)."""
    runs = [load_run(p) for p in find_run_dirs(paths)]
    for r in runs:  # what the table shows: a number in every file that has it
        for name in {*metrics, *([target_metric] if target is not None else [])}:
            check_metric(r, name)
    known: set[str] = set()
    for r in runs:
        known.update(k for k in run_stats(r) if not k.startswith("_"))
        for m in r.metrics:
            known.update(m)
    for opt, name in [*(("--metric", m) for m in metrics),
                      *([("--target-metric", target_metric)] if target is not None else [])]:
        if name not in known:
            import difflib

            near = difflib.get_close_matches(name, sorted(known), n=3)
            raise ValueError(f"{opt} {name}: no run has it"
                             + (f" (did you mean {', '.join(near)}?)" if near else ""))
    groups = group_runs(runs, group_by)
    fkeys = facet_keys(groups) if facet is None else list(facet)
    facets = facet_groups(groups, fkeys)  # a bad --facet KEY fails before anything is written
    header, rows, records = compare_table(groups, metrics, at, target, target_metric)
    paired_text = ""
    if baseline is not None:
        ph, prow, precs = paired_table(groups, baseline, metrics, at)
        paired_text = (f"\n\nPaired with {baseline!r} seed by seed (group − baseline; 95 % "
                       "t-interval over the seeds both ran; better/worse only when the "
                       "interval excludes 0):\n\n" + text_table(ph, prow))
        records += precs
    unfinished = sum(not r.finished for r in runs)
    lead = (f"{len(runs)} runs in {len(groups)} groups; mean ± sd over each group's runs"
            + (f"; {unfinished} not finished (their last logged round counts)"
               if unfinished else ""))
    notes: list[str] = []
    for g in groups:
        seen = g.seeds
        if len(set(map(str, seen))) < len(seen):
            notes.append(f"note: group {g.label!r} holds the same seed more than once "
                         f"({', '.join(map(str, seen))})")
    if markdown_path is not None:
        md = Path(markdown_path)
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(lead + ".\n\n" + markdown_table(header, rows) + "\n")
        notes.append(f"markdown: {md}")
    if csv_path is not None:
        notes.append(f"csv: {write_csv(csv_path, records)}")
    if plots_dir is not None:
        if _pyplot() is None:
            notes.append("plots skipped: matplotlib is not installed "
                         "(pip install 'fedloom[report]')")
        else:
            d = Path(plots_dir)
            metric = target_metric if target is not None else metrics[0]
            panels: dict[str, Panel] = {}
            in_panel: dict[str, str] = {}
            capped: list[str] = []
            for name, members in facets.items():
                labels = panel_labels(members, fkeys)
                panel = {lab: [run_stats(r) for r in g.runs]
                         for lab, g in zip(labels, members, strict=True)}
                # one choice for both plots, so they show the same groups
                panels[name], left = cap_lines(panel, metric, max_lines)
                if left:
                    in_panel[name] = (f"{len(panels[name])} of {len(panel)} groups "
                                      f"(best final {metric})")
                    capped.append(f"plots: {f'facet {name}: ' if name else ''}{len(panel)} "
                                  f"groups, {len(panels[name])} drawn (best final {metric}); "
                                  f"not drawn: {' | '.join(left)}")
            written = []
            if plot_curves_faceted(d / "curves.png", metric, panels, metric, target,
                                   percent=metric.endswith("acc") or "_acc_" in metric,
                                   notes=in_panel):
                written.append(d / "curves.png")
            if plot_cdf_faceted(d / "client_acc_cdf.png", "final model", panels,
                                notes=in_panel):
                written.append(d / "client_acc_cdf.png")
            notes.append("plots: " + (", ".join(map(str, written)) if written else
                                      f"none (no run logged {metric} or per-client accuracy)"))
            notes += capped
    return lead + "\n\n" + text_table(header, rows) + paired_text, notes


def better_direction(metric: str) -> str:
    """``lower`` for losses, bytes, seconds and spreads (``*_std``), else ``higher``."""
    return "lower" if lower_is_better(metric) or metric.endswith("_std") else "higher"


def paired_table(groups: Sequence[Group], baseline: str, metrics: Sequence[str],
                 at: str | int = "final"
                 ) -> tuple[list[str], list[list[str]], list[dict[str, Any]]]:
    """Every group against the ``baseline`` group, per metric: the verdict, the mean
    paired difference and its 95 % t-interval over the seeds both ran
    (:func:`fedloom.report.stats.paired`; accuracies in percentage points)."""
    from fedloom.report.stats import paired

    labels = [g.label for g in groups]
    if baseline not in labels:
        raise ValueError(f"--baseline {baseline}: no group has that label (groups: "
                         + ", ".join(repr(lab) for lab in labels) + ")")
    base = groups[labels.index(baseline)]

    def by_seed(g: Group, m: str) -> dict[Any, float]:
        return {r.seed: metric_value(r, m, at) for r in g.runs}

    header = ["group", *[f"{m} vs baseline" for m in metrics]]
    rows: list[list[str]] = []
    records: list[dict[str, Any]] = []
    for g in groups:
        if g is base:
            continue
        cells = [g.label]
        for m in metrics:
            res = paired(by_seed(g, m), by_seed(base, m), better=better_direction(m))
            pct = "acc" in m
            cells.append(res.text(100.0 if pct else 1.0, "pp" if pct else "",
                                  digits=1 if pct else 3))
            records.append({"kind": "paired", "group": g.label, "baseline": baseline,
                            "metric": m, "verdict": res.verdict, "diff": res.mean,
                            "low": res.low, "high": res.high, "n": res.n})
        rows.append(cells)
    return header, rows, records
