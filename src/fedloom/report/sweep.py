"""The markdown report of a sweep: tables (mean ± sd over seeds), plots, comparisons.

Runs are read, aggregated and plotted by :mod:`fedloom.report.compare` (the code
behind ``fedloom compare``); this module lays out the page a suite's ``report:``
section asks for (see :mod:`fedloom.sweep` for its keys).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fedloom.files import save_figure, write_output
from fedloom.report.claims import (
    claims_lines,
    metric_scale,
    plot_sensitivity,
    seed_values,
    sensitivity_table,
)
from fedloom.report.compare import (
    first_reach,
    load_run,
    markdown_table,
    mean_sd,
    plot_cdf,
    plot_curves,
    run_stats,
    write_csv,
)
from fedloom.report.effort import head_lines
from fedloom.report.sequential import sequential_paired
from fedloom.report.stats import paired
from fedloom.report.sweep_tuning import (
    _protocol_lines,
    _seeds_text,
    _sensitivity_lines,
    _sequential,
)

__all__ = ["aggregate_runs", "write_report"]

COLUMNS = [
    ("client_acc_mean", "client acc mean"),
    ("client_acc_std", "client acc std"),
    ("client_acc_worst10", "worst 10 %"),
    ("client_acc_best10", "best 10 %"),
    ("test_acc", "test acc"),
    ("conflict_rate_mean", "conflict rate"),
]


def aggregate_runs(specs: list[Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """{setting: {method: {"runs": [...], metric: (mean, sd)}}}."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for spec in specs:
        if not (spec.out / "summary.json").exists():
            continue  # not run (yet): the report says how many are missing
        row = table.setdefault(spec.setting, {}).setdefault(spec.method, {"runs": []})
        stats = run_stats(load_run(spec.out))
        stats["_seed"] = spec.seed  # the pairing key of paired comparisons
        row["runs"].append(stats)
    for methods in table.values():
        for row in methods.values():
            runs = row["runs"]
            keys = {k for r in runs for k in r if not k.startswith("_")}
            for k in keys:
                if all(isinstance(r.get(k), int | float) for r in runs):
                    row[k] = mean_sd([float(r[k]) for r in runs])
    return table


def _fmt(ms: tuple[float, float] | None, pct: bool = True) -> str:
    if ms is None or math.isnan(ms[0]):
        return "–"
    scale = 100.0 if pct else 1.0
    if not pct and abs(ms[0]) < 0.1:
        return f"{ms[0]:.3g} ± {ms[1]:.2g}"
    return f"{ms[0] * scale:.1f} ± {ms[1] * scale:.1f}"


def _personal_row(method: str, row: dict[str, Any], columns: list[tuple[str, str, str]],
                  blank: int) -> str | None:
    """The table row of a method's personal models (None when its runs have none): under
    each ``client_*`` column the ``personal_*`` value (``personal_acc_*`` under
    ``client_acc_*``; a causal LM's ``personal_ppl_*`` under ``client_ppl_*``), "–"
    under the others and the ``blank`` columns after them."""
    own = [f"personal_{k[len('client_'):]}" if k.startswith("client_") else None
           for k, _, _ in columns]
    if not any(k is not None and k in row for k in own):
        return None
    cells = [_fmt(row.get(k) if k is not None else None, kind == "pct")
             for k, (_, _, kind) in zip(own, columns, strict=True)]
    return f"| {method} (personal models) | " + " | ".join(cells) + " |" + " – |" * blank


def _to_target(runs: list[dict[str, Any]], target: float,
               timed: bool = False) -> list[str]:
    """Mean rounds and uplink MB (and, ``timed``, simulated minutes: ``sim_time_s`` of
    :mod:`fedloom.system`) to first reach ``target`` test accuracy, over the seeds
    that reach it (with the count when some do not)."""
    hits = []
    for r in runs:
        hit = first_reach(r["_metrics"], "test_acc", target)
        if hit is not None:
            sim = next((m.get("sim_time_s", float("nan")) for m in r["_metrics"]
                        if m["round"] == hit[0]), float("nan"))
            hits.append((hit[0], hit[1] / 1e6, sim / 60))
    if not hits:
        return ["not reached", "–"] + (["–"] if timed else [])
    suffix = "" if len(hits) == len(runs) else f" ({len(hits)}/{len(runs)} seeds)"
    out = [f"{np.mean([h[0] for h in hits]):.0f}{suffix}",
           f"{np.mean([h[1] for h in hits]):.1f}{suffix}"]
    if timed:
        out.append(f"{np.mean([h[2] for h in hits]):.1f}{suffix}")
    return out


