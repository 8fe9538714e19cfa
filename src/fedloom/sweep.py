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
      SA-PEF(0.5): {overrides: [compression.alpha=0.5], settings: [mnist]}  # some settings only
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
1), no page made. ``$TUNE`` is
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
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedloom.config import ConfigError, yaml_load
from fedloom.names import encode_component, path_component
from fedloom.tuning import (
    Protocol,
    Range,
    Space,
    Trial,
    best_trial,
    grid_points,
    load_protocol,
    merge_space,
    overrides,
    parse_space,
    point_slug,
    tpe_point,
)

__all__ = ["RunSpec", "StaleRunsError", "Suite", "SweepError", "SweepFolderError",
           "drop_missing_data", "load_suite", "run_suite", "validate_suite"]

TUNE = "$TUNE"


class SweepError(RuntimeError):
    """Runs of a sweep failed (one line: how many, and the first one's error). The
    other runs went on; ``suite`` is the suite, its report made from what finished."""

    suite: Suite | None = None


class StaleRunsError(SweepError):
    """Runs already in ``out:`` (finished, or stopped mid-way) hold another config than
    the suite asks of them: the runs they are among do not start and no page is made
    (one line naming the first and the key that differs)."""


class SweepFolderError(ValueError):
    """The suite's ``out:`` folder cannot be a sweep's: another sweep holds it (one
    line naming its pid), or it cannot be created or locked; this sweep wrote
    nothing."""


@dataclass
class Suite:
    name: str
    out: Path
    doc: Path | None
    seeds: list[int]
    settings: dict[str, dict[str, Any]]
    methods: dict[str, list[str]]
    tune: dict[str, dict[str, Any]] = field(default_factory=dict)
    share_tuning: dict[str, str] = field(default_factory=dict)
    tune_seed: int = 0
    tune_metric: str = "client_acc_mean"
    report: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    method_settings: dict[str, list[str]] = field(default_factory=dict)
    report_text: str = ""  # the last report made (printed by the CLI when doc is None)
    # The tuning protocol (fedloom.tuning); None for a suite without ``tuning:``.
    tuning: Protocol | None = None
    method_space: dict[str, Space] = field(default_factory=dict)
    untuned: set[str] = field(default_factory=set)   # methods with ``tune: false``
    # a method's own selection metric (``methods.M.metric``; personal models are chosen
    # on ``personal_acc_mean``), else the protocol's
    method_metric: dict[str, str] = field(default_factory=dict)
    claims: list[dict[str, Any]] = field(default_factory=list)
    # Filled by run_suite: each (setting, method)'s trials, and its sensitivity runs
    # {(setting, method): [(value, [RunSpec per seed])]}.
    trials: dict[tuple[str, str], list[Trial]] = field(default_factory=dict)
    sensitivity_specs: dict[tuple[str, str], list[tuple[Any, list[RunSpec]]]] = field(
        default_factory=dict)

    def space(self, setting: str, method: str) -> Space:
        """The method's space in a setting: the suite's, the setting's, the method's."""
        assert self.tuning is not None
        return merge_space(self.tuning.space, self.settings[setting].get("_space", {}),
                           self.method_space.get(method, {}))

    def tuned(self, method: str) -> bool:
        """Whether the protocol tunes ``method`` itself (not shared, not ``tune: false``)."""
        return (self.tuning is not None and method not in self.untuned
                and method not in self.share_tuning)


@dataclass(frozen=True)
class RunSpec:
    setting: str
    method: str
    seed: int
    config: str
    overrides: tuple[str, ...]
    out: Path

    def command(self) -> list[str]:
        # No per-run plots: the page draws its own (logging changes nothing computed).
        return [sys.executable, "-m", "fedloom.cli", "run", self.config, *self.overrides,
                f"seed={self.seed}", "logging.plots=false", "--out", str(self.out), "--quiet"]

    @property
    def done(self) -> bool:
        return (self.out / "summary.json").exists()


