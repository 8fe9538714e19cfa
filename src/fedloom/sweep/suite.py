"""The suite file, loaded and checked into a :class:`Suite`, and the runs it names.

:func:`load_suite` reads the YAML (bounded: :func:`fedloom.config.yaml_load`),
checks every key and every name that becomes part of a path
(:func:`fedloom.names.path_component`), and resolves each setting's config
(relative to the suite file's folder, then to the current directory). A
:class:`RunSpec` is one run, ``OUT/SETTING/METHOD[@tag]/seedS`` (:func:`_spec`).
The errors of a sweep are here too: :class:`SweepError`, :class:`StaleRunsError`
and :class:`SweepFolderError`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedloom.config import ConfigError
from fedloom.config.loading import read_yaml_file
from fedloom.names import encode_component, path_component
from fedloom.tuning import (
    Protocol,
    Space,
    Trial,
    load_protocol,
    merge_space,
    parse_space,
)

TUNE = "$TUNE"
# The sweep's lock file in out: (fedloom.sweep.driver)
SWEEP_LOCK = ".fedloom-sweep.lock"


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


@dataclass(frozen=True)
class Sequential:
    """``seeds: {min, max, batch}``: the sequential protocol (:mod:`fedloom.sweep.sequential`).
    Seeds are 1 … ``max`` in order; every (setting, method) runs the first ``min``, and
    a pair of methods whose claim cells are still open gets ``batch`` more, up to ``max``."""

    min: int
    max: int
    batch: int


@dataclass(frozen=True)
class SuiteTuning:
    """How the suite's methods are tuned: the protocol (``tuning:``) or its one-key
    predecessor (``tune:`` with ``tune_seed:`` and ``tune_metric:``), the methods that
    take another's choice (``share_tuning:``), and each method's own ``space:``,
    ``tune: false`` and ``metric:``."""

    # The tuning protocol (fedloom.tuning); None for a suite without ``tuning:``.
    protocol: Protocol | None = None
    grids: dict[str, dict[str, Any]] = field(default_factory=dict)  # tune: {method: {key, grid}}
    grid_seed: int = 0                                  # tune_seed: the seed tune: runs on
    grid_metric: str = "client_acc_mean"                # tune_metric: what tune: picks by
    shared: dict[str, str] = field(default_factory=dict)  # share_tuning: {method: source}
    method_space: dict[str, Space] = field(default_factory=dict)
    untuned: set[str] = field(default_factory=set)   # methods with ``tune: false``
    # a method's own selection metric (``methods.M.metric``; personal models are chosen
    # on ``personal_acc_mean``), else the protocol's
    method_metric: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SuiteReport:
    """What the suite's page is made of and where it goes: ``doc:`` (None: the report
    is printed), the ``report:`` options and the ``claims:``."""

    doc: Path | None = None
    options: dict[str, Any] = field(default_factory=dict)
    claims: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Suite:
    name: str
    out: Path
    seeds: list[int]
    settings: dict[str, dict[str, Any]]
    methods: dict[str, list[str]]
    tuning: SuiteTuning = field(default_factory=SuiteTuning)
    report: SuiteReport = field(default_factory=SuiteReport)
    path: Path | None = None
    method_settings: dict[str, list[str]] = field(default_factory=dict)
    report_text: str = ""  # the last report made (printed by the CLI when doc is None)
    # ``seeds: {min, max, batch}`` (then ``seeds`` is 1 … max); None for a list of seeds
    sequential: Sequential | None = None
    # Filled by run_suite: each (setting, method)'s trials, and its sensitivity runs
    # {(setting, method): [(value, [RunSpec per seed])]}.
    trials: dict[tuple[str, str], list[Trial]] = field(default_factory=dict)
    trial_specs: list[RunSpec] = field(default_factory=list)  # every tuning run asked for
    sensitivity_specs: dict[tuple[str, str], list[tuple[Any, list[RunSpec]]]] = field(
        default_factory=dict)
    # Filled as runs end: the line of each run that resumed from prev.pt because its
    # last.pt was refused (printed, and kept in OUT/NAME.sweep.json)
    fallbacks: list[str] = field(default_factory=list)

    def space(self, setting: str, method: str) -> Space:
        """The method's space in a setting: the suite's, the setting's, the method's."""
        assert self.tuning.protocol is not None
        return merge_space(self.tuning.protocol.space,
                           self.settings[setting].get("_space", {}),
                           self.tuning.method_space.get(method, {}))

    def tuned(self, method: str) -> bool:
        """Whether the protocol tunes ``method`` itself (not shared, not ``tune: false``)."""
        return (self.tuning.protocol is not None and method not in self.tuning.untuned
                and method not in self.tuning.shared)


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
    """The suite file at ``path``, every key and name checked (module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: suite file not found")
    raw = read_yaml_file(p, "suite") or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: a suite file holds a mapping of settings")
    _check_keys(p, raw)
    _check_names(p, raw)
    _check_tune(p, raw)
    sequential = _load_seeds(p, raw["seeds"])
    seeds = (list(range(1, sequential.max + 1)) if sequential is not None
             else [int(s) for s in raw["seeds"]])
    protocol = (load_protocol(raw["tuning"], f"{p}: tuning", seeds)
                if raw.get("tuning") is not None else None)
    _check_share_tuning(p, raw, protocol)
    settings = _load_settings(p, raw, protocol)
    methods, only, spaces, untuned, method_metric = _load_methods(p, raw, protocol)
    claims = _load_claims(p, raw.get("claims"), methods, settings)
    if sequential is not None and not claims:
        raise ConfigError(f"{p}: seeds: {{min, max, batch}} needs claims: (their cells decide "
                          "which methods get more seeds)")
    report = SuiteReport(doc=Path(raw["doc"]) if raw.get("doc") else None,
                         options=raw.get("report", {}) or {},
                         claims=_claims_on(p, raw.get("report"), claims))
    tuning = SuiteTuning(
        protocol=protocol, grids=raw.get("tune", {}) or {},
        shared=raw.get("share_tuning", {}) or {}, grid_seed=int(raw.get("tune_seed", 0)),
        grid_metric=raw.get("tune_metric", "client_acc_mean"), method_space=spaces,
        untuned=untuned, method_metric=method_metric)
    return Suite(
        name=_suite_name(raw), out=Path(raw.get("out", f"runs/{_suite_name(raw)}")),
        seeds=seeds, sequential=sequential, settings=settings, methods=methods,
        method_settings=only, tuning=tuning, report=report, path=p,
    )


def _check_keys(p: Path, raw: dict[str, Any]) -> None:
    """No key the suite file does not know; the four it needs are there."""
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


def _check_tune(p: Path, raw: dict[str, Any]) -> None:
    """``tune:``: an entry per method of the suite with ``key:`` and a non-empty
    ``grid:``, and never beside ``tuning:``."""
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


def _check_share_tuning(p: Path, raw: dict[str, Any], protocol: Protocol | None) -> None:
    """``share_tuning:``: each method takes the choice of a method that is tuned."""
    for m, src in (raw.get("share_tuning") or {}).items():
        if m not in raw["methods"]:
            raise ConfigError(f"{p}: share_tuning.{m}: not a method of this suite")
        if protocol is not None:
            if src not in raw["methods"] or src in (raw.get("share_tuning") or {}):
                raise ConfigError(f"{p}: share_tuning.{m}: {src!r} is not a tuned method")
        elif src not in (raw.get("tune") or {}):
            raise ConfigError(f"{p}: share_tuning.{m}: {src!r} has no tune entry")


def _load_settings(p: Path, raw: dict[str, Any],
                   protocol: Protocol | None) -> dict[str, dict[str, Any]]:
    """``settings:``, each with its config resolved and its ``space:`` parsed."""
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
    return settings


def _load_methods(
    p: Path, raw: dict[str, Any], protocol: Protocol | None,
) -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, Space], set[str],
           dict[str, str]]:
    """``methods:``: each method's overrides, the settings it is limited to, its own
    ``space:``, whether it is ``tune: false``, and its ``metric:``."""
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
    return methods, only, spaces, untuned, method_metric


