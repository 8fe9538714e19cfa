"""Sweeps: settings × methods × seeds, run in parallel, resumable, then reported.

A suite file (YAML) names the experiment grid::

    name: craft
    out: runs/craft                   # one run directory per (setting, method, seed)
    doc: docs/results/craft.md        # the report this suite regenerates
    seeds: [1, 2, 3]
    settings:
      mnist: {config: configs/craft/mnist.yaml, overrides: [rounds=60]}
    methods:
      FedAvg: []
      CRAFT-layer: [aggregator.name=craft, server.lr=$TUNE]
    tune:
      CRAFT-layer: {key: server.lr, grid: [0.1, 0.3, 1.0]}

Each run is ``fedloom run CONFIG OVERRIDES seed=S --out DIR`` with one thread,
``workers`` at a time, in long-lived worker processes (:class:`_Launcher`); a run
whose ``summary.json`` exists is not run again, so a stopped sweep continues where
it stopped. A ``tuning:`` section is :mod:`fedloom.tuning`'s protocol, ``seeds: {min,
max, batch}`` :mod:`fedloom.sweep.sequential`'s, the page :mod:`fedloom.report.sweep`'s.

The whole format (the tuning protocol, seeds where they decide, paths, one sweep per
``out:``, the checks before any run, failures, the ``report:`` keys):
docs/howto/sweeps.md (The suite file).
"""

from __future__ import annotations

from fedloom.sweep.checks import (
    drop_missing_data,
    validate_suite,
)
from fedloom.sweep.driver import (  # noqa: F401  (re-exported)
    SWEEP_LOCK,
    run_suite,
)
from fedloom.sweep.running import (  # noqa: F401  (re-exported)
    read_summary,
)
from fedloom.sweep.suite import (  # noqa: F401  (re-exported)
    CLAIM_KEYS,
    TUNE,
    RunSpec,
    StaleRunsError,
    Suite,
    SweepError,
    SweepFolderError,
    dump_yaml,
    load_suite,
)
from fedloom.sweep.tune import (  # noqa: F401  (re-exported)
    main_specs,
    sensitivity_specs,
    tune_protocol,
    tuned_values,
)

__all__ = ["RunSpec", "StaleRunsError", "Suite", "SweepError", "SweepFolderError",
           "drop_missing_data", "load_suite", "run_suite", "validate_suite"]

