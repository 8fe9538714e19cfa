"""The tuning part of a sweep's page: the protocol, every method's chosen point and
every trial (with the rung a halving trial reached), and the sensitivity lines
(:mod:`fedloom.tuning`); the seeds the page reports (:mod:`fedloom.sweep`'s list or
sequential ``seeds: {min, max, batch}``). :mod:`fedloom.report.sweep` lays out the page.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fedloom.report.claims import metric_scale, plot_sensitivity, sensitivity_table
from fedloom.report.compare import load_run, markdown_table, run_stats

__all__ = ["grid_edge"]


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def grid_edge(value: Any, dim: Any) -> str | None:
    """``"lowest"`` or ``"highest"`` when ``value`` sits at that end of its numeric
    search dimension — a list of at least two numbers, or a range
    (:class:`fedloom.tuning.Range`: ``low``, ``high``, ``log``) within 1 % of its
    width, on the log scale for a log range — else ``None``: a choice at the edge of
    what was searched, where a wider grid may choose past it.

    >>> grid_edge(0.1, [0.003, 0.01, 0.03, 0.1]), grid_edge(0.03, [0.003, 0.03, 0.1])
    ('highest', None)
    >>> grid_edge("sgd", ["sgd", "adam"]), grid_edge(1, [1])
    (None, None)
    """
    if not _number(value):
        return None
    if hasattr(dim, "low") and hasattr(dim, "high"):
        lo, hi, x = float(dim.low), float(dim.high), float(value)
        if getattr(dim, "log", False) and lo > 0 and x > 0:
            lo, hi, x = math.log(lo), math.log(hi), math.log(x)
        tol = 0.01 * (hi - lo)
        return "lowest" if x <= lo + tol else "highest" if x >= hi - tol else None
    nums = [v for v in dim if _number(v)]
    if len(nums) < 2 or len(nums) != len(dim):
        return None
    return "lowest" if value == min(nums) else "highest" if value == max(nums) else None


def _sequential(suite: Any) -> Any:
    """The suite's ``seeds: {min, max, batch}`` (fedloom.sweep), None for a list."""
    return getattr(suite, "sequential", None)


def _seeds_text(suite: Any) -> str:
    """The reported seeds as the page names them."""
    seq = _sequential(suite)
    if seq is None:
        return str(suite.seeds)
    return (f"1–{seq.max} (sequential: the first {seq.min}, then {seq.batch} more at a time "
            "for the pairs still undecided)")


def _sensitivity_lines(suite: Any, setting: str, doc: Path | None,
                       chosen: dict[tuple[str, str], Any]) -> list[str]:
    """The metric across the sensitivity key (fedloom.tuning), one line per method."""
    specs = {m: rows for (s, m), rows in suite.sensitivity_specs.items() if s == setting}
    if not specs:
        return []
    proto = suite.tuning.protocol
    key = proto.sensitivity["key"]
    metric = suite.report.options.get("sensitivity_metric", proto.metric)
    lines_by_m: dict[str, list[tuple[Any, list[float]]]] = {}
    missing = 0
    for m, rows in specs.items():
        pts = []
        for v, sps in rows:
            vals = []
            for sp in sps:
                if not sp.done:
                    missing += 1
                    continue
                stats = run_stats(load_run(sp.out))
                x = stats.get(metric)
                vals.append(float(x) if isinstance(x, int | float) else float("nan"))
            pts.append((v, vals))
        lines_by_m[m] = pts
    header, rows = sensitivity_table(lines_by_m, metric)
    unit = " (%)" if metric_scale(metric)[0] == 100 else ""
    seq = _sequential(suite)
    seeds = suite.seeds if seq is None else suite.seeds[:seq.min]
    out = [f"**Sensitivity to `{key}`** (final `{metric}`{unit}, mean ± sd over seeds "
           f"{seeds}; every other key at its tuned value):", "",
           markdown_table(header, rows), ""]
    if missing:
        out += [f"({missing} sensitivity runs have not finished.)", ""]
    if doc is not None:
        png = doc.parent / f"{suite.name}-{setting}-sensitivity.png"
        picked = {m: chosen.get((setting, m), {}).get(key) for m in specs}
        if plot_sensitivity(png, setting, lines_by_m, key, metric, picked):
            out += [f"![{metric} across {key}, {setting}]({png.name})", ""]
    return out


def _tuning_rounds(suite: Any) -> str:
    """How many rounds the tuning runs had, per setting where they differ."""
    base = suite.tuning.protocol.rounds
    per = {s: st.get("tuning_rounds", base) for s, st in suite.settings.items()}
    if len(set(per.values())) == 1:
        r = next(iter(per.values()))
        return f"{r} rounds" if r else "the setting's rounds"
    return "; ".join(f"{r or 'all its'} rounds on {s}" for s, r in per.items())


