"""Compare runs: tables and plots across run directories, mean ± sd over seeds.

``fedloom compare RUN_OR_SWEEP_DIR …`` and the pages of ``fedloom sweep`` are
made by this module (one implementation of reading, grouping, aggregating and
plotting runs).

Runs. A run directory is one that holds ``summary.json`` (a finished run) or
``metrics.jsonl`` (one still running or stopped); a directory that is neither is
searched below for run directories, except folders whose name holds ``@tune=``
(a sweep's tuning runs: pass one explicitly to include it). From a run this
module reads ``config.yaml`` (the resolved config), ``summary.json``,
``metrics.jsonl`` (a torn last line, what a killed run leaves, is skipped) and
``client_acc.json`` (the final model's accuracy on each client's test split).

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
"""

from __future__ import annotations

import csv
import json
import math
import os
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
    "compare_table",
    "curves_figure",
    "find_run_dirs",
    "first_reach",
    "group_runs",
    "load_run",
    "mean_sd",
    "metric_value",
    "plot_cdf",
    "plot_curves",
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
            dirs[:] = sorted(d for d in dirs if "@tune=" not in d)
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


def _read_json(path: Path) -> Any:
    try:
        return json.loads(_read_bytes(path).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path}: not valid JSON") from None


def _read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    lines = _read_bytes(path).split(b"\n")
    rows: list[dict[str, Any]] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("round"), int):
            if no == len(lines):  # a torn last line: what a killed run leaves
                continue
            raise ValueError(f"{path}: line {no} is not a metrics record")
        rows.append(obj)
    return rows


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
    summary = _read_json(p / "summary.json") if (p / "summary.json").is_file() else {}
    acc_file = p / "client_acc.json"
    client_acc = _read_json(acc_file) if acc_file.is_file() else {}
    return Run(p, config, summary if isinstance(summary, dict) else {}, _read_metrics(
        p / "metrics.jsonl"), client_acc if isinstance(client_acc, dict) else {})


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
    if isinstance(v, bool) or not isinstance(v, int | float):
        return float("nan")
    return float(v)


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


def plot_curves(path: str | Path, title: str, groups: dict[str, Sequence[dict[str, Any]]],
                metric: str = "test_acc", target: float | None = None,
                percent: bool = True) -> bool:
    """Two panels, ``metric`` vs round and vs cumulative uplink (MB): per group the
    mean over its runs (:func:`run_stats` dicts) with a mean ± sd band. False
    without matplotlib or without any data."""
    plt = _pyplot()
    if plt is None:
        return False
    fig = curves_figure(title, groups, metric, target, percent)
    if fig is None:
        return False
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def curves_figure(title: str, groups: dict[str, Sequence[dict[str, Any]]],
                  metric: str = "test_acc", target: float | None = None,
                  percent: bool = True) -> Any:
    """The figure of :func:`plot_curves` (None when no group logged ``metric``)."""
    plt = _pyplot()
    scale = 100.0 if percent else 1.0
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120, layout="constrained")
    lo, hi, drawn = math.inf, 0.0, False
    for label, runs in groups.items():
        bands = _band_curves(runs, metric)
        if bands is None:
            continue
        rounds, mu, sd, mb = bands
        line = axes[0].plot(rounds, mu * scale, label=label)[0]
        axes[1].plot(mb, mu * scale, label=label, color=line.get_color())
        if len(runs) > 1:
            for ax, x in ((axes[0], rounds), (axes[1], mb)):
                ax.fill_between(x, (mu - sd) * scale, (mu + sd) * scale,
                                color=line.get_color(), alpha=0.2, lw=0)
        pos = mb[np.isfinite(mb) & (mb > 0)]
        if pos.size:
            lo, hi = min(lo, float(pos.min())), max(hi, float(pos.max()))
        drawn = True
    if not drawn:
        plt.close(fig)
        return None
    name = {"test_acc": "test accuracy"}.get(metric, metric.replace("_", " "))
    ylabel = name + (" (%)" if percent else "")
    for ax, xl in zip(axes, ("round", "cumulative uplink (MB)"), strict=True):
        ax.set_xlabel(xl)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if target is not None:
            ax.axhline(target * scale, color="grey", ls=":", lw=1)
    _round_axis(axes[0])
    if hi > 0:
        _log_axis(axes[1], lo, hi)
    # Below both panels: labels of any length neither cover the curves nor squeeze them.
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center",
               ncols=min(3, len(groups)), fontsize=7, frameon=False)
    fig.suptitle(f"{title}: mean over seeds, band ± sd")
    return fig


def plot_cdf(path: str | Path, title: str, groups: dict[str, Sequence[dict[str, Any]]],
             field: str = "client_acc") -> bool:
    """Per-client accuracy CDF per group: the mean of its runs' empirical CDFs with a
    ± sd band. False without matplotlib or without any per-client accuracy."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120, layout="constrained")
    drawn = False
    for label, runs in groups.items():
        accs = [np.asarray([a for a in r["_client_acc"].get(field, []) if a is not None],
                           dtype=float) for r in runs]
        accs = [a for a in accs if a.size]
        if not accs:
            continue
        xs = np.unique(np.concatenate(accs))
        cdfs = np.array([np.searchsorted(np.sort(a), xs, side="right") / a.size for a in accs])
        mu = cdfs.mean(axis=0)
        line = ax.step(xs * 100, mu, where="post", label=label)[0]
        if len(accs) > 1:
            sd = cdfs.std(axis=0, ddof=1)
            ax.fill_between(xs * 100, np.clip(mu - sd, 0, 1), np.clip(mu + sd, 0, 1),
                            step="post", color=line.get_color(), alpha=0.2, lw=0)
        drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel("per-client test accuracy (%)")
    ax.set_ylabel("fraction of clients ≤ x")
    ax.set_title(f"{title}: per-client accuracy, mean ± sd of the seeds' CDFs", fontsize=9)
    ax.grid(alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center",
               ncols=min(2, len(groups)), fontsize=7, frameon=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- CLI
def compare(paths: Sequence[str | Path], metrics: Sequence[str] = DEFAULT_METRICS,
            at: str | int = "final", target: float | None = None,
            target_metric: str = "test_acc", group_by: Sequence[str] | None = None,
            csv_path: str | Path | None = None, markdown_path: str | Path | None = None,
            plots_dir: str | Path | None = None) -> tuple[str, list[str]]:
    """Run ``fedloom compare``: return the terminal text and the notes (files written,
    plots skipped)."""
    runs = [load_run(p) for p in find_run_dirs(paths)]
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
    header, rows, records = compare_table(groups, metrics, at, target, target_metric)
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
            by_label = {g.label: [run_stats(r) for r in g.runs] for g in groups}
            metric = target_metric if target is not None else metrics[0]
            written = []
            if plot_curves(d / "curves.png", metric, by_label, metric, target,
                           percent=metric.endswith("acc") or "_acc_" in metric):
                written.append(d / "curves.png")
            if plot_cdf(d / "client_acc_cdf.png", "final model", by_label):
                written.append(d / "client_acc_cdf.png")
            notes.append("plots: " + (", ".join(map(str, written)) if written else
                                      f"none (no run logged {metric} or per-client accuracy)"))
    return lead + "\n\n" + text_table(header, rows), notes
