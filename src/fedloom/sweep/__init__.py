"""Sweeps: settings × methods × seeds, run in parallel, resumable, then reported.

A suite file (YAML) names the experiment grid::

    name: craft
    out: runs/craft                   # one run directory per (setting, method, seed)
    doc: docs/results/craft.md        # the report this suite regenerates
    seeds: [1, 2, 3]
    tune_seed: 0                      # tuning runs use their own seed
    tune_metric: client_acc_mean
    settings:
      mnist: {config: configs/craft/mnist.yaml, overrides: [rounds=60]}
    methods:
      FedAvg: []
      CRAFT-layer: [aggregator.name=craft, server.lr=$TUNE]
      SA-PEF(0.5): {overrides: [compression.feedback.options.alpha=0.5],
                    settings: [mnist]}  # some settings only
    tune:
      CRAFT-layer: {key: server.lr, grid: [0.1, 0.3, 1.0]}
    share_tuning: {Ditto+CRAFT: CRAFT-layer}   # reuse another method's tuned value

The tuning protocol. Instead of ``tune:`` (one key per method, on ``tune_seed``), a
suite may state a ``tuning:`` section: one budget of trials for every method, its
own seeds, per-method search spaces, a sensitivity sweep (format and samplers in
:mod:`fedloom.tuning`)::

    tuning:
      budget: 6
      seeds: [100]
      metric: client_acc_mean
      rounds: 30
      space: {client.lr: [0.003, 0.01, 0.03, 0.1], server.lr: [0.5, 1.0, 1.5]}
      sensitivity: {key: client.lr}
    settings:
      synthetic: {config: …, space: {client.lr: [0.01, 0.1, 0.3]}, tuning_rounds: 40}
    methods:
      FedAvg: []
      FedProx: {overrides: [], space: {client.prox_mu: [0.001, 0.01, 0.1]}}
      Fixed: {overrides: [...], tune: false}          # run as given
    share_tuning: {Ditto+CRAFT: CRAFT}                # borrow a chosen point
    claims:                                           # fedloom.report.claims
      - {claim: "…", method: CRAFT, against: [FedAvg], metric: client_acc_worst10}

Seeds where they decide. Instead of a list, ``seeds: {min: 3, max: 12, batch: 2}``
gives seeds sequentially (:mod:`fedloom.sweep.sequential`; it needs ``claims:``):
the seeds are 1 … ``max``; every (setting, method) runs the first ``min``; after
each batch every claim cell is computed again, and a (setting, method pair) with
a cell still *no evidence* gets ``batch`` more seeds, until its cells are decided
or it reaches ``max``. The cells use an anytime-valid confidence sequence
(:mod:`fedloom.report.sequential`) in place of the t-interval, so looking after
every batch keeps their 95 %; each cell names the seeds it used
(``**better** (n=6) …``). Rerunning with a larger ``max`` reuses every run done.
A list of seeds keeps the fixed protocol, its pages unchanged.

Tuning runs live in ``OUT/SETTING/METHOD@tune=POINT/seedS``, sensitivity runs in
``…/METHOD@sens=KEY=V/seedS``; every trial and the choice go to
``OUT/NAME.tuning.json`` and to the page.

Paths. A setting's ``config:`` is looked up relative to the suite file's folder
first, then relative to the current directory (where the suites under
``configs/`` name ``configs/…/x.yaml`` and are run from the repository root);
an absolute path is taken as it is. ``out:`` and ``doc:`` are relative to the
current directory. Nothing is written outside ``out:`` (and ``doc:``'s folder):
every name that becomes part of a path — the suite's ``name``, each setting's and
method's, a tuned value, a ``report.across`` panel's — passes
:func:`fedloom.names.path_component` (one folder name, never ``..``, ``/`` or an
absolute path) when the suite is loaded; method names and tuned values are first
encoded (characters other than letters, digits and ``-_.`` or ``-_.=,`` become
``_``). A name that cannot be one is one line naming the field (exit 2).

One sweep per ``out:``. A sweep holds an exclusive lock on ``OUT/.fedloom-sweep.lock``
for its life (the kernel drops it when the process ends, however it ends); a
second sweep on the same folder is refused in one line naming the first's pid
(exit 2) before it writes anything. ``--report-only`` takes no lock.

Checks first. Before any run starts, every method × setting config (the
setting's overrides, then the method's; ``$TUNE`` replaced by each value of its
grid) is loaded and validated: a bad one is one line naming the suite file, the
method, the setting and the field (``fedloom sweep``: exit 2), and nothing runs.
A setting whose data is not on this machine (CIFAR, FEMNIST, … under the data
root; :func:`fedloom.data.sources.missing_source`) is left out with one line
saying which dataset is missing and where it was looked for; when every
setting's data is missing the sweep stops there (exit 2).

Each run is ``fedloom run CONFIG OVERRIDES seed=S --out DIR`` with one thread
(``OMP_NUM_THREADS=1``), ``workers`` at a time, in long-lived worker processes
(:class:`_Launcher`; ``RUNNER = "subprocess"``: a fresh process per run). A run whose
``summary.json`` exists is not run again, so a stopped sweep continues where
it stopped (a run stopped mid-way resumes). A run in ``out:``, finished or stopped,
whose saved config differs from the one the suite now asks of it (a method's
overrides changed) stops the sweep before the runs it is one of start (the tuning
trials, a TPE step's trials, the main runs): one line naming it and the key (exit
1), no page made; so does one trained on other data than its setting names now
(its ``data.json``: :mod:`fedloom.sweep.datacheck`). ``$TUNE`` is
replaced by the value the tuning runs chose: the grid value with the best
``tune_metric`` on ``tune_seed``. A run that fails does not
stop the others; the report is made from those that finished, then
:class:`SweepError` says how many failed and the first one's error
(``fedloom sweep``: one line, exit 1).

The report (:mod:`fedloom.report.sweep`, from the runs read and aggregated by
:mod:`fedloom.report.compare`) is written to ``doc:`` with its PNG plots beside
it; a suite without ``doc:`` prints it instead (no plots), also with
``--report-only``. ``fedloom sweep --csv FILE`` also writes the results tables as
CSV. The optional ``report:`` section shapes the page; every key is optional::

    report:
      title: "…"              # page title (default: the suite's name)
      intro: "…"              # paragraph under the title
      command: make repro-x   # the command shown to regenerate the page
                              # (default: fedloom sweep SUITE)
      columns:                # table columns: [metric, header] or
        - [test_acc, final test acc]         # [metric, header, num]; metrics are
        - [uplink_mb_total, uplink MB, num]  # a run's final values (summary.json) and
                              # test_acc_peak, uplink_mb_total, uplink_bytes_per_round,
                              # {conflict_rate,grad_mismatch,density,residual_norm}_mean;
                              # shown in % unless `num` (default: client accuracy
                              # mean/std/worst 10 %/best 10 %, test acc, conflict rate)
      target: {baseline: FedAvg, fraction: 0.9, metric: test_acc}
                              # adds rounds and uplink MB to reach fraction × the
                              # baseline's final metric (test accuracy curves)
      curves: [FedAvg, CRAFT] # methods in the accuracy-vs-round/uplink plot (seed bands)
      time_curves: [FedAvg]   # runs with a simulated clock (system.profile): accuracy vs
                              # sim_time_s (min); the target adds "sim. min to target"
      cdf: [FedAvg, CRAFT]    # methods in the per-client accuracy CDF plot
      sweep_plot:             # one metric across methods that form a 1-D sweep
        {setting: s, methods: [A, B], x: [0.1, 0.5], xlabel: α, title: "…",
         metric: test_acc}
      heterogeneity:          # settings ordered by a split measure (summary.json's
        {x: partition_hellinger, xlabel: "…", methods: [A, B],   # partition_*), each
         metrics: [client_acc_mean, client_acc_worst10]}         # method's metrics
                              # beside it, and their plot against it
      across:                 # a metric against a number given to settings (e.g. the
        {title: "…", xlabel: "client lr ×", intro: "…",   # client-lr multiplier), a
         panels: [{name: n, title: "…", metric: client_acc_mean,  # table and plot each
                   x: {setting-a: 0.25, setting-b: 1}, methods: [A, B],
                   xlabel: "…"}]}    # (a panel's xlabel, else the section's)
      compare: {baseline: FedAvg, candidates: [CRAFT]}
                              # "better/worse/within seed spread" lines
      notes: "…"              # closing paragraph
      before: "…"             # what an earlier protocol decided, beside the page's own
                              # decided cells and compute (fedloom.report.effort)
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

