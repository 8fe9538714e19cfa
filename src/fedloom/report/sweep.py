"""The markdown report of a sweep: tables (mean ± sd over seeds), CDF plots, comparisons."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["aggregate_runs", "write_report"]

COLUMNS = [
    ("client_acc_mean", "client acc mean"),
    ("client_acc_std", "client acc std"),
    ("client_acc_worst10", "worst 10 %"),
    ("client_acc_best10", "best 10 %"),
    ("test_acc", "test acc"),
    ("conflict_rate_mean", "conflict rate"),
]


def _mean_sd(values: list[float]) -> tuple[float, float]:
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], dtype=float)
    if v.size == 0:
        return float("nan"), float("nan")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def _run_stats(out: Path) -> dict[str, Any]:
    summary = json.loads((out / "summary.json").read_text())
    ms = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
          if line.strip()]
    for key in ("conflict_rate", "grad_mismatch", "density", "residual_norm"):
        vals = [m[key] for m in ms if key in m]
        summary[f"{key}_mean"] = float(np.nanmean(vals)) if vals else float("nan")
    summary["uplink_mb_total"] = ms[-1]["uplink_bytes_total"] / 1e6 if ms else float("nan")
    summary["uplink_bytes_per_round"] = (float(np.mean([m["uplink_bytes"] for m in ms]))
                                         if ms else float("nan"))
    accs = [m["test_acc"] for m in ms if "test_acc" in m]
    summary["test_acc_peak"] = max(accs) if accs else float("nan")
    summary["_curve"] = [(m["round"], m["test_acc"], m["uplink_bytes_total"] / 1e6)
                         for m in ms if "test_acc" in m]
    acc_file = out / "client_acc.json"
    summary["_client_acc"] = json.loads(acc_file.read_text()) if acc_file.exists() else {}
    return summary


def aggregate_runs(specs: list[Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """{setting: {method: {"runs": [...], metric: (mean, sd)}}}."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for spec in specs:
        if not (spec.out / "summary.json").exists():
            continue  # not run (yet): the report says how many are missing
        row = table.setdefault(spec.setting, {}).setdefault(spec.method, {"runs": []})
        row["runs"].append(_run_stats(spec.out))
    for methods in table.values():
        for row in methods.values():
            runs = row["runs"]
            keys = {k for r in runs for k in r if not k.startswith("_")}
            for k in keys:
                if all(isinstance(r.get(k), int | float) for r in runs):
                    row[k] = _mean_sd([float(r[k]) for r in runs])
    return table


def _fmt(ms: tuple[float, float] | None, pct: bool = True) -> str:
    if ms is None or math.isnan(ms[0]):
        return "–"
    scale = 100.0 if pct else 1.0
    if not pct and abs(ms[0]) < 0.1:
        return f"{ms[0]:.3g} ± {ms[1]:.2g}"
    return f"{ms[0] * scale:.1f} ± {ms[1] * scale:.1f}"


def _to_target(runs: list[dict[str, Any]], target: float) -> tuple[str, str]:
    """Mean rounds and uplink MB to first reach ``target`` test accuracy, over the seeds
    that reach it (with the count when some do not)."""
    hits = []
    for r in runs:
        hit = next(((rd, mb) for rd, acc, mb in r["_curve"] if acc >= target), None)
        if hit is not None:
            hits.append(hit)
    if not hits:
        return "not reached", "–"
    suffix = "" if len(hits) == len(runs) else f" ({len(hits)}/{len(runs)} seeds)"
    return (f"{np.mean([h[0] for h in hits]):.0f}{suffix}",
            f"{np.mean([h[1] for h in hits]):.1f}{suffix}")