def _protocol_lines(suite: Any, chosen: dict[tuple[str, str], Any]) -> list[str]:
    """The tuning protocol, the chosen point of every method, and every trial."""
    proto = suite.tuning.protocol
    space_keys = sorted({k for s in suite.settings for m in suite.methods
                         if (s, m) in suite.trials for k in suite.space(s, m)})
    lines = ["## Tuning", "",
             f"Every tuned method had the same budget: **{proto.budget} trials** per setting "
             f"({proto.sampler} sampler, sampler seed {proto.seed}), each run on the tuning "
             f"seed{'s' if len(proto.seeds) > 1 else ''} {proto.seeds} (not reported; the "
             f"reported seeds are {_seeds_text(suite)}) for "
             + _tuning_rounds(suite)
             + f", scored by the final `{proto.metric}`"
             + _own_metrics(suite)
             + " (mean over tuning seeds; a diverged run scores worst), best score chosen. "
             "Keys searched: "
             + ", ".join(f"`{k}`" for k in space_keys) + ".", ""]
    if proto.sampler == "halving":
        lines += [_halving_lines(suite), ""]
    shared = {m: src for m, src in suite.tuning.shared.items()}
    for setting in suite.settings:
        picks = []
        for m in suite.methods:
            if (setting, m) not in chosen and m not in suite.tuning.untuned:
                continue
            if m in suite.tuning.untuned:
                picks.append([m, "not tuned (its config as given)"])
                continue
            point = ", ".join(f"`{k}` = {v:g}" if isinstance(v, float) else f"`{k}` = {v}"
                              for k, v in chosen[(setting, m)].items())
            how = f"from {shared[m]}" if m in shared else "tuned"
            picks.append([m, f"{point} ({how})"])
        if picks:
            lines += [f"**{setting}**", "", markdown_table(["method", "chosen"], picks), ""]
        edges = []  # a choice at the edge of its grid: a wider grid may choose past it
        for m in suite.methods:
            if (setting, m) not in chosen or m in suite.tuning.untuned or m in shared:
                continue
            space = suite.space(setting, m)
            for k, v in chosen[(setting, m)].items():
                end = grid_edge(v, space[k]) if k in space else None
                if end is not None:
                    edges.append(f"{m} `{k}` = {v:g}" if isinstance(v, float)
                                 else f"{m} `{k}` = {v}")
                    edges[-1] += f" (the {end} searched)"
        if edges:
            lines += ["At the edge of the searched values (a wider grid may choose past "
                      "them): " + "; ".join(edges) + ".", ""]
    trial_rows = []
    for (setting, m), ts in suite.trials.items():
        pick = chosen.get((setting, m))
        best = next((t for t in ts if t.params == pick), None)
        for t in ts:
            scale, _ = metric_scale(proto.metric)
            score = f"{t.score * scale:.2f}" if t.score == t.score else "diverged"
            mark = " ←" if best is not None and t is best else ""
            rung = ([] if proto.sampler != "halving"
                    else [f"{t.rung} ({t.rounds} rounds)" if t.rung is not None else "–"])
            trial_rows.append([setting, m, str(t.index),
                               ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                         for k, v in t.params.items()), *rung, score + mark])
    if trial_rows:
        rung_head = ["rung reached"] if proto.sampler == "halving" else []
        lines += ["<details><summary>Every trial (score: the selection metric"
                  + (", in %" if metric_scale(proto.metric)[0] == 100 else "")
                  + (" at the last rung it ran" if rung_head else "")
                  + "; ← the chosen one)</summary>", "",
                  markdown_table(["setting", "method", "trial", "point", *rung_head, "score"],
                                 trial_rows),
                  "", "</details>", ""]
    return lines


def _halving_lines(suite: Any) -> str:
    """The halving plan (fedloom.tuning): rungs, and the client rounds (rounds × cohort
    size × tuning seeds) each method had, used, and the grid sampler would have used."""
    proto = suite.tuning.protocol
    plans = getattr(proto, "plans", {}) or {}
    if not plans:
        return ""
    text = (f"Successive halving (η = {proto.eta}): every trial runs the first rung, the "
            f"best 1/{proto.eta} on the selection metric at a rung's last round go on to the "
            "next (the earlier trial on a tie), continuing their runs from the rung's "
            "checkpoint; a trial whose score is not finite or whose run diverged stops at "
            "its rung; the choice is the best of the highest rung.")
    if getattr(proto, "brackets", False):
        text += (" In Hyperband's brackets (Li et al., JMLR 2018; fedloom.tuning"
                 ".hyperband_brackets): the grid's trials, in its order, fill brackets that "
                 "start at fewer rounds and halve, and brackets that run to the tuning rounds "
                 "with no stop; the choice is the best of every trial that ran the tuning "
                 "rounds.")
    by_rungs: dict[str, list[str]] = {}
    for (setting, m), plan in plans.items():
        rungs = " | ".join(", ".join(f"{r['trials']} × {r['rounds']}" for r in b)
                           for b in plan.get("brackets") or [plan["rungs"]])
        by_rungs.setdefault(rungs, []).append(f"{m} on {setting}" if len(suite.settings) > 1
                                              else m)
    for rungs, who in by_rungs.items():
        text += f" Rungs (trials × rounds): {rungs}" + (
            f" ({', '.join(who)})" if len(by_rungs) > 1 else "") + "."
    costs = sorted({(p["client_rounds"], p["grid"]) for p in plans.values()})
    text += (" Budget per method, in client rounds (rounds × cohort size × tuning seeds): "
             + "; ".join(f"{b:,} planned, against {g:,} for the same trials all run to "
                         f"the tuning rounds ({100 * b / g:.0f} %)" for b, g in costs)
             + "; used: "
             + ", ".join(f"{m}{f' on {s}' if len(suite.settings) > 1 else ''} {p['used']:,}"
                         for (s, m), p in plans.items()) + ".")
    return text


def _own_metrics(suite: Any) -> str:
    """``, … (M: its metric)`` for the methods that are chosen on their own metric."""
    own = suite.tuning.method_metric
    if not own:
        return ""
    return " (" + "; ".join(f"{m}: `{v}`" for m, v in own.items()) + ")"
