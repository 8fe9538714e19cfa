"""Claims tables, paired comparison lines and step-size sensitivity for sweep pages.

A suite's ``claims:`` list states what a paper claims, one entry each::

    claims:
      - claim: "CRAFT: higher worst 10 %"
        method: CRAFT
        against: [FedAvg, FedAvgM, FedProx]
        metric: client_acc_worst10      # a final metric, or rounds_to_target
        better: higher                  # higher | lower (claim_direction)
        margin: 0.01                    # optional: "equivalent" inside ± margin
        settings: [mnist]               # optional: where the claim applies

The table has a row per (claim, baseline) and a column per setting; a cell is
the paired comparison of the method against the baseline over the seeds both
ran (:func:`fedloom.report.stats.paired`): its verdict, the mean difference and
its 95 % interval. Accuracy metrics are differences in percentage points.
Under the sequential protocol the interval is :mod:`fedloom.report.sequential`'s.

The claim format in full, cells under the sequential protocol and
``rounds_to_target``'s censoring: docs/howto/sweeps.md (Paired comparisons and claims).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedloom.files import save_figure
from fedloom.report.compare import first_reach, log_ticks, markdown_table
from fedloom.report.sequential import UNDECIDED, sequential_paired
from fedloom.report.stats import Paired, paired

__all__ = ["claim_direction", "claim_table", "claims_lines", "metric_digits", "metric_scale",
           "plot_sensitivity", "seed_values", "sensitivity_table"]


def claim_direction(metric: str) -> str | None:
    """The direction in which ``metric`` improves when its name says it: ``lower`` for
    losses, perplexities, bytes, seconds, spreads (``*_std``) and ``rounds_to_target``,
    ``higher`` for accuracies; ``None`` when the name does not say (a claim on such a
    metric must give ``better:``).

    >>> claim_direction("test_loss"), claim_direction("client_acc_worst10")
    ('lower', 'higher')
    >>> claim_direction("rounds_to_target"), claim_direction("updates_applied") is None
    ('lower', True)
    >>> claim_direction("client_acc_std_window")
    'lower'
    """
    from fedloom.report.compare import lower_is_better

    metric = metric.removesuffix("_window")  # its mean over the evaluation window
    if metric == "rounds_to_target" or metric.endswith("_std") or lower_is_better(metric):
        return "lower"
    if "acc" in metric.split("_"):
        return "higher"
    return None


def metric_scale(metric: str) -> tuple[float, str]:
    """(scale, unit) of a difference: accuracies in pp, rounds as they are."""
    if "acc" in metric:
        return 100.0, "pp"
    if metric == "rounds_to_target":
        return 1.0, "rounds"
    return 1.0, ""


def metric_digits(metric: str) -> int:
    """Decimals of a difference: 3 for losses (a margin of 0.05 nats is read at the third
    decimal), else 1."""
    return 3 if "loss" in metric else 1


def seed_values(runs: Sequence[dict[str, Any]], metric: str,
                target: float | None = None) -> tuple[dict[Any, float], int]:
    """{seed: value} of ``metric`` over ``runs`` (run_stats dicts with ``_seed``) and
    how many were censored (``rounds_to_target`` only, module docstring)."""
    out: dict[Any, float] = {}
    censored = 0
    for r in runs:
        seed = r.get("_seed")
        if metric == "rounds_to_target":
            if target is None:
                continue
            hit = first_reach(r["_metrics"], "test_acc", target)
            if hit is None:
                censored += 1
                last = r["_metrics"][-1]["round"] if r["_metrics"] else 0
                out[seed] = float(last + 1)
            else:
                out[seed] = float(hit[0])
        else:
            v = r.get(metric)
            out[seed] = float(v) if isinstance(v, int | float) and not isinstance(
                v, bool) else math.nan
    return out, censored


def _cell(res: Paired, metric: str, censored: int) -> str:
    scale, unit = metric_scale(metric)
    text = res.text(scale, unit, digits=metric_digits(metric))
    if censored:
        text += f"; {censored} run{'s' if censored > 1 else ''} never reached it"
    return f"**{res.verdict}**" + text[len(res.verdict):] if res.n else text


def _sequential_cell(res: Paired, metric: str, censored: int, max_seeds: int | None) -> str:
    """A cell of the sequential protocol: the verdict, the seeds used, d̄ and the CS."""
    if res.n == 0:
        return "no pairs"
    scale, unit = metric_scale(metric)
    u = f" {unit}" if unit else ""
    dg = metric_digits(metric)
    at_max = ", max" if max_seeds is not None and res.n >= max_seeds and \
        res.verdict in UNDECIDED else ""
    text = f"**{res.verdict}** (n={res.n}{at_max}) {res.mean * scale:+.{dg}f}{u}"
    if res.n < 2:
        text += " (no interval)"
    elif not (math.isfinite(res.low) and math.isfinite(res.high)):
        text += " (no finite interval yet)"
    else:
        text += f" [{res.low * scale:+.{dg}f}, {res.high * scale:+.{dg}f}]"
        if res.verdict == "inconsistent":
            # The running intersection emptied, or keeps an early, narrow interval that
            # the later seeds' mean has left: the differences are heavier-tailed than
            # the Gaussian mixture assumes (a method that collapses on some seeds).
            # No verdict is read from it; the reader is told why.
            text += " (the sequence missed: the later seeds disagree with the first)"
    if censored:
        text += f"; {censored} run{'s' if censored > 1 else ''} never reached it"
    return text


def claim_table(claims: Sequence[dict[str, Any]], table: dict[str, dict[str, Any]],
                settings: Sequence[str], targets: dict[str, float | None],
                sequential: bool = False, max_seeds: int | None = None
                ) -> tuple[list[str], list[list[str]], list[dict[str, Any]]]:
    """(header, rows, records): a row per (claim, baseline), a column per setting.
    ``sequential``: the confidence sequence in place of the t-interval, and the seeds
    used in every cell (``max_seeds``: the protocol's ``max``, named when reached)."""
    cols = [s for s in settings if s in table]
    header = ["claim", "against", *cols]
    rows: list[list[str]] = []
    records: list[dict[str, Any]] = []
    for c in claims:
        metric = c["metric"]
        better = c.get("better") or claim_direction(metric) or "higher"
        for base in c["against"]:
            cells = []
            for s in cols:
                rows_s = table[s]
                if (c.get("settings") and s not in c["settings"]) or c["method"] not in rows_s \
                        or base not in rows_s:
                    cells.append("–")
                    continue
                tgt = targets.get(s)
                if metric == "rounds_to_target" and tgt is None:
                    cells.append("no target")
                    continue
                a, ca = seed_values(rows_s[c["method"]]["runs"], metric, tgt)
                b, cb = seed_values(rows_s[base]["runs"], metric, tgt)
                if sequential:
                    res = sequential_paired(a, b, better=better, margin=c.get("margin"))
                    cells.append(_sequential_cell(res, metric, ca + cb, max_seeds))
                else:
                    res = paired(a, b, better=better, margin=c.get("margin"))
                    cells.append(_cell(res, metric, ca + cb))
                records.append({"claim": c["claim"], "method": c["method"], "against": base,
                                "setting": s, "metric": metric, "verdict": res.verdict,
                                "diff": res.mean, "low": res.low, "high": res.high,
                                "n": res.n, "censored": ca + cb})
            rows.append([c["claim"], base, *cells])
    return header, rows, records


def window_note(claims: Sequence[dict[str, Any]], table: dict[str, dict[str, Any]]) -> str:
    """The sentence that states the evaluation window of ``*_window`` claims (its rounds
    and cadence per setting, read from the runs); "" when no claim uses one."""
    if not any(c["metric"].endswith("_window") for c in claims):
        return ""
    spans: dict[str, set[tuple[int, int]]] = {}
    for setting, rows in table.items():
        for row in rows.values():
            for r in row.get("runs", []):
                if "_window" in r:
                    spans.setdefault(setting, set()).add(tuple(r["_window"]))
    text = "; ".join(
        f"{s}: " + ", ".join(f"the last {k} of {n} rounds" if k else f"round {n} only"
                             for k, n in sorted(ws)) for s, ws in spans.items())
    return ("Each claim is read on its metric's mean over the evaluations of the runs' "
            "last rounds (`report.claims_on: window`; `eval.window` makes every round "
            f"there an evaluation round; {text}), which averages out the round-to-round "
            "swing of a single evaluation; the results tables give the last round's "
            "values. ")


def claims_lines(suite: Any, table: dict[str, dict[str, Any]],
                 targets: dict[str, float | None], seq: Any
                 ) -> tuple[list[str], list[dict[str, Any]]]:
    """A sweep page's ``## Claims`` section (sequential confidence sequences or fixed-n
    t-intervals) and its records; nothing without ``claims:``."""
    claims = suite.report.claims
    if claims and seq is not None:
        header, claim_rows, claim_recs = claim_table(claims, table, list(suite.settings),
                                                     targets, sequential=True,
                                                     max_seeds=seq.max)
        return ["## Claims", "",
                "Each cell pairs the two methods seed by seed (the same partitions, "
                "cohorts and initial models) and gives the verdict, the seeds it used "
                "(n), the mean difference (method − baseline) and its 95 % confidence "
                "sequence: **equivalent** when it lies within the claim's margin, "
                "else **better** or **worse** when it excludes 0, else **no "
                "evidence**; **inconsistent** (no verdict) when the sequence has missed: "
                "its running intersection emptied, or the mean left it, as when a method "
                "collapses on some seeds. Seeds were given sequentially: every method ran "
                f"the first {seq.min}; after each batch every cell was computed again, and "
                "a pair of methods with a cell still open (no evidence or inconsistent) got "
                f"{seq.batch} more seeds, up to "
                f"{seq.max} (\"max\": still open there). The intervals are anytime-valid "
                "(a scale-invariant Gaussian-mixture confidence sequence, "
                "`fedloom.report.sequential`): they hold their 95 % however the looks "
                "stopped, at the price of about twice the width of a fixed-n t-interval. "
                + window_note(claims, table)
                + "Intervals are per cell, not adjusted for the number of cells.", "",
                markdown_table(header, claim_rows), ""], claim_recs
    if claims:
        header, claim_rows, claim_recs = claim_table(claims, table, list(suite.settings), targets)
        return ["## Claims", "",
                f"Each cell pairs the two methods seed by seed (seeds {suite.seeds}, the "
                "same partitions, cohorts and initial models) and gives the verdict, the "
                "mean difference (method − baseline) and its 95 % t-interval over the "
                "seeds: **equivalent** when it lies within the claim's margin, else "
                "**better** or **worse** when the interval excludes 0, else **no "
                "evidence**. "
                + (f"With {len(suite.seeds)} seeds the interval is wide (t = "
                   f"{_t_crit(len(suite.seeds)):.2f}): a real difference smaller than "
                   "the seed-to-seed spread shows as no evidence. " if len(suite.seeds) < 6
                   else "")
                + window_note(claims, table)
                + "Intervals are per cell, not adjusted for the number of cells.", "",
                markdown_table(header, claim_rows), ""], claim_recs
    return [], []


def _t_crit(n: int) -> float:
    from scipy.stats import t

    return float(t.ppf(0.975, max(n - 1, 1)))


def sensitivity_table(lines: dict[str, list[tuple[Any, list[float]]]], metric: str
                      ) -> tuple[list[str], list[list[str]]]:
    """Methods × values of the swept key: mean ± sd over seeds."""
    xs: list[Any] = sorted({x for pts in lines.values() for x, _ in pts}, key=_sort_key)
    scale, _ = metric_scale(metric)
    header = ["method", *[f"{x:g}" if isinstance(x, float) else str(x) for x in xs]]
    rows = []
    for method, pts in lines.items():
        by_x = dict(pts)
        cells = []
        for x in xs:
            v = [u for u in by_x.get(x, []) if math.isfinite(u)]
            if not v:
                cells.append("–")
                continue
            sd = float(np.std(v, ddof=1)) if len(v) > 1 else 0.0
            cells.append(f"{np.mean(v) * scale:.1f} ± {sd * scale:.1f}"
                         + (f" ({len(v)}/{len(by_x[x])})" if len(v) < len(by_x[x]) else ""))
        rows.append([method, *cells])
    return header, rows


def _sort_key(x: Any) -> tuple[int, Any]:
    return (0, float(x)) if isinstance(x, int | float) else (1, str(x))


def plot_sensitivity(path: str | Path, title: str,
                     lines: dict[str, list[tuple[Any, list[float]]]], xlabel: str,
                     metric: str, chosen: dict[str, Any] | None = None) -> bool:
    """The metric across the swept key's values: per method the seed mean as a line,
    mean ± sd as a band, its chosen value ringed; log x when the values are positive
    and span more than a decade. Legend outside the axes. False without matplotlib or
    data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    scale, _ = metric_scale(metric)
    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=120, layout="constrained")
    drawn, allx = False, []
    for method, pts in lines.items():
        pts = sorted(((x, [v for v in vals if math.isfinite(v)]) for x, vals in pts
                      if isinstance(x, int | float)), key=lambda p: p[0])
        pts = [(x, v) for x, v in pts if v]
        if not pts:
            continue
        xs = np.array([x for x, _ in pts], dtype=float)
        mu = np.array([np.mean(v) for _, v in pts]) * scale
        sd = np.array([np.std(v, ddof=1) if len(v) > 1 else 0.0 for _, v in pts]) * scale
        line = ax.plot(xs, mu, marker="o", ms=3, label=method)[0]
        ax.fill_between(xs, mu - sd, mu + sd, color=line.get_color(), alpha=0.15, lw=0)
        if chosen and method in chosen and chosen[method] in list(xs):
            i = list(xs).index(chosen[method])
            ax.plot([xs[i]], [mu[i]], "o", ms=9, mfc="none", color=line.get_color())
        allx += list(xs)
        drawn = True
    if not drawn:
        plt.close(fig)
        return False
    pos = [x for x in allx if x > 0]
    if pos and len(pos) == len(allx) and max(pos) / min(pos) > 10:
        ax.set_xscale("log")
        log_ticks(ax.xaxis, min(pos), max(pos))
    ax.set_xlabel(xlabel)
    ylabel = metric.replace("_", " ") + (" (%)" if scale == 100.0 else "")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ring = ", ring = tuned value" if chosen and any(v is not None for v in chosen.values()) else ""
    ax.set_title(f"{title}: mean over seeds, band ± sd{ring}", fontsize=9)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside right upper", fontsize=7,
               frameon=False)
    save_figure(fig, path)  # replaced whole: never written through a link
    plt.close(fig)
    return True