def _timed(rows: dict[str, dict[str, Any]]) -> bool:
    """Whether the setting's runs keep a simulated clock (``system.profile``)."""
    return any("sim_time_s" in m for r in rows.values() for x in r["runs"]
               for m in x["_metrics"][:1])


def _time_plot(path: Path, title: str, groups: dict[str, list[dict[str, Any]]]) -> bool:
    """Test accuracy against simulated time (minutes): per method, the seed means at each
    evaluated round of ``sim_time_s`` (x) and of the accuracy (y, ± sd band)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.0), dpi=120)
    drawn = False
    for method, runs in groups.items():
        by_round: dict[int, list[tuple[float, float]]] = {}
        for run in runs:
            for m in run["_metrics"]:
                if "test_acc" in m and "sim_time_s" in m:
                    by_round.setdefault(m["round"], []).append((m["sim_time_s"], m["test_acc"]))
        full = sorted(r for r, v in by_round.items() if len(v) == len(runs))
        if not full:
            continue
        xs = np.array([np.mean([t for t, _ in by_round[r]]) / 60 for r in full])
        ys = np.array([[a * 100 for _, a in by_round[r]] for r in full])
        mu, sd = ys.mean(axis=1), ys.std(axis=1)
        (line,) = ax.plot(xs, mu, marker=".", label=method)
        ax.fill_between(xs, mu - sd, mu + sd, alpha=0.15, color=line.get_color())
        drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax.set_xlabel("simulated time (min)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return True


def _sweep_plot(path: Path, title: str, xs: list[float], ys: list[tuple[float, float]],
                xlabel: str, ylabel: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    ax.errorbar(xs, [y[0] * 100 for y in ys], yerr=[y[1] * 100 for y in ys], marker="o",
                capsize=3)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
    return True


def _heterogeneity_lines(spec: Mapping[str, Any], table: dict[str, dict[str, Any]],
                         name: str, doc: Path | None) -> list[str]:
    """``report.heterogeneity``: every setting's split measures (``partition_*`` of the
    runs' summaries) beside each method's accuracies, settings ordered by ``x``, and a
    plot of each metric against ``x`` (one line per method, ± sd over seeds)."""
    x = spec.get("x", "partition_hellinger")
    metrics = list(spec.get("metrics", ["client_acc_mean", "client_acc_worst10"]))
    labels = dict(COLUMNS)
    methods = list(spec.get("methods") or [])
    measures = [("partition_hellinger", "Hellinger"), ("partition_eff_classes", "eff. classes"),
                ("partition_size_gini", "size Gini")]

    def xval(setting: str) -> float:
        vals = [r[x][0] for r in table[setting].values() if x in r]
        return vals[0] if vals else float("nan")

    settings = sorted((s for s in table if not math.isnan(xval(s))), key=xval)
    if not settings:
        return []
    methods = methods or sorted({m for s in settings for m in table[s]})
    header = ["setting", *[h for _, h in measures]] + [
        f"{m} {labels.get(k, k)}" for m in methods for k in metrics]
    rows = []
    for s in settings:
        any_row = next(iter(table[s].values()))
        cells = [s] + [f"{any_row[k][0]:.3f}" if k in any_row else "–" for k, _ in measures]
        cells += [_fmt(table[s][m].get(k)) if m in table[s] else "–"
                  for m in methods for k in metrics]
        rows.append(cells)
    out = ["## Accuracy against heterogeneity", "",
           f"Settings ordered by `{x}` (the split's measure; the same for every method and "
           "seed-averaged over the reported seeds' partitions). Client accuracies in %, mean ± "
           "sd over seeds.", "", markdown_table(header, rows), ""]
    if doc is None:
        return out
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return out
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.8), dpi=120,
                             layout="constrained", squeeze=False)
    # Markers, not lines: the settings are different kinds of skew, not one axis. Each
    # method is shifted a little sideways so that the seed bars do not hide each other.
    xs = [xval(s) for s in settings]
    span = (max(xs) - min(xs)) or 1.0
    shift = 0.012 * span
    for ax, k in zip(axes[0], metrics, strict=True):
        for i, m in enumerate(methods):
            off = (i - (len(methods) - 1) / 2) * shift
            pts = [(xval(s) + off, table[s][m][k]) for s in settings
                   if m in table[s] and k in table[s][m]]
            if pts:
                ax.errorbar([p[0] for p in pts], [100 * p[1][0] for p in pts],
                            yerr=[100 * p[1][1] for p in pts], marker="o", markersize=4,
                            linestyle="none", capsize=2, label=m, alpha=0.9)
        for j, s in enumerate(settings):  # setting names above the panel, staggered
            ax.annotate(s, (xval(s), 1.01 + 0.045 * (j % 2)), xycoords=("data", "axes fraction"),
                        fontsize=7, va="bottom", ha="center", color="0.35",
                        annotation_clip=False)
            ax.axvline(xval(s), color="0.85", linewidth=0.6, zorder=0)
        ax.set_xlabel(spec.get("xlabel", x))
        ax.set_ylabel(f"{labels.get(k, k)} (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    png = doc.parent / f"{name}-heterogeneity.png"
    save_figure(fig, png)
    plt.close(fig)
    return [*out, f"![client accuracy against {x}]({png.name})", ""]


def _compare(setting: str, rows: dict[str, dict[str, Any]], base: str,
             cand: str, sequential: bool = False) -> str | None:
    """One line: the candidate against the baseline, paired over seeds (stats.paired;
    ``sequential``: the confidence sequence of fedloom.report.sequential)."""
    if base not in rows or cand not in rows:
        return None
    keys: tuple[tuple[str, str, str], ...] = (
        ("client_acc_mean", "mean", "higher"), ("client_acc_std", "std", "lower"),
        ("client_acc_worst10", "worst 10 %", "higher"))
    if not any(k in rows[base] for k, _, _ in keys):
        keys = (("test_acc", "test acc", "higher"), ("test_acc_peak", "peak test acc", "higher"))
    parts = []
    for key, label, better in keys:
        if key not in rows[base] or key not in rows[cand]:
            continue
        a, _ = seed_values(rows[cand]["runs"], key)
        b, _ = seed_values(rows[base]["runs"], key)
        scale, unit = metric_scale(key)
        res = (sequential_paired(a, b, better=better) if sequential
               else paired(a, b, better=better))
        parts.append(f"{label} {res.text(scale, unit)}")
    return f"- **{setting}**, {cand} vs {base}: " + "; ".join(parts) + "."


def _targets(suite: Any, table: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Per setting, the target test accuracy of ``report.target`` (None without one)."""
    cfg = suite.report.options.get("target")
    out: dict[str, float | None] = {}
    for setting, rows in table.items():
        out[setting] = None
        if cfg and cfg["baseline"] in rows:
            base = rows[cfg["baseline"]].get(cfg.get("metric", "test_acc"))
            if base is not None:
                out[setting] = cfg.get("fraction", 0.9) * base[0]
    return out


