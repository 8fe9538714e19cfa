"""The plots of ``fedloom compare`` and of a sweep's pages.

Plots (matplotlib, the ``report`` extra): the metric against the round and against
cumulative uplink (each group's seed mean as a line, mean ± sd as a band), and
the per-client accuracy CDF (the mean of the runs' empirical CDFs, ± sd). The
plots of ``fedloom compare`` have one row per facet (the ``data.*`` keys that
differ between groups, or ``--facet KEY …``); a panel labels groups by the keys
that differ among them and draws at most ``--max-lines N`` groups, naming the ones
left out. Axes, facets, labels and legends in detail: docs/howto/cli.md (The
plots in detail).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedloom.files import save_figure
from fedloom.report.compare.groups import Group, _flatten, _label, _normalised, _show
from fedloom.report.compare.runs import _number, lower_is_better

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
    save_figure(fig, path)  # replaced whole: never written through a link
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

