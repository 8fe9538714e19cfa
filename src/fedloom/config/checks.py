"""From a mapping to a :class:`~fedloom.config.Config`, checked field by field,
then across fields.

:func:`config_from_dict` builds the dataclasses section by section: an unknown
key, a wrong type or an out-of-range value is one :class:`ConfigError` line
naming the dotted field. Then the checks that one field cannot make alone: names
that must be registered (:func:`check_name`) or objects recorded by import path
that must rebuild (:mod:`fedloom.recorded`), the system section
(:func:`check_system_config`), the partitioner's keys, the cohort against the
clients, the schedule's warm-up against the rounds.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from fedloom import recorded, registry
from fedloom.config.sections import (
    MAX_COUNT,
    SHORTHAND_SECTIONS,
    Config,
    ConfigError,
    PartitionConfig,
    SystemConfig,
)
from fedloom.config.translate import translate


def did_you_mean(given: str, choices: Iterable[str]) -> str:
    """``"did you mean X? "`` (or ``X or Y``) naming the choices closest to ``given``
    by :func:`difflib.get_close_matches` (ratio ≥ 0.6: one or two letters off in a
    name of six), else ``""``; it leads the parenthesis that lists every choice."""
    close = difflib.get_close_matches(str(given), list(choices), n=2, cutoff=0.6)
    return f"did you mean {' or '.join(close)}? " if close else ""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, Sequence):
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{path}: must be {_type_name(tp)}, got {_shown(value)}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _convert(value, arg, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: must be {_type_name(tp)}, got {_shown(value)}")
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{path}: must be null, got {_shown(value)}")
        return None
    if origin in (list, Sequence):  # Sequence: a factory's option (a list here)
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: must be {_type_name(tp)}, got {_shown(value)}")
        (inner,) = typing.get_args(tp)
        return [_convert(v, inner, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: must be a mapping, got {_shown(value)}")
        return {str(k): v for k, v in value.items()}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a section's class
        if isinstance(value, str) and path in SHORTHAND_SECTIONS:
            value = {"name": value}  # `feedback: sapef` is short for {name: sapef}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: must be a mapping, got {_shown(value)}")
        return _build(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: must be true or false, got {_shown(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: must be an integer, got {_shown(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: must be a number, got {_shown(value)}")
        try:
            value = float(value)
        except OverflowError:  # an int beyond float's range (10**309): not finite either
            raise ConfigError(f"{path}: must be finite, got {_shown(value)}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(f"{path}: must be finite, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: must be a string, got {_shown(value)}")
        return value
    if tp is Any:
        return value
    raise TypeError(f"config schema: unsupported type {tp!r} at {path}")  # pragma: no cover


def _digits(n: int) -> int:
    """The decimal digits of ``n``, without ``str(n)`` (which raises past Python's
    int-to-str limit, 4300 digits)."""
    n = abs(n)
    if n < 10:
        return 1
    d = int(math.log10(n)) + 1
    if 10 ** (d - 1) > n:  # log10's rounding, near a power of ten
        return d - 1
    return d + 1 if 10**d <= n else d


def _shown(v: Any) -> str:
    """``repr(v)`` for a message; an integer of more than 30 digits by its length (a
    message stays one short line, and repr raises past Python's int-to-str limit)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**30:
        return f"an integer of {_digits(v)} digits"
    return repr(v)


def field_bounds(f: dataclasses.Field[Any], tp: Any) -> dict[str, float]:
    """The bounds loading checks ``f`` (of type ``tp``) against, and the schema states:
    its own (``_f(default, ge=…)``), plus ``le=MAX_COUNT`` for a field that holds
    integers (``int``, ``int | None``, ``list[int]``) without an upper bound of its
    own, unless it is marked ``unbounded`` (``seed``)."""
    bounds = dict(f.metadata.get("bounds", {}))
    if not f.metadata.get("unbounded") and _holds_int(tp) and not {"le", "lt"} & set(bounds):
        bounds["le"] = MAX_COUNT
    return bounds


def _holds_int(tp: Any) -> bool:
    if tp is int:
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType, list):
        return any(_holds_int(a) for a in typing.get_args(tp))
    return False