def _load_seeds(p: Path, raw: Any) -> Sequential | None:
    """``seeds:``: a list (the fixed protocol: None) or ``{min, max, batch}``."""
    if isinstance(raw, list):
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: seeds: needs a list of seeds or {{min, max, batch}}")
    extra = set(raw) - {"min", "max", "batch"}
    if extra:
        raise ConfigError(f"{p}: seeds.{sorted(extra, key=str)[0]}: unknown key (expected "
                          "min, max, batch)")
    vals = {}
    for key in ("min", "max", "batch"):
        v = raw.get(key)
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ConfigError(f"{p}: seeds.{key}: needs a whole number ≥ 1")
        vals[key] = v
    if vals["min"] < 2:
        raise ConfigError(f"{p}: seeds.min: needs at least 2 (an interval needs two pairs)")
    if vals["max"] < vals["min"]:
        raise ConfigError(f"{p}: seeds.max: {vals['max']} is below min: {vals['min']}")
    return Sequential(vals["min"], vals["max"], vals["batch"])


def _suite_name(raw: dict[str, Any]) -> str:
    # a number is a name too (name: 2024)
    name = raw["name"]
    return str(name) if isinstance(name, int) and not isinstance(name, bool) else name


def _check_names(p: Path, raw: dict[str, Any]) -> None:
    """Every name of the suite that becomes part of a path is one file or folder name
    (fedloom.names): the suite's (``OUT/NAME.sweep.json``, the page's plots), each
    setting's (``OUT/SETTING``, never a name of the sweep's own files there:
    :func:`_reserved_names`), each method's folder (``OUT/SETTING/METHOD``, its name
    encoded; two methods never share one) and each ``report.across`` panel's (its
    plot). :class:`ConfigError` naming the field otherwise, before anything is
    written."""
    path_component(_suite_name(raw), f"{p}: name")
    if "out" in raw and not (isinstance(raw["out"], str) and raw["out"]):
        raise ConfigError(f"{p}: out: needs a folder path")
    if not isinstance(raw["settings"], dict) or not isinstance(raw["methods"], dict):
        what = "settings" if not isinstance(raw["settings"], dict) else "methods"
        raise ConfigError(f"{p}: {what}: needs a mapping of names")
    reserved = _reserved_names(raw)
    for setting in raw["settings"]:
        path_component(setting, f"{p}: settings")
        if setting in reserved:
            out = Path(raw.get("out", f"runs/{_suite_name(raw)}"))
            raise ConfigError(f"{p}: settings: {setting!r} is reserved: {out / setting} is "
                              f"{reserved[setting]} (rename the setting)")
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