def _across_lines(spec: Mapping[str, Any], table: dict[str, dict[str, Any]], name: str,
                  doc: Path | None) -> list[str]:
    """``report.across``: a metric against a number the suite attaches to settings (for
    example the client-lr multiplier of settings that differ only in it), one panel per
    entry of ``panels``: a table (methods × that number, mean ± sd over the seeds) and a
    plot (one line per method, ± sd band; log x when it spans more than a decade). Each
    point is the method as it ran in that setting (tuned methods tuned there)."""
    out: list[str] = []
    for panel in spec.get("panels", []):
        xs = {s: float(x) for s, x in panel["x"].items() if s in table}
        if not xs:
            continue
        metric = panel.get("metric", "client_acc_mean")
        methods = list(panel.get("methods") or sorted({m for s in xs for m in table[s]}))
        lines_by_m: dict[str, list[tuple[Any, list[float]]]] = {}
        for m in methods:
            pts = [(x, list(seed_values(table[s][m]["runs"], metric)[0].values()))
                   for s, x in xs.items() if m in table[s]]
            if pts:
                lines_by_m[m] = pts
        if not lines_by_m:
            continue
        header, rows = sensitivity_table(lines_by_m, metric)
        header = [header[0], *[f"× {h}" for h in header[1:]]]
        unit = " (%)" if metric_scale(metric)[0] == 100 else ""
        where = ", ".join(f"× {x:g}: {s}" for s, x in sorted(xs.items(), key=lambda p: p[1]))
        if not out:
            out = [f"## {spec.get('title', 'Across settings')}", ""]
            if spec.get("intro"):
                out += [spec["intro"].strip(), ""]
        out += [f"**{panel.get('title', panel.get('name', metric))}** (final `{metric}`{unit}, "
                f"mean ± sd over the seeds; {where}):", "", markdown_table(header, rows), ""]
        if doc is not None:
            png = doc.parent / f"{name}-{panel.get('name', metric)}.png"
            xlabel = panel.get("xlabel", spec.get("xlabel", "x"))
            if plot_sensitivity(png, panel.get("title", ""), lines_by_m, xlabel, metric):
                out += [f"![{metric} against {xlabel}, "
                        f"{panel.get('title', '')}]({png.name})", ""]
    return out