def _curves_plot(path: Path, setting: str, rows: dict[str, dict[str, Any]],
                 methods: list[str], target: float | None) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120)
    for m in methods:
        if m not in rows:
            continue
        curves = [r["_curve"] for r in rows[m]["runs"]]
        n = min(len(c) for c in curves)
        if n == 0:
            continue
        rounds = [c[0] for c in curves[0][:n]]
        acc = np.mean([[c[i][1] for i in range(n)] for c in curves], axis=0) * 100
        mb = np.mean([[c[i][2] for i in range(n)] for c in curves], axis=0)
        axes[0].plot(rounds, acc, label=m)
        axes[1].plot(mb, acc, label=m)
    for ax, xl in zip(axes, ("round", "cumulative uplink (MB)"), strict=True):
        ax.set_xlabel(xl)
        ax.set_ylabel("test accuracy (%)")
        ax.grid(alpha=0.3)
        if target is not None:
            ax.axhline(target * 100, color="grey", ls=":", lw=1)
    axes[1].set_xscale("log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{setting}: mean over seeds")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
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
    fig.savefig(path)
    plt.close(fig)
    return True


def _cdf_plot(path: Path, setting: str, rows: dict[str, dict[str, Any]],
              methods: list[str], field: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    for m in methods:
        if m not in rows:
            continue
        acc = [a for r in rows[m]["runs"] for a in r["_client_acc"].get(field, []) if a is not None]
        if not acc:
            continue
        xs = np.sort(np.asarray(acc)) * 100
        ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=m)
    ax.set_xlabel("per-client test accuracy (%)")
    ax.set_ylabel("fraction of clients ≤ x")
    ax.set_title(f"{setting}: per-client accuracy, all seeds pooled")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def _compare(setting: str, rows: dict[str, dict[str, Any]], base: str,
             cand: str) -> str | None:
    if base not in rows or cand not in rows:
        return None
    b, c = rows[base], rows[cand]
    parts = []
    keys = (("client_acc_mean", "mean", 1), ("client_acc_std", "std", -1),
            ("client_acc_worst10", "worst 10 %", 1))
    if "client_acc_mean" not in b or "client_acc_mean" not in c:
        keys = (("test_acc", "test acc", 1), ("test_acc_peak", "peak test acc", 1))
    for key, label, better in keys:
        if key not in b or key not in c:
            continue
        d = (c[key][0] - b[key][0]) * 100
        noise = math.hypot(b[key][1], c[key][1]) * 100
        verdict = ("better" if d * better > noise else "worse" if d * better < -noise
                   else "within seed spread")
        parts.append(f"{label} {d:+.1f} pp ({verdict})")
    return f"- **{setting}**, {cand} vs {base}: " + "; ".join(parts) + "."