def _reserved_names(raw: dict[str, Any]) -> dict[str, str]:
    """The names the sweep's own files take in ``out:``, each with what it is: a
    setting's folder ``OUT/SETTING`` must not be one of them (the sweep would write
    its file onto the folder, or the runs into its file). Method folders are a level
    deeper (``OUT/SETTING/METHOD``), where the sweep writes nothing else. When the
    page goes into ``out:`` too, its name and its figures' (``NAME-….png``)."""
    name = _suite_name(raw)
    names = {f"{name}.sweep.json": "the sweep's state file",
             "sweep.json": "the state file of a sweep from before suites had names",
             f"{name}.tuning.json": "the sweep's tuning record",
             SWEEP_LOCK: "the sweep's lock file"}
    doc, out = raw.get("doc"), raw.get("out", f"runs/{name}")
    if isinstance(doc, str) and doc and isinstance(out, str) and (
            Path(doc).resolve().parent == Path(out).resolve()):
        names[Path(doc).name] = "the sweep's page (doc:)"
        figures = [s for s in raw["settings"] if isinstance(s, str)
                   and s.startswith(f"{name}-") and s.lower().endswith(".png")]
        names.update(dict.fromkeys(figures, "the name of one of the page's figures (doc:)"))
    return names


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
        if not isinstance(c["metric"], str) or not c["metric"]:
            raise ConfigError(f"{at}.metric: needs a metric name")
        better = c.get("better")
        if better is not None and better not in ("higher", "lower"):
            raise ConfigError(f"{at}.better: expected higher or lower")
        # a claim judged in the wrong direction turns every verdict over (a higher loss
        # read as "better"), so the direction a metric's name states is taken when none
        # is given, and a direction that contradicts it is refused
        from fedloom.report.claims import claim_direction

        known = claim_direction(c["metric"])
        if better is None and known is None:
            raise ConfigError(f"{at}.better: missing (the name {c['metric']!r} does not "
                              "say whether higher or lower is better)")
        if better is not None and known is not None and better != known:
            raise ConfigError(f"{at}.better: {better}, but {c['metric']} improves when it "
                              f"is {known}")
        c = {**c, "better": better or known}
        for s in c.get("settings") or []:
            if s not in settings:
                raise ConfigError(f"{at}.settings: unknown setting {s!r}")
        out.append({**c, "against": against})
    return out


def _claims_on(p: Path, report: Any, claims: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``report.claims_on``: ``final`` (the default: each claim on its metric's last
    value) or ``window`` (on ``METRIC_window``, its mean over the runs' evaluation
    window, ``eval.window``; fedloom.report.compare.window_stats)."""
    on = report.get("claims_on", "final") if isinstance(report, dict) else "final"
    if on not in ("final", "window"):
        raise ConfigError(f"{p}: report.claims_on: {on!r} (expected final or window)")
    if on == "final":
        return claims
    return [{**c, "metric": c["metric"] if c["metric"].endswith("_window")
             else f"{c['metric']}_window"} for c in claims]


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


def dump_yaml(obj: Any) -> str:
    return yaml.safe_dump(obj, sort_keys=False)