def load_suite(path: str | Path) -> Suite:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: suite file not found")
    raw = _read_suite(p) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: a suite file holds a mapping of settings")
    known = {"name", "out", "doc", "seeds", "settings", "methods", "tune", "share_tuning",
             "tune_seed", "tune_metric", "report", "tuning", "claims"}
    for key in raw:
        if key not in known:
            raise ConfigError(
                f"{p}: {key}: unknown key (expected one of: {', '.join(sorted(known))})"
            )
    for key in ("name", "seeds", "settings", "methods"):
        if key not in raw:
            raise ConfigError(f"{p}: {key}: missing")
    _check_names(p, raw)
    for m in raw.get("tune", {}):
        if m not in raw["methods"]:
            raise ConfigError(f"{p}: tune.{m}: not a method of this suite")
    for m, t in (raw.get("tune") or {}).items():
        if not (isinstance(t, dict) and isinstance(t.get("grid"), list) and t["grid"]
                and "key" in t):
            raise ConfigError(f"{p}: tune.{m}: needs key: and a non-empty grid: list")
    if raw.get("tune") and raw.get("tuning") is not None:
        raise ConfigError(f"{p}: tune: and tuning: both given (tuning: is the protocol; "
                          "tune: its one-key predecessor)")
    protocol = (load_protocol(raw["tuning"], f"{p}: tuning", [int(s) for s in raw["seeds"]])
                if raw.get("tuning") is not None else None)
    for m, src in (raw.get("share_tuning") or {}).items():
        if m not in raw["methods"]:
            raise ConfigError(f"{p}: share_tuning.{m}: not a method of this suite")
        if protocol is not None:
            if src not in raw["methods"] or src in (raw.get("share_tuning") or {}):
                raise ConfigError(f"{p}: share_tuning.{m}: {src!r} is not a tuned method")
        elif src not in (raw.get("tune") or {}):
            raise ConfigError(f"{p}: share_tuning.{m}: {src!r} has no tune entry")
    settings: dict[str, dict[str, Any]] = {}
    for name, st in raw["settings"].items():
        if not isinstance(st, dict):
            raise ConfigError(f"{p}: settings.{name}: must be a mapping with config:")
        settings[name] = {**st, "config": _resolve_config(p, name, st.get("config"))}
        tr = st.get("tuning_rounds")
        if tr is not None and (protocol is None or not isinstance(tr, int) or tr < 1):
            raise ConfigError(f"{p}: settings.{name}.tuning_rounds: needs a tuning: section "
                              "and a whole number ≥ 1")
        if st.get("space") is not None:
            if protocol is None:
                raise ConfigError(f"{p}: settings.{name}.space: needs a tuning: section")
            settings[name]["_space"] = parse_space(st["space"], f"{p}: settings.{name}.space")
    methods: dict[str, list[str]] = {}
    only: dict[str, list[str]] = {}
    spaces: dict[str, Space] = {}
    untuned: set[str] = set()
    method_metric: dict[str, str] = {}
    for m, v in raw["methods"].items():
        if isinstance(v, dict):
            extra = set(v) - {"overrides", "settings", "space", "tune", "metric"}
            if extra:
                raise ConfigError(f"{p}: methods.{m}.{sorted(extra)[0]}: unknown key "
                                  "(expected overrides, settings, space, tune, metric)")
            if (v.get("space") is not None or "tune" in v or "metric" in v) and (
                    protocol is None):
                raise ConfigError(f"{p}: methods.{m}: space:/tune:/metric: need a tuning: "
                                  "section")
            if "metric" in v:
                if not isinstance(v["metric"], str) or not v["metric"]:
                    raise ConfigError(f"{p}: methods.{m}.metric: needs a metric name")
                method_metric[m] = v["metric"]
            if v.get("space") is not None:
                spaces[m] = parse_space(v["space"], f"{p}: methods.{m}.space")
            if v.get("tune") is False:
                untuned.add(m)
            methods[m] = list(v.get("overrides", []) or [])
            if v.get("settings"):
                bad = [s for s in v["settings"] if s not in raw["settings"]]
                if bad:
                    raise ConfigError(f"{p}: methods.{m}.settings: unknown setting {bad[0]!r}")
                only[m] = list(v["settings"])
        else:
            methods[m] = list(v or [])
    if protocol is not None and any(TUNE in o for ov in methods.values() for o in ov):
        raise ConfigError(f"{p}: methods: {TUNE} belongs to tune:; under tuning: a method's "
                          "tuned keys are its space")
    claims = _load_claims(p, raw.get("claims"), methods, settings)
    return Suite(
        name=_suite_name(raw), out=Path(raw.get("out", f"runs/{_suite_name(raw)}")),
        doc=Path(raw["doc"]) if raw.get("doc") else None, seeds=[int(s) for s in raw["seeds"]],
        settings=settings, methods=methods, method_settings=only,
        tune=raw.get("tune", {}) or {}, share_tuning=raw.get("share_tuning", {}) or {},
        tune_seed=int(raw.get("tune_seed", 0)), tune_metric=raw.get("tune_metric",
                                                                     "client_acc_mean"),
        report=raw.get("report", {}) or {}, path=p, tuning=protocol, method_space=spaces,
        untuned=untuned, claims=claims, method_metric=method_metric,
    )


def _read_suite(p: Path) -> Any:
    """The suite file's YAML; :class:`ConfigError` (one line naming the file and the
    line) for text that is not UTF-8 or not YAML, a Python tag included (the loader
    constructs no objects)."""
    try:
        text = p.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not a UTF-8 text file (byte 0x{e.object[e.start]:02x} at "
                          f"offset {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read the suite ({e.strerror or e})") from None
    try:
        return yaml_load(text, str(p))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{p}: not valid YAML{where} ({problem})") from None


def _suite_name(raw: dict[str, Any]) -> str:
    # a number is a name too (name: 2024)
    name = raw["name"]
    return str(name) if isinstance(name, int) and not isinstance(name, bool) else name