def _grid_tuning_lines(suite: Any, chosen: dict[tuple[str, str], Any]) -> list[str]:
    """The ``## Tuning`` section of the one-key ``tune:``: each setting's picks."""
    lines = ["## Tuning", "", f"Tuned on seed {suite.tuning.grid_seed} (not one of the "
             f"reported seeds {_seeds_text(suite)}) by the best "
             f"`{suite.tuning.grid_metric}`:", ""]

    def key(m: str) -> str:
        grids = suite.tuning.grids
        return grids[m if m in grids else suite.tuning.shared[m]]["key"]

    for setting in suite.settings:
        picks = [f"{m}: `{key(m)}` = {chosen[(setting, m)]}"
                 for (s, m) in chosen if s == setting]
        if picks:
            lines.append(f"- {setting}: " + ", ".join(picks))
    lines.append("")
    return lines


def _results_table(suite: Any, setting: str, rows: dict[str, Any],
                   columns: list[tuple[str, str, str]], target: float | None,
                   target_cfg: Any, timed: bool, seq: Any,
                   records: list[dict[str, Any]]) -> list[str]:
    """A setting's ``### SETTING`` table (a row per method, its personal row beneath;
    the rounds, bytes and time to the target when there is one); each row's numbers
    are appended to ``records``."""
    desc = suite.settings[setting].get("describe", "")
    lines = [f"### {setting}", ""] + ([desc.strip(), ""] if desc else [])
    if target is not None:
        lines += [f"Target: {target * 100:.1f} % test accuracy "
                  f"({target_cfg.get('fraction', 0.9):g} × {target_cfg['baseline']}'s "
                  "final accuracy).", ""]
    extra = (["rounds to target", "uplink MB to target"]
             + (["sim. min to target"] if timed else []) if target is not None else [])
    lines.append("| method | " + " | ".join([c[1] for c in columns] + extra) +
                 " | wall s / run |")
    lines.append("|---|" + "---|" * (len(columns) + len(extra) + 1))
    for method in suite.methods:
        if method not in rows:
            continue
        r = rows[method]
        cells = [_fmt(r.get(k), kind == "pct") for k, _, kind in columns]
        rec: dict[str, Any] = {"setting": setting, "method": method,
                               "runs": len(r["runs"])}
        for k, _, _ in [*columns, ("wall_s_total", "", "")]:
            mu, sd = r.get(k, (float("nan"), float("nan")))
            rec.update({f"{k}_mean": mu, f"{k}_sd": sd})
        if target is not None:
            cells += _to_target(r["runs"], target, timed)
            hits = [h for h in (first_reach(x["_metrics"], "test_acc", target)
                                for x in r["runs"]) if h is not None]
            rec.update({"target_test_acc": target, "target_reached": len(hits),
                        "rounds_to_target_mean": mean_sd([h[0] for h in hits])[0],
                        "uplink_bytes_to_target_mean": mean_sd([h[1] for h in hits])[0]})
        records.append(rec)
        wall = r.get("wall_s_total")
        wall_cell = f"{wall[0]:.1f}" if wall else "–"
        name = method if seq is None else f"{method} (n={len(r['runs'])})"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {wall_cell} |")
        personal = _personal_row(method, r, columns, len(extra) + 1)
        if personal is not None:
            lines.append(personal)
    lines.append("")
    return lines


