"""Compare runs: tables and plots across run directories, mean ± sd over seeds.

``fedloom compare RUN_OR_SWEEP_DIR …`` and the pages of ``fedloom sweep`` are
made by this package (one implementation of reading, grouping, aggregating and
plotting runs). Every name of its modules below is importable from
``fedloom.report.compare``:

- :mod:`fedloom.report.compare.runs`: a run directory read and checked
  (:class:`Run`, :func:`load_run`, :func:`find_run_dirs`) and the numbers a run
  gives (:func:`metric_value`, :func:`run_stats`, :func:`first_reach`, :func:`mean_sd`);
- :mod:`fedloom.report.compare.groups`: runs grouped into experiments
  (:func:`group_runs`) and their tables (:func:`compare_table`; text, Markdown, CSV);
- :mod:`fedloom.report.compare.figures`: the plots (matplotlib, the ``report``
  extra): curves against rounds and uplink, the per-client accuracy CDF, facets;
- :mod:`fedloom.report.compare.command`: ``fedloom compare`` itself
  (:func:`compare`) and every group against a baseline seed by seed
  (:func:`paired_table`).
"""

from __future__ import annotations

from fedloom.report.compare.command import (  # noqa: F401  (re-exported)
    DEFAULT_METRICS,
    better_direction,
    compare,
    paired_table,
)
from fedloom.report.compare.figures import (  # noqa: F401  (re-exported)
    DEFAULT_MAX_LINES,
    Panel,
    cap_lines,
    cdf_facets_figure,
    curves_facets_figure,
    curves_figure,
    facet_groups,
    facet_keys,
    log_ticks,
    panel_labels,
    plot_cdf,
    plot_cdf_faceted,
    plot_curves,
    plot_curves_faceted,
)
from fedloom.report.compare.groups import (  # noqa: F401  (re-exported)
    IGNORED_KEYS,
    Group,
    compare_table,
    group_runs,
    markdown_table,
    text_table,
    write_csv,
)
from fedloom.report.compare.runs import (  # noqa: F401  (re-exported)
    Run,
    check_metric,
    check_number,
    find_run_dirs,
    first_reach,
    is_run_dir,
    load_run,
    lower_is_better,
    mean_sd,
    metric_value,
    run_stats,
)

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