def _check_names(p: Path, raw: dict[str, Any]) -> None:
    """Every name of the suite that becomes part of a path is one file or folder name
    (fedloom.names): the suite's (``OUT/NAME.sweep.json``, the page's plots), each
    setting's (``OUT/SETTING``), each method's folder (``OUT/SETTING/METHOD``, its name
    encoded; two methods never share one) and each ``report.across`` panel's (its
    plot). :class:`ConfigError` naming the field otherwise, before anything is
    written."""
    path_component(_suite_name(raw), f"{p}: name")
    if "out" in raw and not (isinstance(raw["out"], str) and raw["out"]):
        raise ConfigError(f"{p}: out: needs a folder path")
    if not isinstance(raw["settings"], dict) or not isinstance(raw["methods"], dict):
        what = "settings" if not isinstance(raw["settings"], dict) else "methods"
        raise ConfigError(f"{p}: {what}: needs a mapping of names")
    for setting in raw["settings"]:
        path_component(setting, f"{p}: settings")
    folders: dict[str, str] = {}
    for method in raw["methods"]:
        if not isinstance(method, str):
            path_component(method, f"{p}: methods")
        folder = path_component(_slug(method), f"{p}: methods: the folder of {method!r}")
        if folder in folders:
            raise ConfigError(f"{p}: methods.{method}: its folder name {folder!r} is also "
                              f"that of methods.{folders[folder]} (rename one)")
        folders[folder] = method
    report = raw.get("report")
    across = report.get("across") if isinstance(report, dict) else None
    panels = across.get("panels") if isinstance(across, dict) else None
    for i, panel in enumerate(panels if isinstance(panels, list) else []):
        if isinstance(panel, dict):
            # the plot's file: NAME-PANEL.png, PANEL its name, else its metric
            path_component(panel.get("name", panel.get("metric", "client_acc_mean")),
                           f"{p}: report.across.panels[{i}].name")


CLAIM_KEYS = {"claim", "method", "against", "metric", "better", "margin", "settings"}