def _setting_plots(name: str, setting: str, rows: dict[str, Any], rep: Mapping[str, Any],
                   doc: Path | None, target: float | None, timed: bool) -> list[str]:
    """A setting's figures beside the page (``report.curves``, ``time_curves``, ``cdf``),
    each drawn and linked only when the suite has ``doc:``."""
    lines: list[str] = []
    curves = rep.get("curves")
    if curves and doc is not None:
        png = doc.parent / f"{name}-{setting}-curves.png"
        if plot_curves(png, setting, {m: rows[m]["runs"] for m in curves if m in rows},
                       "test_acc", target):
            lines += [f"![accuracy vs round and vs uplink, {setting}]({png.name})", ""]
    time_curves = rep.get("time_curves")
    if time_curves and doc is not None and timed:
        png = doc.parent / f"{name}-{setting}-time.png"
        if _time_plot(png, setting, {m: rows[m]["runs"] for m in time_curves if m in rows}):
            lines += [f"![accuracy vs simulated time, {setting}]({png.name})", ""]
    cdf = rep.get("cdf")
    if cdf and doc is not None:
        png = doc.parent / f"{name}-{setting}-cdf.png"
        if plot_cdf(png, setting, {m: rows[m]["runs"] for m in cdf if m in rows},
                    "client_acc"):
            lines += [f"![per-client accuracy CDF, {setting}]({png.name})", ""]
    return lines


def _sweep_plot_lines(sp: Mapping[str, Any], table: dict[str, dict[str, Any]], name: str,
                      doc: Path | None) -> list[str]:
    """``report.sweep_plot``: one metric of one setting's methods against a number,
    as a table and (with ``doc:``) a plot."""
    if not (sp and sp["setting"] in table):
        return []
    rows = table[sp["setting"]]
    metric = sp.get("metric", "test_acc")
    pts = [(x, rows[m][metric]) for x, m in zip(sp["x"], sp["methods"], strict=True)
           if m in rows and metric in rows[m]]
    if not pts:
        return []
    lines = [f"## {sp.get('title', 'Sweep')}", "",
             f"Setting `{sp['setting']}`; final `{metric}`, mean ± sd over seeds.", "",
             f"| {sp.get('xlabel', 'x')} | " + " | ".join(f"{x:g}" for x, _ in pts)
             + " |", "|---|" + "---|" * len(pts),
             "| " + metric + " | " + " | ".join(_fmt(v) for _, v in pts) + " |", ""]
    png = doc.parent / f"{name}-sweep.png" if doc is not None else None
    if png is not None and _sweep_plot(png, sp.get("title", "Sweep"), [x for x, _ in pts],
                                       [v for _, v in pts], sp.get("xlabel", "x"),
                                       f"{metric} (%)"):
        lines += [f"![{sp.get('title', 'sweep')}]({png.name})", ""]
    return lines


def _comparison_lines(comp: Mapping[str, Any], table: dict[str, dict[str, Any]],
                      seq: Any) -> list[str]:
    """``report.compare``: each candidate paired with the baseline in every setting."""
    lines = ["## Comparisons", "",
             "Paired over the seeds (candidate − baseline): verdict, mean difference and "
             + ("95 % t-interval" if seq is None else
                "95 % confidence sequence (the seeds were given sequentially)")
             + "; better or worse only when the interval excludes 0.", ""]
    for setting, rows in table.items():
        for cand in comp.get("candidates", []):
            s = _compare(setting, rows, comp["baseline"], cand, seq is not None)
            if s:
                lines.append(s)
    lines.append("")
    return lines