def _check_bounds(value: Any, bounds: Mapping[str, float], path: str) -> None:
    if value is None or isinstance(value, str):  # a keyword ("auto") has no bounds
        return
    values = value if isinstance(value, list) else [value]
    for v in values:
        for op, b in bounds.items():
            ok = {"ge": v >= b, "gt": v > b, "le": v <= b, "lt": v < b}[op]
            if not ok:
                sym = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}[op]
                why = " (the bound of every count: fedloom.config.MAX_COUNT)" if (
                    op == "le" and b == MAX_COUNT) else ""
                shown = str(b) if isinstance(b, int) else f"{b:g}"
                raise ConfigError(f"{path}: must be {sym} {shown}{why}, got {_shown(v)}")


def _build(cls: type, data: Mapping[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"{where}: unknown key ({did_you_mean(key, fields)}"
                              f"expected one of: {', '.join(sorted(fields))})")
    kwargs = {}
    for name, f in fields.items():
        where = f"{path}.{name}" if path else name
        if name in data:
            value = _convert(data[name], hints[name], where)
            _check_bounds(value, field_bounds(f, hints[name]), where)
            kwargs[name] = value
    return cls(**kwargs)


def config_from_dict(data: Mapping[str, Any], plugins: bool = True) -> Config:
    """Validate a plain mapping into a :class:`Config` (raises :class:`ConfigError`).

    ``plugins=False`` reads it as data (a run folder's saved config, read by
    ``fedloom compare`` or a sweep's report): a plug-in's name is not imported
    (:func:`fedloom.registry.no_imports`), so it and its options stay as written,
    unchecked; every other check is made. Only what runs a config imports the code
    it names: reading someone's results must not run their code."""
    if not plugins:
        with registry.no_imports():
            return config_from_dict(data)
    if not isinstance(data, Mapping):
        raise ConfigError(f"config: must be a mapping at the top level, got {type(data).__name__}")
    # A config written the old way is rewritten first (fedloom.config.translate).
    cfg: Config = _build(Config, translate(data), "")
    _check_cross_fields(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def check_name(field: str, kind: str, name: str) -> None:
    """Raise a one-line ``ConfigError`` naming ``field`` if ``name`` is neither
    registered, nor an installed entry point, nor an importable ``module:attr``."""
    try:
        registry.get(kind, name)
    except registry.NotImported:
        return  # read as data (config_from_dict's plugins=False): the name as text
    except KeyError as e:
        msg = e.args[0] if e.args else str(e)
        if msg.startswith("unknown "):
            known = registry.available(kind)
            msg = (f"unknown {kind} {name!r} ({did_you_mean(name, known)}available: "
                   f"{', '.join(known)})")
        raise ConfigError(f"{field}: {msg}") from None


@dataclasses.dataclass
class _Named:
    """A ``{name, options}`` entry of a list (client.transforms) as a section."""

    name: str
    options: dict[str, Any]


def check_component(field: str, kind: str, section: Any) -> None:
    """:func:`check_name` of ``section.name`` (config field ``field``), or, for an
    object recorded by import path and options, its rebuild: the record made whole
    (every option the object holds), or one ``ConfigError`` line saying why it does
    not rebuild. Read as data (``no_imports``), a record stays as written."""
    if not recorded.is_object(section.name):
        check_name(f"{field}.name", kind, section.name)
        return
    if not registry.importing():
        return
    try:
        obj = recorded.rebuild(section.name, dict(section.options), field)
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    section.options = recorded.record(obj)


# Arguments the engine passes a factory itself, with why they are not options.
_CONTEXT = {
    "layout": "fedloom passes the model's layout",
    "lr": "the step size is server.lr, beside the optimizer: every comparison tunes it",
    "labels": "fedloom passes the data's labels",
    "num_clients": "data.num_clients",
    "rng": "fedloom passes the run's partition generator",
    "groups": "fedloom passes the source's client ids",
    "in_shape": "fedloom passes the data's input shape",
    "threads": "backend.threads, a key of its own: it holds for the whole run",
    "keep_heap": "backend.keep_heap, a key of its own: it holds for the whole run",
    "num_classes": "fedloom passes the data's number of classes",
    "data": "fedloom passes the data section itself (name, num_clients, min_samples, ...)",
    "seed": "the run's seed, a key of its own",
}
# What a backend's factory is called with besides its options (fedloom.engine.binding).
_BACKEND_CONTEXT = frozenset({"trainer", "method", "x", "y", "threads", "keep_heap"})
# What a model's factory is called with besides its options (fedloom.models.build_model).
_MODEL_CONTEXT = frozenset({"in_shape", "num_classes"})
# What a dataset's loader is called with besides its options (fedloom.data.sources).
_DATA_CONTEXT = frozenset({"data", "seed"})


def check_data_loader(name: str, loader: Any) -> None:
    """Refuse, in one line, a dataset loader written the old way, ``(cfg, seed)`` (its
    keys read from the data section): loaders take ``(data, seed, **options)`` since a
    source's own keys became ``data.options``."""
    import inspect

    try:
        params = list(inspect.signature(loader).parameters.values())
    except (TypeError, ValueError):
        return
    first = params[0] if params else None
    if first is not None and first.name in ("cfg", "config"):
        raise ConfigError(f"data.name: {name!r} is a loader of the old signature "
                          f"({first.name}, seed); write it as (data, seed, **options): data "
                          "is the data section, its keyword arguments data.options")


def check_model_factory(name: str, factory: Any) -> None:
    """Refuse, in one line, a model factory written the old way, ``(cfg, in_shape,
    num_classes)`` (the whole model section as its first argument): factories take
    ``(in_shape, num_classes, **options)`` since the model's keys became its options."""
    import inspect

    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return
    first = params[0] if params else None
    if first is not None and (first.name in ("cfg", "config") or "ModelConfig" in str(
            first.annotation)):
        raise ConfigError(f"model.name: {name!r} is a factory of the old signature "
                          f"({first.name}, in_shape, num_classes); write it as "
                          "(in_shape, num_classes, **options): its keyword arguments are "
                          "model.options")


def _same(value: Any, default: Any) -> bool:
    if isinstance(value, bool) != isinstance(default, bool):
        return False
    if isinstance(value, list) and isinstance(default, tuple):  # `counts: [] ` and `= ()`
        default = list(default)
    try:
        return bool(value == default)
    except Exception:  # a value whose == is not a truth value (an array)
        return False


def check_options(path: str, kind: str, section: Any, context: frozenset[str] = frozenset()
                  ) -> None:
    """Check ``section.options`` (a ``{name, options}`` section at ``path``) against the
    signature of ``section.name``'s factory, its schema: an option it does not take is
    refused (unless it takes ``**kwargs``), each annotated one is converted to its type
    and checked against its :class:`~fedloom.registry.Range` (one :class:`ConfigError`
    line naming ``PATH.options.KEY``), and one equal to the factory's default is left
    out, so a config that gives an option at its default equals one that leaves it out.
    ``context``: the arguments fedloom passes the factory itself (``layout``)."""
    import inspect

    if recorded.is_object(section.name):
        return  # an object's recorded options are its constructor's (check_component)
    try:
        factory = registry.get(kind, section.name)
    except registry.NotImported:
        return  # read as data: a plug-in's options stay as written, unchecked
    params = inspect.signature(factory).parameters
    anything = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    names = {k for k, p in params.items() if k != "self" and p.kind in (
        inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)} - context
    types = registry.option_types(factory)
    out: dict[str, Any] = {}
    for key, value in section.options.items():
        where = f"{path}.options.{key}"
        if key in context:
            raise ConfigError(f"{where}: not an option ({_CONTEXT.get(key, 'fedloom passes it')})")
        if key not in names:
            if anything:
                out[key] = value
                continue
            raise ConfigError(f"{where}: unknown option for {kind} {section.name!r} "
                              f"({did_you_mean(key, names)}expected one of: "
                              f"{', '.join(sorted(names)) or 'none'})")
        if key in types:
            tp, bounds = types[key]
            if _holds_int(tp) and not {"le", "lt"} & set(bounds):
                bounds = {**bounds, "le": MAX_COUNT}  # a count, as a section's (field_bounds)
            try:
                value = _convert(value, tp, where)
            except TypeError:  # a type the config schema does not know: the factory's own
                pass
            else:
                _check_bounds(value, bounds, where)
        if _same(value, params[key].default):
            continue
        out[key] = value
    section.options = out


def metric_names(metrics: Any) -> list[str]:
    """``metrics.hooks``, then every boolean key of the section that is true and
    names a registered metric (``metrics.mismatch: true``), without repeats."""
    names = list(getattr(metrics, "hooks", []) or [])
    known = set(registry.available("metric"))
    for f in dataclasses.fields(metrics):
        if getattr(metrics, f.name) is True and f.name in known and f.name not in names:
            names.append(f.name)
    return names


# The per-device quantities of the system section (fedloom.system).
SYSTEM_QUANTITIES = ("speed", "up_bps", "down_bps", "latency_s")


def system_values(cfg: SystemConfig, q: str) -> list[float]:
    v = getattr(cfg, q)
    return [float(v)] if isinstance(v, int | float) else [float(x) for x in v]


def check_system_config(cfg: SystemConfig) -> None:
    """Raise :class:`ConfigError` (one line naming the ``system.*`` field) for a
    section that cannot describe devices."""
    p = cfg.profile
    for q in SYSTEM_QUANTITIES:
        v = system_values(cfg, q)
        given = v != [0.0]
        if p in ("off", "classes", "csv") and given:
            why = "system.profile is off" if p == "off" else f"profile {p} gives it"
            raise ConfigError(f"system.{q}: not used ({why})")
        if len(v) not in (1, 2):
            raise ConfigError(f"system.{q}: one number, or [low, high] (uniform) / "
                              f"[median, sigma] (lognormal), got {len(v)} numbers")
        if p == "uniform" and len(v) == 2:
            if v[0] > v[1]:
                raise ConfigError(f"system.{q}: low {v[0]:g} is above high {v[1]:g}")
            if q != "latency_s" and v[0] == 0 and v[1] > 0:
                raise ConfigError(f"system.{q}: low must be > 0 (0 alone means the term "
                                  "takes no time)")
    if p == "classes":
        if not cfg.classes:
            raise ConfigError("system.classes: profile classes needs at least one class")
        total = sum(c.p for c in cfg.classes)
        if abs(total - 1.0) > 1e-6:
            raise ConfigError(f"system.classes: the probabilities p must sum to 1, got {total:g}")
    elif cfg.classes:
        raise ConfigError(f"system.classes: not used (system.profile is {p})")
    if p == "csv" and not cfg.path:
        raise ConfigError("system.path: profile csv needs the file of the clients' devices")
    if p != "csv" and cfg.path:
        raise ConfigError(f"system.path: not used (system.profile is {p})")
    if cfg.deadline_s is not None and p == "off":
        raise ConfigError("system.deadline_s: needs a system.profile to time the clients")
    if cfg.pattern != "sine" and cfg.amplitude:
        raise ConfigError("system.amplitude: only used by pattern sine")
    if cfg.mode != "sync":
        _check_event_mode(cfg)


def _check_event_mode(cfg: SystemConfig) -> None:
    """What the event-driven modes (async, buffered) cannot combine with, one line each."""
    m = f"system.mode {cfg.mode}"
    if cfg.profile == "off":
        raise ConfigError(f"system.profile: {m} orders arrivals by the time model; "
                          "give the clients' devices (profile uniform, lognormal, classes or csv)")
    if cfg.deadline_s is not None:
        raise ConfigError(f"system.deadline_s: {m} has no rounds to close")
    if cfg.availability < 1 or cfg.pattern != "none" or cfg.dropout > 0:
        raise ConfigError(f"system.availability: {m} keeps every client available "
                          "(availability 1, pattern none, dropout 0)")


# What a partitioner is called with besides its options (fedloom.data.federated).
_PARTITION_CONTEXT = frozenset({"labels", "num_clients", "rng", "groups"})


def _check_partition(p: PartitionConfig) -> None:
    """``data.partition.options`` against the partitioner's signature (check_options);
    ``mixed`` hands the options it does not name to its ``then`` partitioner, whose
    signature they are checked against in turn."""
    check_options("data.partition", "partitioner", p, _PARTITION_CONTEXT)
    if p.name != "mixed":  # before the look-up: a plug-in read as data is not imported
        return
    factory = registry.get("partitioner", p.name)
    if not getattr(factory, "__module__", "").startswith("fedloom."):
        return
    import inspect

    own = set(inspect.signature(factory).parameters)
    then = p.options.get("then", "dirichlet")
    check_name("data.partition.options.then", "partitioner", str(then))
    rest = PartitionConfig(str(then), {k: v for k, v in p.options.items() if k not in own})
    check_options("data.partition", "partitioner", rest, _PARTITION_CONTEXT)
    p.options = {**{k: v for k, v in p.options.items() if k in own}, **rest.options}


def _check_model(cfg: Config) -> None:
    """``model.options`` against the model factory's signature (check_options), after
    refusing a factory of the old signature (check_model_factory)."""
    try:
        factory = registry.get("model", cfg.model.name)
    except registry.NotImported:
        return
    check_model_factory(cfg.model.name, factory)
    check_options("model", "model", cfg.model, _MODEL_CONTEXT)


def _check_data(cfg: Config) -> None:
    """``data.options`` against the loader's signature (check_options), after refusing a
    loader of the old signature (check_data_loader)."""
    try:
        loader = registry.get("dataset", cfg.data.name)
    except registry.NotImported:
        return
    check_data_loader(cfg.data.name, loader)
    check_options("data", "dataset", cfg.data, _DATA_CONTEXT)


def _check_pre_aggregation(cfg: Config) -> None:
    """Each ``server.pre_aggregation`` entry: a mapping with a registered name (or a
    plug-in) and the options its factory takes (``seed`` is the run's); a chain is
    refused where the server sees no rows (secure aggregation) or noises only their sum
    (central DP)."""
    for i, e in enumerate(cfg.server.pre_aggregation):
        where = f"server.pre_aggregation[{i}]"
        if not isinstance(e, Mapping) or not isinstance(e.get("name"), str):
            raise ConfigError(f"{where}: must be a mapping with a name, got {e!r}")
        extra = set(e) - {"name", "options"}
        if extra:
            raise ConfigError(f"{where}.{sorted(extra)[0]}: unknown key (name, options)")
        if not isinstance(e.get("options", {}), Mapping):
            raise ConfigError(f"{where}.options: must be a mapping, got {e['options']!r}")
        check_name(f"{where}.name", "preaggregator", e["name"])
        check_options(where, "preaggregator", _Named(e["name"], dict(e.get("options") or {})),
                      frozenset({"seed"}))
    if cfg.server.pre_aggregation and (cfg.server.secure_aggregation
                                       or cfg.privacy.mode == "central"):
        why = ("server.secure_aggregation gives the server only the masked sum"
               if cfg.server.secure_aggregation else
               "privacy.mode=central noises the sum of the clipped rows, not the steps' output")
        raise ConfigError(f"server.pre_aggregation: the steps read each client's row; {why}")


def _check_cross_fields(cfg: Config) -> None:
    check_name("data.name", "dataset", cfg.data.name)
    _check_data(cfg)
    if not recorded.is_object(cfg.model.name):  # a module given in Python: engine.given
        check_name("model.name", "model", cfg.model.name)
        _check_model(cfg)
    check_component("aggregator", "aggregator", cfg.aggregator)
    check_name("backend.name", "backend", cfg.backend.name)
    check_options("backend", "backend", cfg.backend, _BACKEND_CONTEXT)
    check_component("client.method", "method", cfg.client.method)
    check_component("compression", "compressor", cfg.compression)
    check_component("server.optimizer", "server_optimizer", cfg.server.optimizer)
    check_component("compression.feedback", "feedback", cfg.compression.feedback)
    check_name("compression.adaptive.name", "planner", cfg.compression.adaptive.name)
    check_component("cohort.selection", "selector", cfg.cohort.selection)
    layout = frozenset({"layout"})
    check_options("client.method", "method", cfg.client.method, layout)
    check_options("server.optimizer", "server_optimizer", cfg.server.optimizer,
                  frozenset({"lr"}))
    check_options("compression.feedback", "feedback", cfg.compression.feedback, layout)
    check_options("compression.adaptive", "planner", cfg.compression.adaptive)
    check_options("cohort.selection", "selector", cfg.cohort.selection)
    check_name("data.partition.name", "partitioner", cfg.data.partition.name)
    _check_partition(cfg.data.partition)
    for i, hook in enumerate(cfg.metrics.hooks):
        check_name(f"metrics.hooks[{i}]", "metric", hook)
    on = metric_names(cfg.metrics)
    for hook, opts in cfg.metrics.options.items():
        if hook not in on:
            raise ConfigError(f"metrics.options.{hook}: metric {hook!r} is not on (on: "
                              f"{', '.join(on) or 'none'}; add it to metrics.hooks)")
        if not isinstance(opts, Mapping):
            raise ConfigError(f"metrics.options.{hook}: must be a mapping, got {opts!r}")
    check_name("attack.name", "attack", cfg.attack.name)
    _check_pre_aggregation(cfg)
    for i, t in enumerate(cfg.client.transforms):
        where = f"client.transforms[{i}]"
        if not isinstance(t, Mapping) or not isinstance(t.get("name"), str):
            raise ConfigError(f"{where}: must be a mapping with a name, got {t!r}")
        extra = set(t) - {"name", "options"}
        if extra:
            raise ConfigError(f"{where}.{sorted(extra)[0]}: unknown key (name, options)")
        if not isinstance(t.get("options", {}), Mapping):
            raise ConfigError(f"{where}.options: must be a mapping, got {t['options']!r}")
        if recorded.is_object(t["name"]):
            section = _Named(t["name"], dict(t.get("options") or {}))
            check_component(where, "transform", section)
            t["options"] = section.options
        else:
            check_name(f"{where}.name", "transform", t["name"])
    if cfg.logging.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("logging.tensorboard: needs the tensorboard package "
                              "(pip install 'fedloom[tensorboard]')")
    if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", cfg.device):
        raise ConfigError(f"device: must be cpu, cuda, cuda:N or auto, got {cfg.device!r}")
    # Every compressor takes it (the payload's CRC-32C trailer): checked here, not
    # first when the experiment builds its compressor.
    checksum = cfg.compression.options.get("checksum", True)
    if not isinstance(checksum, bool):
        raise ConfigError(f"compression.options.checksum: must be true or false, "
                          f"got {checksum!r}")
    natural = cfg.data.partition.name == "natural" or bool(cfg.data.options.get("client"))
    if not natural and cfg.cohort.size > cfg.data.num_clients:
        raise ConfigError(
            f"cohort.size: must be <= data.num_clients ({cfg.data.num_clients}), "
            f"got {cfg.cohort.size}"
        )
    check_system_config(cfg.system)
    if cfg.client.schedule.name == "cosine" and cfg.client.schedule.warmup >= cfg.rounds:
        raise ConfigError(
            f"client.schedule.warmup: must be < rounds ({cfg.rounds}), "
            f"got {cfg.client.schedule.warmup}"
        )