def _load_claims(p: Path, raw: Any, methods: dict[str, list[str]],
                 settings: dict[str, Any]) -> list[dict[str, Any]]:
    """A suite's ``claims:``: each ``{claim: text, method: A, against: [B, …], metric: M,
    better: higher|lower, margin: x, settings: [...]}`` (see fedloom.report.sweep)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"{p}: claims: needs a list")
    out = []
    for i, c in enumerate(raw):
        at = f"{p}: claims[{i}]"
        if not isinstance(c, dict):
            raise ConfigError(f"{at}: needs a mapping")
        extra = set(c) - CLAIM_KEYS
        if extra:
            raise ConfigError(f"{at}.{sorted(extra)[0]}: unknown key")
        for key in ("claim", "method", "against", "metric"):
            if key not in c:
                raise ConfigError(f"{at}.{key}: missing")
        against = c["against"] if isinstance(c["against"], list) else [c["against"]]
        for m in [c["method"], *against]:
            if m not in methods:
                raise ConfigError(f"{at}: {m!r} is not a method of this suite")
        if c.get("better", "higher") not in ("higher", "lower"):
            raise ConfigError(f"{at}.better: expected higher or lower")
        for s in c.get("settings") or []:
            if s not in settings:
                raise ConfigError(f"{at}.settings: unknown setting {s!r}")
        out.append({**c, "against": against})
    return out


def _resolve_config(suite: Path, setting: str, given: Any) -> str:
    """A setting's config path: relative to the suite file's folder, else to the
    current directory (module docstring)."""
    if not isinstance(given, str) or not given:
        raise ConfigError(f"{suite}: settings.{setting}.config: missing")
    c = Path(given)
    tried = [c] if c.is_absolute() else [suite.parent / c, c]
    for cand in tried:
        if cand.is_file():
            return str(cand)
    raise ConfigError(f"{suite}: settings.{setting}.config: {given} not found (tried "
                      + ", ".join(str(t) for t in dict.fromkeys(tried)) + ")")


def _applies(suite: Suite, method: str, setting: str) -> bool:
    return method not in suite.method_settings or setting in suite.method_settings[method]


def validate_suite(suite: Suite) -> int:
    """Load and validate every method × setting config (``$TUNE`` replaced by each
    value of the method's grid) before anything runs; return how many were
    checked. Raises :class:`ConfigError`: one line naming the suite file, the
    method, the setting and the field."""
    from fedloom.config import load_config

    if suite.tuning is not None:
        return _validate_protocol(suite)
    for method, t in suite.tune.items():  # each tuning run's folder is one folder name
        for v in t["grid"]:
            _run_folder(suite, method, _tune_tag(v))
    n = 0
    for setting, st in suite.settings.items():
        for method, ov in suite.methods.items():
            if not _applies(suite, method, setting):
                continue
            values: list[Any] = [None]
            if any(TUNE in o for o in ov):
                src = suite.share_tuning.get(method, method)
                if src not in suite.tune:
                    raise ConfigError(f"{suite.path}: methods.{method}: uses {TUNE} but has "
                                      "no tune entry")
                values = list(suite.tune[src]["grid"])
            for v in values:
                ov2 = [o.replace(TUNE, str(v)) for o in ov] if v is not None else ov
                try:
                    load_config(st["config"], [*st.get("overrides", []), *ov2,
                                               f"seed={suite.seeds[0] if suite.seeds else 0}"])
                except ConfigError as e:
                    at = f" with {TUNE}={v}" if v is not None else ""
                    raise ConfigError(f"{suite.path}: methods.{method} (setting {setting}"
                                      f"{at}): {str(e).splitlines()[0]}") from None
                n += 1
    return n


def _check_points(suite: Suite, setting: str, method: str, points: list[dict[str, Any]],
                  extra: list[str] | None = None) -> int:
    from fedloom.config import load_config

    st = suite.settings[setting]
    for point in points:
        try:
            load_config(st["config"], [*st.get("overrides", []), *suite.methods[method],
                                       *overrides(point), *(extra or []),
                                       f"seed={suite.seeds[0] if suite.seeds else 0}"])
        except ConfigError as e:
            at = f" at {point_slug(point)}" if point else ""
            raise ConfigError(f"{suite.path}: methods.{method} (setting {setting}{at}): "
                              f"{str(e).splitlines()[0]}") from None
    return len(points)


def _validate_protocol(suite: Suite) -> int:
    """Every point a tuning or sensitivity run can take, loaded before anything runs; a
    grid smaller than the budget is refused (fedloom.tuning)."""
    proto = suite.tuning
    assert proto is not None
    n = 0
    for setting in suite.settings:
        tr = suite.settings[setting].get("tuning_rounds", proto.rounds)
        rounds = [f"rounds={tr}"] if tr else []
        for method in suite.methods:
            if not _applies(suite, method, setting):
                continue
            if suite.tuned(method):
                space = suite.space(setting, method)
                if proto.sampler == "grid":
                    pts = grid_points(space, proto.budget, proto.seed, setting, method)
                else:
                    # each range at both ends, each list value once (with the others' first)
                    pts = []
                    for k, v in space.items():
                        vals = [v.low, v.high] if isinstance(v, Range) else list(v)
                        base = {k2: (v2.low if isinstance(v2, Range) else v2[0])
                                for k2, v2 in space.items()}
                        pts += [{**base, k: x} for x in vals]
                n += _check_points(suite, setting, method, pts, rounds)
                for pt in pts:  # each trial's folder is one folder name
                    _run_folder(suite, method, f"@tune={point_slug(pt)}")
            else:
                n += _check_points(suite, setting, method, [{}])
            sens = proto.sensitivity
            if sens and _sensitive(suite, method):
                sens_pts = [{sens["key"]: v} for v in _sens_values(suite, setting, method)]
                n += _check_points(suite, setting, method, sens_pts)
                for pt in sens_pts:
                    _run_folder(suite, method, f"@sens={point_slug(pt)}")
    return n


def _sens_values(suite: Suite, setting: str, method: str) -> list[Any]:
    """The sensitivity key's values: as given, else its list in the method's space."""
    sens = suite.tuning.sensitivity if suite.tuning else None
    if not sens:
        return []
    if sens["values"] is not None:
        return list(sens["values"])
    dim = suite.space(setting, method).get(sens["key"])
    if not isinstance(dim, list):
        raise ConfigError(f"{suite.path}: tuning.sensitivity: {sens['key']} has no list of "
                          f"values in methods.{method}'s space (setting {setting}); give "
                          "values:")
    return list(dim)


def _sensitive(suite: Suite, method: str) -> bool:
    sens = suite.tuning.sensitivity if suite.tuning else None
    return bool(sens) and (sens.get("methods") is None or method in sens["methods"])


def drop_missing_data(suite: Suite, log: Callable[[str], None]) -> list[str]:
    """Settings whose data is not on this machine are left out, each with one line
    saying what is missing and where it was looked for; returns their names. All
    missing: :class:`ConfigError` (the CLI's exit 2), nothing run."""
    from fedloom.config import load_config
    from fedloom.data.sources import missing_source

    gone: list[str] = []
    first = ""
    for setting, st in list(suite.settings.items()):
        cfg = load_config(st["config"], st.get("overrides", []))
        why = missing_source(cfg.data)
        if why is not None:
            log(f"setting {setting}: skipped, its data is missing: {why}")
            first = first or why
            gone.append(setting)
            del suite.settings[setting]
    if gone and not suite.settings:
        raise ConfigError(f"{suite.path}: no setting's data is here ({first})")
    return gone


def _slug(text: str) -> str:
    """A method's folder name: its name with characters other than letters, digits and
    ``-_.`` as ``_`` (``SA-PEF (α=0.85)`` → ``SA-PEF__α_0.85_``)."""
    return encode_component(text)


def _tune_tag(value: Any) -> str:
    """``@tune=V`` of an old-style ``tune:`` value, encoded as :func:`point_slug` encodes
    a point's values (``0.5`` and ``1e-05`` stay as they are; ``/`` and a YAML tag's
    ``!`` do not)."""
    return "@tune=" + encode_component(str(value), keep="-_.=,")


def _run_folder(suite: Suite, method: str, tag: str = "") -> str:
    """The folder of a method's runs in a setting, checked as one folder name."""
    return path_component(_slug(method) + tag,
                          f"{suite.path}: methods: a run folder of {method!r}")


def _spec(suite: Suite, setting: str, method: str, seed: int, overrides: list[str],
          tag: str = "") -> RunSpec:
    """A run of the suite: ``OUT/SETTING/FOLDER/seedS``, every part of it one folder
    name (fedloom.names), so the run is always under ``out:``."""
    s = suite.settings[setting]
    out = (suite.out / path_component(setting, f"{suite.path}: settings")
           / _run_folder(suite, method, tag) / f"seed{seed}")
    return RunSpec(setting, method, seed, s["config"],
                   (*s.get("overrides", []), *overrides), out)


def _die_with_parent() -> None:
    """Linux: this process gets SIGTERM when the sweep that started it dies (killed,
    out of memory), so no orphaned worker goes on writing a run directory that a
    continued sweep is about to run again. Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):  # no prctl: the worker may outlive a killed sweep
        return
    if os.getppid() == 1:  # the parent was gone before the call took effect
        os._exit(1)


def _worker_init() -> None:
    """A sweep worker: one thread, and a root log handler so that ``cli.main``'s
    ``basicConfig`` binds no stream of an earlier run."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    _die_with_parent()
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger().addHandler(logging.NullHandler())


def _run_in_worker(cmd_module: str, argv: list[str]) -> tuple[int, str]:
    """``python -m <cmd_module> <argv>`` in this (long-lived) worker: its exit code and
    stderr, as the command line would give them (log lines included)."""
    import contextlib
    import importlib
    import io
    import logging

    # The command line by its module name, as `python -m fedloom.cli` names it for a
    # subprocess: a sweep runs commands; it does not build on the CLI's code.
    cli = importlib.import_module(cmd_module)
    err = io.StringIO()
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("fedloom: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(argv)
            except SystemExit as e:  # argparse's exits
                rc = e.code if isinstance(e.code, int) else 1
            except Exception as e:  # what would be a traceback: its last line
                print(f"{type(e).__name__}: {e}", file=err)
                rc = 1
    finally:
        root.removeHandler(handler)
    return rc, err.getvalue()


class _Launcher:
    """Runs ``python -m fedloom.cli …`` commands: in ``workers`` long-lived worker
    processes (spawned, one thread each, a fresh one after 20 runs), so each run
    does not pay Python's, torch's and the data libraries' start-up again — on a
    sweep of short runs that was half the time. A worker that dies (killed, out
    of memory) fails only the run it held; the runs after it go to a fresh
    ``python -m fedloom.cli`` subprocess each, as before. Results are the same as
    a subprocess's: every random stream is derived from the config
    (tests/test_tuning.py compares the two)."""

    def __init__(self, workers: int) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.pool: Any = ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_worker_init, max_tasks_per_child=20)
        self.broken = False

    def __call__(self, cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
        from concurrent.futures.process import BrokenProcessPool

        if not self.broken:
            try:
                # cmd is [python, "-m", module, *argv]: the same command, in a worker
                return self.pool.submit(_run_in_worker, cmd[2], list(cmd[3:])).result()
            except BrokenProcessPool:
                self.broken = True
                return 1, "a sweep worker process died during this run"
        return _launch_subprocess(cmd, env)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _launch_subprocess(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    return p.returncode, p.stderr


# How a sweep starts its runs: "worker" (long-lived worker processes) or "subprocess"
# (one fresh process per run: what tests that replace subprocess.run rely on).
RUNNER = "worker"


def _stale(spec: RunSpec) -> str | None:
    """What differs between a finished run's saved config and the one the suite asks of
    it (``key: saved → asked``), else None. A run directory is named by setting, method
    and seed, not by its tuned values: when a tuning choice or a method's overrides
    change, the old run must not stand in for the new one."""
    from fedloom.config import config_from_dict, config_to_dict, load_config, safe_load_bounded
    from fedloom.engine.setup import resolve_auto
    from fedloom.report.compare import _flatten

    try:
        # bounded: a run folder's file may be anyone's (an alias bomb, deep nesting)
        saved = safe_load_bounded((spec.out / "config.yaml").read_text(),
                                  str(spec.out / "config.yaml"))
        # resolved as a run resolves it (server.lr: auto, a method's buffer policy: FedBN)
        asked = config_to_dict(resolve_auto(load_config(spec.config, [*spec.overrides,
                                                                      f"seed={spec.seed}"])))
        saved = config_to_dict(config_from_dict(saved))
    except (OSError, yaml.YAMLError, ConfigError, ValueError, TypeError):
        return None  # unreadable: resuming or rerunning it reports the problem
    a, b = _flatten(saved), _flatten(asked)
    for key in sorted(set(a) | set(b)):
        if key.split(".")[0] in ("name", "logging", "checkpoint"):
            continue
        if b.get(key) == "auto":  # the run saved what auto resolved to (server.lr: 1.0)
            continue
        if a.get(key) != b.get(key):
            return f"{key}: {a.get(key)} → {b.get(key)}"
    return None


def _check_not_stale(specs: list[RunSpec]) -> None:
    """:class:`StaleRunsError` when a run of ``specs`` in ``out:`` holds another config:
    a finished one would stand in for the run asked, a stopped one could not resume."""
    stale = [(s, why) for s in specs if s.out.exists() and (why := _stale(s))]
    if stale:
        s, why = stale[0]
        done = sum(sp.done for sp, _ in stale)
        what = " and ".join([*([f"{done} finished"] if done else []),
                             *([f"{len(stale) - done} stopped"] if done < len(stale) else [])])
        raise StaleRunsError(f"{what} runs hold another config than the suite asks "
                             f"(first: {s.out}: {why}); remove them or give the suite its own "
                             "out:")


def _run_all(specs: list[RunSpec], workers: int, log: Callable[[str], None]) -> None:
    _check_not_stale(specs)
    todo = [s for s in specs if not s.done]
    if workers <= 0:  # report only: run nothing
        if todo:
            raise FileNotFoundError(f"{len(todo)} runs have not finished")
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    launcher: Any = _Launcher(workers) if RUNNER == "worker" and todo else _launch_subprocess

    def one(spec: RunSpec) -> None:
        if spec.out.exists() and not spec.done:
            # A run stopped mid-way: continue it from its checkpoint if it has one.
            cmd = [*spec.command(), "--resume"]
        else:
            cmd = spec.command()
        t0 = time.perf_counter()
        rc, stderr = launcher(cmd, env)
        if rc != 0:
            msg = (f"{spec.setting}/{spec.method}/seed{spec.seed} failed: "
                   f"{(stderr.strip().splitlines() or ['?'])[-1]}")
            failed.append(msg)  # the other runs go on; the report shows what finished
            log(msg)
            return
        log(f"done {spec.setting}/{spec.out.parent.name}/seed{spec.seed} "
            f"in {time.perf_counter() - t0:.0f} s")

    failed: list[str] = []
    log(f"{len(todo)} of {len(specs)} runs to do, {workers} at a time")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        try:
            for f in [pool.submit(one, s) for s in todo]:
                f.result()
        finally:
            # Closed while the threads that started the workers are alive: a worker gets
            # SIGTERM when the *thread* that spawned it ends (_die_with_parent's
            # PR_SET_PDEATHSIG), which would kill it before its clean exit and leave its
            # semaphores to the resource tracker's "leaked semaphore" warning.
            if isinstance(launcher, _Launcher):
                launcher.close()
    if failed:
        raise SweepError(f"{len(failed)} of {len(todo)} runs failed; first: {failed[0]}")


def read_summary(out: Path) -> dict[str, Any]:
    """A finished run's ``summary.json``; :class:`SweepError` (one line naming it)
    when it cannot be read or is not a JSON object."""
    path = out / "summary.json"
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    # ValueError: malformed JSON, or an integer past the int-parsing limit;
    # RecursionError: nesting deeper than the parser's stack
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SweepError(f"{path}: cannot be read ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise SweepError(f"{path}: holds a {type(obj).__name__}, not a run summary")
    return obj


def tuned_values(
    suite: Suite, workers: int, log: Callable[[str], None]
) -> dict[tuple[str, str], Any]:
    """Run the tuning grids; return {(setting, method): chosen value}."""
    specs: dict[tuple[str, str, Any], RunSpec] = {}
    def applies(method: str, setting: str) -> bool:
        return method not in suite.method_settings or setting in suite.method_settings[method]

    for setting in suite.settings:
        for method, t in suite.tune.items():
            if not applies(method, setting):
                continue
            for value in t["grid"]:
                ov = [o.replace(TUNE, str(value)) for o in suite.methods[method]]
                specs[(setting, method, value)] = _spec(suite, setting, method, suite.tune_seed,
                                                        ov, tag=_tune_tag(value))
    _run_all(list(specs.values()), workers, log)
    chosen: dict[tuple[str, str], Any] = {}
    for setting in suite.settings:
        for method, t in suite.tune.items():
            if not applies(method, setting):
                continue
            scores = {v: read_summary(specs[(setting, method, v)].out).get(suite.tune_metric,
                                                                            float("-inf"))
                      for v in t["grid"]}
            scores = {v: (s if s == s else float("-inf")) for v, s in scores.items()}  # NaN
            chosen[(setting, method)] = max(scores, key=lambda v: scores[v])
        for method, source in suite.share_tuning.items():
            if applies(method, setting) and (setting, source) in chosen:
                chosen[(setting, method)] = chosen[(setting, source)]
    return chosen


def _trial_specs(suite: Suite, setting: str, method: str, point: dict[str, Any]
                 ) -> list[RunSpec]:
    proto = suite.tuning
    assert proto is not None
    ov = [*suite.methods[method], *overrides(point)]
    rounds = suite.settings[setting].get("tuning_rounds", proto.rounds)
    if rounds:
        ov.append(f"rounds={rounds}")
    return [_spec(suite, setting, method, seed, ov, tag=f"@tune={point_slug(point)}")
            for seed in proto.seeds]


def _score(spec: RunSpec, metric: str) -> float:
    from fedloom.report.compare import load_run, metric_value

    if not spec.done:
        return math.nan
    return metric_value(load_run(spec.out), metric)


def tune_protocol(suite: Suite, workers: int, log: Callable[[str], None]
                  ) -> dict[tuple[str, str], dict[str, Any]]:
    """Run the tuning protocol (fedloom.tuning); return {(setting, method): chosen
    point} and keep every trial in ``suite.trials``. ``workers=0``: run nothing
    (:class:`FileNotFoundError` when a trial has not finished)."""
    from fedloom.report.compare import lower_is_better

    proto = suite.tuning
    assert proto is not None

    def metric_of(method: str) -> str:
        return suite.method_metric.get(method, proto.metric)

    pairs = [(s, m) for s in suite.settings for m in suite.methods
             if _applies(suite, m, s) and suite.tuned(m)]
    trials: dict[tuple[str, str], list[Trial]] = {pair: [] for pair in pairs}
    specs: dict[tuple[str, str, int], list[RunSpec]] = {}

    def record(step_pairs: list[tuple[str, str]], index: int) -> None:
        for pair in step_pairs:
            t = trials[pair][index]
            for spec in specs[(*pair, index)]:
                t.scores[spec.seed] = _score(spec, metric_of(pair[1]))

    if proto.sampler == "grid":
        for pair in pairs:
            for i, point in enumerate(grid_points(suite.space(*pair), proto.budget, proto.seed,
                                                  *pair)):
                trials[pair].append(Trial(i, point))
                specs[(*pair, i)] = _trial_specs(suite, *pair, point)
        _run_trials([sp for v in specs.values() for sp in v], workers, log)
        for i in range(proto.budget):
            record(pairs, i)
    else:
        # TPE: trial i of every (setting, method) from its trials 0 … i−1, one step at a time
        for i in range(proto.budget):
            for pair in pairs:
                point = tpe_point(suite.space(*pair), trials[pair], i, proto.seed, *pair,
                                  lower=lower_is_better(metric_of(pair[1])),
                                  startup=proto.startup)
                trials[pair].append(Trial(i, point))
                specs[(*pair, i)] = _trial_specs(suite, *pair, point)
            _run_trials([sp for pair in pairs for sp in specs[(*pair, i)]], workers, log)
            record(pairs, i)
    suite.trials = trials
    chosen = {pair: dict(best_trial(ts, lower_is_better(metric_of(pair[1]))).params)
              for pair, ts in trials.items()}
    for method, source in suite.share_tuning.items():
        for setting in suite.settings:
            if _applies(suite, method, setting) and (setting, source) in chosen:
                own = {o.split("=", 1)[0] for o in suite.methods[method]}
                # a method's own overrides win over the values it borrows
                chosen[(setting, method)] = {k: v for k, v in chosen[(setting, source)].items()
                                             if k not in own}
    _write_tuning_record(suite, chosen)
    return chosen


def _run_trials(specs: list[RunSpec], workers: int, log: Callable[[str], None]) -> None:
    """Tuning runs: one that fails scores worst (NaN) and the tuning goes on. Trials
    in ``out:`` that hold another config stop the sweep (:class:`StaleRunsError`), as
    main runs do: a stale trial must not be scored, nor chosen."""
    try:
        _run_all(specs, workers, log)
    except StaleRunsError:
        raise
    except SweepError as e:
        log(f"tuning: {e} (those trials score worst)")


def _write_tuning_record(suite: Suite, chosen: dict[tuple[str, str], dict[str, Any]]) -> None:
    """``OUT/NAME.tuning.json``: the protocol, every trial with its per-seed scores, the
    choice (named by the suite: suites may share ``out:`` and so reuse runs)."""
    proto = suite.tuning
    assert proto is not None
    rec: dict[str, Any] = {
        "budget": proto.budget, "sampler": proto.sampler, "seeds": proto.seeds,
        "metric": proto.metric, "method_metric": dict(suite.method_metric),
        "rounds": proto.rounds, "settings": {}}
    for (setting, method), ts in suite.trials.items():
        rec["settings"].setdefault(setting, {})[method] = {
            "chosen": chosen[(setting, method)],
            "trials": [{"index": t.index, "params": t.params,
                        "scores": {str(k): v for k, v in t.scores.items()},
                        "score": t.score} for t in ts]}
    suite.out.mkdir(parents=True, exist_ok=True)
    tmp = suite.out / f"{suite.name}.tuning.json.tmp"
    tmp.write_text(json.dumps(rec, indent=1, default=str))
    os.replace(tmp, suite.out / f"{suite.name}.tuning.json")


def sensitivity_specs(suite: Suite, chosen: dict[tuple[str, str], Any]
                      ) -> dict[tuple[str, str], list[tuple[Any, list[RunSpec]]]]:
    """The sensitivity runs (fedloom.tuning): per (setting, method), per value of the
    key, the reported seeds with the other keys at their chosen values. A value equal
    to the chosen one is the main run itself."""
    proto = suite.tuning
    if proto is None or not proto.sensitivity:
        return {}
    key = proto.sensitivity["key"]
    out: dict[tuple[str, str], list[tuple[Any, list[RunSpec]]]] = {}
    for setting in suite.settings:
        for method in suite.methods:
            if not (_applies(suite, method, setting) and _sensitive(suite, method)):
                continue
            point = dict(chosen.get((setting, method), {}))
            rows = []
            for v in _sens_values(suite, setting, method):
                if key in point and point[key] == v:
                    tag, pov = "", _point_overrides(suite, method, point)
                else:
                    tag = f"@sens={point_slug({key: v})}"
                    pov = [*_point_overrides(suite, method, point), *overrides({key: v})]
                rows.append((v, [_spec(suite, setting, method, seed, pov, tag=tag)
                                 for seed in suite.seeds]))
            out[(setting, method)] = rows
    return out


def _point_overrides(suite: Suite, method: str, point: dict[str, Any]) -> list[str]:
    """A method's overrides with its chosen point: after its own (tuned), or before
    them (borrowed by share_tuning: its own values win)."""
    if method in suite.share_tuning:
        return [*overrides(point), *suite.methods[method]]
    return [*suite.methods[method], *overrides(point)]


def _tune(suite: Suite, workers: int, log: Callable[[str], None]) -> dict[tuple[str, str], Any]:
    if suite.tuning is not None:
        return tune_protocol(suite, workers, log)
    return tuned_values(suite, workers, log)


def main_specs(suite: Suite, chosen: dict[tuple[str, str], Any]) -> list[RunSpec]:
    specs = []
    for setting in suite.settings:
        for method, ov in suite.methods.items():
            if method in suite.method_settings and setting not in suite.method_settings[method]:
                continue
            value = chosen.get((setting, method))
            if suite.tuning is not None:
                pov = _point_overrides(suite, method, dict(value or {}))
                specs += [_spec(suite, setting, method, seed, pov) for seed in suite.seeds]
                continue
            if any(TUNE in o for o in ov) and value is None:
                raise ConfigError(f"methods.{method}: uses {TUNE} but has no tune entry")
            ov2 = [o.replace(TUNE, str(value)) for o in ov]
            for seed in suite.seeds:
                specs.append(_spec(suite, setting, method, seed, ov2))
    return specs


def _state_file(suite: Suite) -> Path:
    """``OUT/NAME.sweep.json`` (the sweep's wall time over its invocations); a sweep
    written before suites named theirs kept ``OUT/sweep.json``."""
    named = suite.out / f"{suite.name}.sweep.json"
    legacy = suite.out / "sweep.json"
    return named if named.exists() or not legacy.exists() else legacy


SWEEP_LOCK = ".fedloom-sweep.lock"


def _lock_out(out: Path) -> int:
    """Create ``out`` if needed and take an exclusive ``flock`` on
    ``OUT/.fedloom-sweep.lock`` (as :func:`fedloom.engine.checkpoint.lock_run_dir`
    locks a run directory); return its descriptor, to close when the sweep ends. The
    kernel drops the lock when the process ends in any way (``SIGKILL`` included), so
    a killed sweep leaves no stale lock. Another sweep holding it:
    :class:`SweepFolderError` naming its pid, and nothing in ``out`` is touched but
    the lock file."""
    import fcntl

    try:
        out.mkdir(parents=True, exist_ok=True)
        fd = os.open(out / SWEEP_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise SweepFolderError(f"out: {out}: cannot use it as a sweep's folder "
                               f"({e.strerror or type(e).__name__})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        finally:
            os.close(fd)
        raise SweepFolderError(f"out: {out}: in use by another fedloom sweep (pid {holder}); "
                               "wait for it to end or give this suite its own out:") from None
    except OSError as e:  # e.g. a file system without locks
        os.close(fd)
        raise SweepFolderError(f"out: {out}: cannot lock it "
                               f"({e.strerror or type(e).__name__})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def run_suite(path: str | Path, workers: int = 2, log: Callable[[str], None] = print,
              report_only: bool = False, csv: str | Path | None = None) -> Suite:
    """Run (or continue) a suite, then make its report (``report_only``: from the runs
    that have finished, running nothing); ``suite.report_text`` holds it, and
    ``doc:`` gets it when the suite names one. ``csv``: the results tables as CSV.

    A sweep that runs holds ``out:`` for its whole life (:func:`_lock_out`): a second
    sweep on the same folder is refused (:class:`SweepFolderError`) before it writes
    anything, so runs of two suites never mix. ``report_only`` reads and takes no lock (a page of
    the runs finished so far, while the sweep goes on). Runs in ``out:`` that hold
    another config than the suite asks stop the sweep before anything runs
    (:class:`StaleRunsError`), and no page is made from them."""
    suite = load_suite(path)
    if report_only:
        return _report_only(suite, workers, log, csv)
    validate_suite(suite)  # every config, before the first run starts
    drop_missing_data(suite, log)
    fd = _lock_out(suite.out)
    try:
        return _run_locked(suite, workers, log, csv)
    finally:
        os.close(fd)  # the lock ends with it


def _report_only(suite: Suite, workers: int, log: Callable[[str], None],
                 csv: str | Path | None) -> Suite:
    from fedloom.report.sweep import write_report

    state = _state_file(suite)
    prior = json.loads(state.read_text()) if state.exists() else {}
    try:
        chosen = _tune(suite, 0, log)
    except (FileNotFoundError, ValueError):
        chosen = {}
    specs = main_specs(suite, chosen) if chosen or not (suite.tune or suite.tuning) else []
    suite.sensitivity_specs = sensitivity_specs(suite, chosen) if specs else {}
    suite.report_text = write_report(suite, chosen, specs, float(prior.get("elapsed_s", 0.0)),
                                     workers, csv)
    return suite


def _run_locked(suite: Suite, workers: int, log: Callable[[str], None],
                csv: str | Path | None) -> Suite:
    from fedloom.report.sweep import write_report

    t0 = time.perf_counter()
    try:
        chosen = _tune(suite, workers, log)
    except SweepError as e:  # no tuned value, no main runs: nothing to report
        e.suite = suite
        raise
    specs = main_specs(suite, chosen)
    suite.sensitivity_specs = sensitivity_specs(suite, chosen)
    extra = [sp for rows in suite.sensitivity_specs.values() for _, sps in rows for sp in sps
             if sp.out not in {m.out for m in specs}]
    failure: SweepError | None = None
    try:
        _run_all([*specs, *dict.fromkeys(extra)], workers, log)
    except StaleRunsError as e:  # no page made of runs of another config
        e.suite = suite
        raise
    except SweepError as e:
        failure = e  # still report the runs that finished ("Incomplete" counts the rest)
    elapsed = time.perf_counter() - t0
    state = _state_file(suite)
    prior = json.loads(state.read_text()) if state.exists() else {}
    state = suite.out / f"{suite.name}.sweep.json"
    # Wall time of the whole sweep: the sum over continued invocations.
    total = float(prior.get("elapsed_s", 0.0)) + elapsed
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"elapsed_s": total, "workers": workers}, indent=2))
    suite.report_text = write_report(suite, chosen, specs, total, workers, csv)
    if failure is not None:
        failure.suite = suite
        raise failure
    return suite


def dump_yaml(obj: Any) -> str:
    return yaml.safe_dump(obj, sort_keys=False)