def write_report(suite: Any, chosen: dict[tuple[str, str], Any], specs: list[Any],
                 elapsed_s: float, workers: int) -> Path | None:
    if suite.doc is None:
        return None
    rep = suite.report
    table = aggregate_runs(specs)
    doc = suite.doc
    lines = [f"# {rep.get('title', suite.name)}", ""]
    if rep.get("intro"):
        lines += [rep["intro"].strip(), ""]
    lines += ["Regenerate this page (runs that already finished are reused):", "", "```bash",
              rep.get("command", f"fedloom sweep {suite.path}"), "```", ""]
    if chosen:
        lines += ["## Tuning", "", f"Tuned on seed {suite.tune_seed} (not one of the reported "
                  f"seeds {suite.seeds}) by the best `{suite.tune_metric}`:", ""]

        def key(m: str) -> str:
            return suite.tune[m if m in suite.tune else suite.share_tuning[m]]["key"]

        for setting in suite.settings:
            picks = [f"{m}: `{key(m)}` = {chosen[(setting, m)]}"
                     for (s, m) in chosen if s == setting]
            if picks:
                lines.append(f"- {setting}: " + ", ".join(picks))
        lines.append("")
    run_time = sum(r.get("wall_s_total", (0.0, 0.0))[0] * len(r["runs"])
                   for rows in table.values() for r in rows.values())
    lines += ["## Results", "",
              f"Mean ± sd over seeds {suite.seeds}, in % (final evaluation). Per-client "
              "accuracy is over all clients on their own test split; `std` is the population "
              "std across clients; `conflict rate` is the mean over rounds of the fraction of "
              "the cohort whose update has a negative inner product with the aggregate.", ""]
    columns = [(c[0], c[1], c[2] if len(c) > 2 else "pct") for c in rep.get("columns", [])] \
        or [(k, label, "pct") for k, label in COLUMNS]
    target_cfg = rep.get("target")
    for setting, rows in table.items():
        desc = suite.settings[setting].get("describe", "")
        lines += [f"### {setting}", ""] + ([desc.strip(), ""] if desc else [])
        target = None
        if target_cfg and target_cfg["baseline"] in rows:
            base = rows[target_cfg["baseline"]].get(target_cfg.get("metric", "test_acc"))
            if base is not None:
                target = target_cfg.get("fraction", 0.9) * base[0]
                lines += [f"Target: {target * 100:.1f} % test accuracy "
                          f"({target_cfg.get('fraction', 0.9):g} × {target_cfg['baseline']}'s "
                          "final accuracy).", ""]
        extra = ["rounds to target", "uplink MB to target"] if target is not None else []
        lines.append("| method | " + " | ".join([c[1] for c in columns] + extra) +
                     " | wall s / run |")
        lines.append("|---|" + "---|" * (len(columns) + len(extra) + 1))
        for method in suite.methods:
            if method not in rows:
                continue
            r = rows[method]
            cells = [_fmt(r.get(k), kind == "pct") for k, _, kind in columns]
            if target is not None:
                cells += list(_to_target(r["runs"], target))
            wall = r.get("wall_s_total")
            wall_cell = f"{wall[0]:.1f}" if wall else "–"
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {wall_cell} |")
            if any(k.startswith("personal_acc_mean") for k in r):
                pm = [_fmt(r.get(f"personal_acc_{k}")) for k in ("mean", "std", "worst10",
                                                                  "best10")]
                lines.append(f"| {method} (personal models) | " + " | ".join(pm) +
                             " |" + " – |" * (len(columns) + len(extra) - 4 + 1))
        lines.append("")
        curves = rep.get("curves")
        if curves:
            png = doc.parent / f"{suite.name}-{setting}-curves.png"
            if _curves_plot(png, setting, rows, list(curves), target):
                lines += [f"![accuracy vs round and vs uplink, {setting}]({png.name})", ""]
        cdf = rep.get("cdf")
        if cdf:
            png = doc.parent / f"{suite.name}-{setting}-cdf.png"
            if _cdf_plot(png, setting, rows, list(cdf), "client_acc"):
                lines += [f"![per-client accuracy CDF, {setting}]({png.name})", ""]
    sp = rep.get("sweep_plot")
    if sp and sp["setting"] in table:
        rows = table[sp["setting"]]
        metric = sp.get("metric", "test_acc")
        pts = [(x, rows[m][metric]) for x, m in zip(sp["x"], sp["methods"], strict=True)
               if m in rows and metric in rows[m]]
        if pts:
            lines += [f"## {sp.get('title', 'Sweep')}", "",
                      f"Setting `{sp['setting']}`; final `{metric}`, mean ± sd over seeds.", "",
                      f"| {sp.get('xlabel', 'x')} | " + " | ".join(f"{x:g}" for x, _ in pts)
                      + " |", "|---|" + "---|" * len(pts),
                      "| " + metric + " | " + " | ".join(_fmt(v) for _, v in pts) + " |", ""]
            png = doc.parent / f"{suite.name}-sweep.png"
            if _sweep_plot(png, sp.get("title", "Sweep"), [x for x, _ in pts],
                           [v for _, v in pts], sp.get("xlabel", "x"), f"{metric} (%)"):
                lines += [f"![{sp.get('title', 'sweep')}]({png.name})", ""]
    comp = rep.get("compare")
    if comp:
        lines += ["## Comparisons", "",
                  "Differences of the seed means; a difference counts as better or worse only "
                  "when it exceeds the combined seed sd.", ""]
        for setting, rows in table.items():
            for cand in comp.get("candidates", []):
                s = _compare(setting, rows, comp["baseline"], cand)
                if s:
                    lines.append(s)
        lines.append("")
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
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(lines))
    return doc
