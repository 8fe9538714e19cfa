"""``fedloom compare`` in one call (:func:`compare`): runs read, checked, grouped,
tabled and plotted, returning the terminal text and the notes (files written,
plots skipped, groups a plot's panel left out); and every group against a
baseline group seed by seed (:func:`paired_table`, with the 95 % t-intervals of
:mod:`fedloom.report.stats`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedloom.files import write_output
from fedloom.report.compare.figures import (
    DEFAULT_MAX_LINES,
    Panel,
    _pyplot,
    cap_lines,
    facet_groups,
    facet_keys,
    panel_labels,
    plot_cdf_faceted,
    plot_curves_faceted,
)
from fedloom.report.compare.groups import (
    Group,
    compare_table,
    group_runs,
    markdown_table,
    text_table,
    write_csv,
)
from fedloom.report.compare.runs import (
    Run,
    check_metric,
    find_run_dirs,
    load_run,
    lower_is_better,
    metric_value,
    run_stats,
)

DEFAULT_METRICS = ("test_acc", "client_acc_mean", "client_acc_worst10")


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
    _check_metrics(runs, metrics, target_metric if target is not None else None)
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
        md = write_output(markdown_path, lead + ".\n\n" + markdown_table(header, rows) + "\n")
        notes.append(f"markdown: {md}")
    if csv_path is not None:
        notes.append(f"csv: {write_csv(csv_path, records)}")
    if plots_dir is not None:
        if _pyplot() is None:
            notes.append("plots skipped: matplotlib is not installed "
                         "(pip install 'fedloom[report]')")
        else:
            metric = target_metric if target is not None else metrics[0]
            notes += _write_plots(Path(plots_dir), facets, fkeys, metric, target, max_lines)
    return lead + "\n\n" + text_table(header, rows) + paired_text, notes


def _check_metrics(runs: Sequence[Run], metrics: Sequence[str],
                   target_metric: str | None) -> None:
    """Refuse a ``--metric`` or ``--target-metric`` that no run has (naming near ones),
    and a file where one is not a number."""
    for r in runs:  # what the table shows: a number in every file that has it
        for name in {*metrics, *([target_metric] if target_metric is not None else [])}:
            check_metric(r, name)
    known: set[str] = set()
    for r in runs:
        known.update(k for k in run_stats(r) if not k.startswith("_"))
        for m in r.metrics:
            known.update(m)
    for opt, name in [*(("--metric", m) for m in metrics),
                      *([("--target-metric", target_metric)] if target_metric is not None
                        else [])]:
        if name not in known:
            import difflib

            near = difflib.get_close_matches(name, sorted(known), n=3)
            raise ValueError(f"{opt} {name}: no run has it"
                             + (f" (did you mean {', '.join(near)}?)" if near else ""))


def _write_plots(d: Path, facets: dict[str, list[Group]], fkeys: Sequence[str], metric: str,
                 target: float | None, max_lines: int) -> list[str]:
    """Write curves.png and client_acc_cdf.png under ``d``, at most ``max_lines`` groups
    a panel; the notes saying what was written and which groups were left out."""
    panels: dict[str, Panel] = {}
    in_panel: dict[str, str] = {}
    capped: list[str] = []
    for name, members in facets.items():
        labels = panel_labels(members, fkeys)
        panel: Panel = {lab: [run_stats(r) for r in g.runs]
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
    if plot_cdf_faceted(d / "client_acc_cdf.png", "final model", panels, notes=in_panel):
        written.append(d / "client_acc_cdf.png")
    return ["plots: " + (", ".join(map(str, written)) if written else
                         f"none (no run logged {metric} or per-client accuracy)"), *capped]


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