def write_report(suite: Any, chosen: dict[tuple[str, str], Any], specs: list[Any],
                 elapsed_s: float, workers: int, csv: str | Path | None = None) -> str:
    """The page's markdown; written to ``suite.report.doc`` with its plots beside it when
    the suite has ``doc:`` (without it, no plots: the caller prints the text). ``csv``:
    also the results tables as one CSV (a row per setting and method)."""
    rep = suite.report.options
    table = aggregate_runs(specs)
    doc = suite.report.doc
    records: list[dict[str, Any]] = []
    lines = [f"# {rep.get('title', suite.name)}", ""]
    if rep.get("intro"):
        lines += [rep["intro"].strip(), ""]
    lines += ["Regenerate this page (runs that already finished are reused):", "", "```bash",
              rep.get("command", f"fedloom sweep {suite.path}"), "```", ""]
    head_at = len(lines)  # the decided fraction and the compute go here (report.effort)
    targets = _targets(suite, table)
    seq = _sequential(suite)
    claim_lines, claim_recs = claims_lines(suite, table, targets, seq)
    lines += claim_lines
    if csv is not None:
        records += [{"kind": "claim", **r} for r in claim_recs]
    if suite.tuning.protocol is not None:
        lines += _protocol_lines(suite, chosen)
    elif chosen:
        lines += _grid_tuning_lines(suite, chosen)
    run_time = sum(r.get("wall_s_total", (0.0, 0.0))[0] * len(r["runs"])
                   for rows in table.values() for r in rows.values())
    lines += ["## Results", "",
              (f"Mean ± sd over seeds {suite.seeds}, in % (final evaluation). Per-client "
               if seq is None else
               f"Mean ± sd over the seeds each method ran (its first n of 1–{seq.max}, n "
               "beside its name), in % (final evaluation). Per-client ")
              + "accuracy is over all clients on their own test split; `std` is the population "
              "std across clients; `conflict rate` is the mean over rounds of the fraction of "
              "the cohort whose update has a negative inner product with the aggregate.", ""]
    columns = [(c[0], c[1], c[2] if len(c) > 2 else "pct") for c in rep.get("columns", [])] \
        or [(k, label, "pct") for k, label in COLUMNS]
    for setting, rows in table.items():
        target, timed = targets.get(setting), _timed(rows)
        lines += _results_table(suite, setting, rows, columns, target, rep.get("target"),
                                timed, seq, records)
        lines += _setting_plots(suite.name, setting, rows, rep, doc, target, timed)
        if getattr(suite, "sensitivity_specs", None):
            lines += _sensitivity_lines(suite, setting, doc, chosen)
    lines += _sweep_plot_lines(rep.get("sweep_plot"), table, suite.name, doc)
    het = rep.get("heterogeneity")
    if het:
        lines += _heterogeneity_lines(het, table, suite.name, doc)
    if rep.get("across"):
        lines += _across_lines(rep["across"], table, suite.name, doc)
    comp = rep.get("compare")
    if comp:
        lines += _comparison_lines(comp, table, seq)
    if rep.get("notes"):
        lines += ["## Notes", "", rep["notes"].strip(), ""]
    missing = sum(1 for s in specs if not (s.out / "summary.json").exists())
    if missing:
        lines += ["## Incomplete", "",
                  f"{missing} of {len(specs)} runs have not finished; the tables above hold "
                  "only the finished ones. Run the command again to complete them.", ""]
    lines += ["## Cost", "",
              f"Sweep wall time {elapsed_s / 60:.1f} min with {workers} single-thread workers "
              f"(sum of the reported runs' own wall time: {run_time / 60:.1f} min; tuning runs "
              "not included in that sum).", ""]
    sens = [sp.out for rows in getattr(suite, "sensitivity_specs", {}).values()
            for _, sps in rows for sp in sps]
    lines[head_at:head_at] = head_lines(
        claim_recs, {"tuning": [sp.out for sp in getattr(suite, "trial_specs", [])],
                     "reported": [sp.out for sp in specs], "sensitivity": sens},
        elapsed_s, workers, rep.get("before"))
    text = "\n".join(lines)
    if doc is not None:
        write_output(doc, text)  # replaced whole: never written through a link
    if csv is not None:
        write_csv(csv, records)
    return text
