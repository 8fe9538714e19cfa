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
    rates = [json.loads(line).get("conflict_rate", float("nan"))
             for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary["conflict_rate_mean"] = float(np.nanmean(rates)) if rates else float("nan")
    acc_file = out / "client_acc.json"
    summary["_client_acc"] = json.loads(acc_file.read_text()) if acc_file.exists() else {}
    return summary


def aggregate_runs(specs: list[Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """{setting: {method: {"runs": [...], metric: (mean, sd)}}}."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for spec in specs:
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
    return f"{ms[0] * scale:.1f} ± {ms[1] * scale:.1f}"


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
    for key, label, better in (("client_acc_mean", "mean", 1), ("client_acc_std", "std", -1),
                               ("client_acc_worst10", "worst 10 %", 1)):
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
            lines.append(f"- {setting}: " + ", ".join(picks))
        lines.append("")
    run_time = sum(r.get("wall_s_total", (0.0, 0.0))[0] * len(r["runs"])
                   for rows in table.values() for r in rows.values())
    lines += ["## Results", "",
              f"Mean ± sd over seeds {suite.seeds}, in % (final evaluation). Per-client "
              "accuracy is over all clients on their own test split; `std` is the population "
              "std across clients; `conflict rate` is the mean over rounds of the fraction of "
              "the cohort whose update has a negative inner product with the aggregate.", ""]
    for setting, rows in table.items():
        desc = suite.settings[setting].get("describe", "")
        lines += [f"### {setting}", ""] + ([desc.strip(), ""] if desc else [])
        lines.append("| method | " + " | ".join(c[1] for c in COLUMNS) + " | wall s / run |")
        lines.append("|---|" + "---|" * (len(COLUMNS) + 1))
        for method in suite.methods:
            if method not in rows:
                continue
            r = rows[method]
            cells = [_fmt(r.get(k)) for k, _ in COLUMNS]
            wall = r.get("wall_s_total")
            wall_cell = f"{wall[0]:.1f}" if wall else "–"
            lines.append(f"| {method} | " + " | ".join(cells) + f" | {wall_cell} |")
            if any(k.startswith("personal_acc_mean") for k in r):
                pm = [_fmt(r.get(f"personal_acc_{k}")) for k in ("mean", "std", "worst10",
                                                                  "best10")]
                lines.append(f"| {method} (personal models) | " + " | ".join(pm) +
                             " | – | – | – |")
        lines.append("")
        cdf = rep.get("cdf")
        if cdf:
            png = doc.parent / f"{suite.name}-{setting}-cdf.png"
            if _cdf_plot(png, setting, rows, list(cdf), "client_acc"):
                lines += [f"![per-client accuracy CDF, {setting}]({png.name})", ""]
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
    lines += ["## Cost", "",
              f"Sweep wall time {elapsed_s / 60:.1f} min with {workers} single-thread workers "
              f"(sum of the reported runs' own wall time: {run_time / 60:.1f} min; tuning runs "
              "not included in that sum).", ""]
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("\n".join(lines))
    return doc
