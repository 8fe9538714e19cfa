"""Name → factory for every pluggable component.

Four ways to name a component, accepted by every name field of a config
(``aggregator.name``, ``compression.name``, ``data.partition.name``, ``backend.name``,
``cohort.selection.name``, …), by the CLI and by sweeps alike:

- a **built-in**: each component module registers itself with
  :func:`register`; adding an algorithm touches its implementation file and
  one line of ``_MODULES`` here;
- an **entry point** of an installed distribution, in the group of its kind
  (:data:`ENTRY_POINT_GROUPS`, e.g. ``fedloom.aggregators``), imported the first
  time its name is built; a built-in name wins over it;
- a **family** ``PREFIX:NAME`` whose prefix a module registered with
  :func:`register_family`; it wins over a reference;
- a **reference** ``module:attr``: the module is imported and ``attr`` is the factory.

Reading results never imports: under :func:`no_imports` :func:`get` finds only what
is already registered, and a name it would have to import raises
:class:`NotImported`. The factory is called exactly as a built-in's (options by name
from its config section), so a plug-in is checked by the config schema.

Every name field, each way with its example, reading results and sweeps:
docs/reference/api.md (Plug-ins: the registry, round planners, client metrics, plain
state).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import importlib.metadata
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ENTRY_POINT_GROUPS", "KINDS", "NotImported", "Range", "available", "build", "get",
           "importing", "is_reference", "no_imports", "option_types", "origin", "register"]

log = logging.getLogger("fedloom")

KINDS = ("dataset", "model", "aggregator", "backend", "partitioner", "server_optimizer",
         "compressor", "method", "attack", "feedback", "planner", "metric", "transform",
         "selector", "preaggregator")
_KINDS = KINDS

# Entry-point group → component kind.
ENTRY_POINT_GROUPS: dict[str, str] = {
    "fedloom.aggregators": "aggregator",
    "fedloom.compressors": "compressor",
    "fedloom.feedback": "feedback",
    "fedloom.methods": "method",
    "fedloom.datasets": "dataset",
    "fedloom.models": "model",
    "fedloom.partitioners": "partitioner",
    "fedloom.attacks": "attack",
    "fedloom.backends": "backend",
    "fedloom.planners": "planner",
    "fedloom.metrics": "metric",
    "fedloom.server_optimizers": "server_optimizer",
    "fedloom.transforms": "transform",
    "fedloom.selectors": "selector",
    "fedloom.preaggregators": "preaggregator",
}

_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {k: {} for k in _KINDS}
# PREFIX -> resolver(NAME) -> factory, per kind (register_family)
_FAMILIES: dict[str, dict[str, Callable[[str], Callable[..., Any]]]] = {k: {} for k in _KINDS}
# Entry points found but not loaded yet: kind → name → entry point.
_ENTRY_POINTS: dict[str, dict[str, importlib.metadata.EntryPoint]] = {k: {} for k in _KINDS}
# Where a name that is not built in comes from (for listings): kind → name → text.
_ORIGIN: dict[str, dict[str, str]] = {k: {} for k in _KINDS}
_DIST: dict[str, dict[str, str]] = {k: {} for k in _KINDS}  # entry point → its distribution

# Modules whose import registers components.
_MODULES = (
    "fedloom.data.sources",
    "fedloom.data.user",
    "fedloom.data.shakespeare",
    "fedloom.data.disk",
    "fedloom.data.partition",
    "fedloom.data.flwr_partition",
    "fedloom.models",
    "fedloom.models.zoo",
    "fedloom.models.published",
    "fedloom.models.llm",
    "fedloom.data.text",
    "fedloom.data.population",
    "fedloom.aggregate.mean",
    "fedloom.aggregate.craft",
    "fedloom.aggregate.fednova",
    "fedloom.aggregate.qfedavg",
    "fedloom.aggregate.fedfv",
    "fedloom.aggregate.conflict_free",
    "fedloom.aggregate.fedlf",
    "fedloom.aggregate.afl",
    "fedloom.aggregate.coordmean",
    "fedloom.aggregate.median",
    "fedloom.aggregate.trimmed_mean",
    "fedloom.aggregate.krum",
    "fedloom.aggregate.bulyan",
    "fedloom.aggregate.geometric_median",
    "fedloom.aggregate.centered_clip",
    "fedloom.aggregate.nnm",
    "fedloom.aggregate.bucketing",
    "fedloom.aggregate.flame",
    "fedloom.aggregate.fltrust",
    "fedloom.aggregate.lora",
    "fedloom.client.methods",
    "fedloom.client.adamw",
    "fedloom.client.scaffold",
    "fedloom.client.ditto",
    "fedloom.client.feddyn",
    "fedloom.client.fedper",
    "fedloom.client.lg_fedavg",
    "fedloom.client.fedrep",
    "fedloom.client.fedbabu",
    "fedloom.client.apfl",
    "fedloom.client.moon",
    "fedloom.client.fedbn",
    "fedloom.client.fedsa_lora",
    "fedloom.client.hetlora",
    "fedloom.server_opt.optimizers",
    "fedloom.engine.trainers.backends",
    "fedloom.engine.trainers.vmap",
    "fedloom.engine.trainers.parallel",
    "fedloom.engine.trainers.auto",
    "fedloom.engine.trainers.lockstep",
    "fedloom.engine.trainers.ray",
    "fedloom.compress.identity",
    "fedloom.compress.sparse",
    "fedloom.compress.quant",
    "fedloom.compress.feedback",
    "fedloom.compress.flare",
    "fedloom.compress.adaptive",
    "fedloom.compress.mismatch",
    "fedloom.attack",
    "fedloom.selection.uniform",
    "fedloom.selection.power",
    "fedloom.selection.oort",
)
_loaded = False
# Held while the built-ins load. Flower's simulation builds components from two
# threads at once (the ClientApp module's CompressionMod at import, the ServerApp's
# CRAFT): a thread that saw loading begun must wait for its end, not look up a
# registry still being filled (a KeyError "unknown aggregator 'craft'").
_LOAD_LOCK = threading.RLock()
_loading = False
_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
# True inside no_imports(). A context variable, not a module flag: a sweep's threads and
# a Flower simulation's build components at the same time, and only the reading that
# asked for it must be refused imports.
_NO_IMPORTS: contextvars.ContextVar[bool] = contextvars.ContextVar("fedloom_no_imports",
                                                                  default=False)


class NotImported(KeyError):
    """A plug-in's name looked up under :func:`no_imports`: building it would import
    code (an entry point's module, a family's library, a ``module:attr``)."""


@contextlib.contextmanager
def no_imports() -> Iterator[None]:
    """While open (in this thread), :func:`get` returns only factories already
    registered: the built-ins (fedloom's own modules), names registered in this process
    and entry points already loaded; any other plug-in raises :class:`NotImported`.
    For reading results: naming code in a run folder must not run it."""
    token = _NO_IMPORTS.set(True)
    try:
        yield
    finally:
        _NO_IMPORTS.reset(token)


def importing() -> bool:
    """False inside :func:`no_imports` (in this thread): naming code must not run it."""
    return not _NO_IMPORTS.get()


def _ensure_loaded() -> None:
    """Every built-in is registered and every entry point listed when this returns,
    in any thread (one thread loads, the others wait for it). A call made by the
    loading thread itself (a component module that looks a name up while it is
    imported) returns at once, as it always did."""
    global _loaded, _loading
    if _loaded:  # set only after everything is in: no lock on the common path
        return
    with _LOAD_LOCK:
        if _loaded or _loading:
            return
        _loading = True
        try:
            for mod in _MODULES:
                importlib.import_module(mod)
            _find_entry_points()
            _loaded = True
        finally:
            _loading = False


def _find_entry_points() -> None:
    # One scan of the installed distributions for every group: entry_points(group=g)
    # scans them all again for each of the 12 groups (0.13 s against 0.015 s, loaded
    # 2-core machine, this venv), a tenth of a short run's start.
    found = importlib.metadata.entry_points()
    for group, kind in ENTRY_POINT_GROUPS.items():
        for ep in found.select(group=group):
            dist = ep.dist.name if ep.dist is not None else "?"
            if ep.name in _REGISTRY[kind]:
                if _REGISTRY[kind][ep.name].__module__.startswith("fedloom."):
                    log.warning("entry point %s = %s of %s: %s %r is built in; the plug-in "
                                "is ignored", ep.name, ep.value, dist, kind, ep.name)
                continue
            if ep.name in _ENTRY_POINTS[kind]:
                continue  # the same distribution seen twice on sys.path
            _ENTRY_POINTS[kind][ep.name] = ep
            _ORIGIN[kind][ep.name] = f"entry point of {dist} ({ep.value})"
            _DIST[kind][ep.name] = dist


def register(kind: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``@register("aggregator", "fedavg")``."""
    if kind not in _REGISTRY:
        raise KeyError(f"unknown component kind {kind!r}")

    def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
        # The same object again is harmless (a plug-in module that registers the
        # factory its entry point also names, when the entry point loads it).
        if name in _REGISTRY[kind] and _REGISTRY[kind][name] is not factory:
            raise KeyError(f"{kind} {name!r} is registered twice")
        _REGISTRY[kind][name] = factory
        if not getattr(factory, "__module__", "").startswith("fedloom."):
            _ORIGIN[kind].setdefault(name, f"registered by {factory.__module__}")
        return factory

    return deco


def is_reference(name: str) -> bool:
    """``module:attr`` (a plug-in named by where it is, not registered)."""
    return bool(_REFERENCE.match(name))


def _import_reference(name: str) -> Any:
    mod_name, _, attr = name.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        # `fedloom run` (a console script) does not have the current directory
        # on sys.path the way `python -m` has: look there too, after the rest.
        top = mod_name.split(".")[0]
        cwd = os.getcwd()
        if e.name != top or cwd in sys.path:
            raise
        sys.path.append(cwd)
        obj = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def register_family(kind: str, prefix: str
                    ) -> Callable[[Callable[[str], Callable[..., Any]]],
                                  Callable[[str], Callable[..., Any]]]:
    """Decorator: ``@register_family("partitioner", "flwr")`` on ``resolve(name) ->
    factory``, which raises ``KeyError`` (one line) for a name it does not know."""
    if kind not in _FAMILIES:
        raise KeyError(f"unknown component kind {kind!r}")

    def deco(resolve: Callable[[str], Callable[..., Any]]) -> Callable[[str], Callable[..., Any]]:
        _FAMILIES[kind][prefix] = resolve
        return resolve

    return deco


def family(kind: str, name: str) -> str | None:
    """The prefix of ``name`` when it is a family's ``PREFIX:NAME`` (``flwr``), else None."""
    prefix, sep, _ = name.partition(":")
    _ensure_loaded()
    return prefix if sep and prefix in _FAMILIES.get(kind, {}) else None


def available(kind: str) -> list[str]:
    """The names of ``kind``: built-ins, names registered in this process and
    installed entry points (``module:attr`` references are not listed)."""
    _ensure_loaded()
    return sorted(set(_REGISTRY[kind]) | set(_ENTRY_POINTS[kind]))


def origin(kind: str, name: str) -> str:
    """``"fedloom"`` for a built-in, else where the name comes from."""
    _ensure_loaded()
    if is_reference(name):
        return f"reference {name}"
    return _ORIGIN[kind].get(name, "fedloom")


def get(kind: str, name: str) -> Callable[..., Any]:
    """The factory of ``name`` (a registered name, an entry point or ``module:attr``);
    ``KeyError`` with one line when there is none; :class:`NotImported` (a KeyError)
    under :func:`no_imports` for a plug-in that would have to be imported."""
    _ensure_loaded()
    if kind not in _REGISTRY:
        raise KeyError(f"unknown component kind {kind!r}")
    factory = _REGISTRY[kind].get(name)
    if factory is not None:
        return factory
    ep = _ENTRY_POINTS[kind].get(name)
    prefix, sep, rest = name.partition(":")
    if _NO_IMPORTS.get() and (ep is not None or is_reference(name)
                              or (sep and prefix in _FAMILIES[kind])):
        raise NotImported(f"{kind} {name!r}: a plug-in, not imported while results are read")
    if ep is not None:
        try:
            # object, not Any: the callable() check below is what makes it a factory
            loaded: object = ep.load()
        except Exception as e:  # a broken plug-in: say which, in one line
            dist = _DIST[kind].get(name, "?")
            raise KeyError(f"{kind} {name!r}: cannot load entry point {ep.value} of {dist} "
                           f"({type(e).__name__}: {_line(e)})") from None
        if not callable(loaded):
            raise KeyError(f"{kind} {name!r}: entry point {ep.value} is not callable")
        _REGISTRY[kind][name] = loaded
        return loaded
    if sep and prefix in _FAMILIES[kind]:
        return _FAMILIES[kind][prefix](rest)
    if is_reference(name):
        try:
            ref: object = _import_reference(name)
        except Exception as e:
            raise KeyError(f"{kind} {name!r}: cannot import it ({type(e).__name__}: "
                           f"{_line(e)})") from None
        if not callable(ref):
            raise KeyError(f"{kind} {name!r}: is a {type(ref).__name__}, not a factory")
        return ref
    raise KeyError(
        f"unknown {kind} {name!r} (available: {', '.join(available(kind))}; "
        "or an installed plug-in's name, or module:attr)"
    )


def _line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def accepted_options(factory: Callable[..., Any], options: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``options`` that ``factory``'s signature takes by name
    (all of them when it takes ``**kwargs``)."""
    import inspect

    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(options)
    return {k: v for k, v in options.items() if k in params
            and params[k].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                   inspect.Parameter.KEYWORD_ONLY)}


@dataclasses.dataclass(frozen=True)
class Range:
    """The bounds of a factory's numeric option, in its signature:
    ``alpha: Annotated[float, Range(ge=0, le=1)] = 0.85``. A config's options are
    checked against them when it loads (one line naming ``SECTION.options.alpha``),
    as a section's own fields are against theirs; ``fedloom algorithms`` states them."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def bounds(self) -> dict[str, float]:
        """The bounds set, as a section field's (``{"ge": 0, "le": 1}``)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def option_types(factory: Callable[..., Any]) -> dict[str, tuple[Any, dict[str, float]]]:
    """Each annotated option of ``factory`` (a class: its ``__init__``) as ``(type,
    bounds)``: the type without its :class:`Range`, the bounds of that range ({} when
    none). Options whose annotations cannot be resolved are left out (not checked)."""
    import typing

    target: Any = factory.__init__ if isinstance(factory, type) else factory  # type: ignore[misc]
    try:
        hints = typing.get_type_hints(target, include_extras=True)
    except Exception:  # a plug-in's annotation naming what its module does not import
        return {}
    out: dict[str, tuple[Any, dict[str, float]]] = {}
    for name, tp in hints.items():
        if name == "return":
            continue
        bounds: dict[str, float] = {}
        if typing.get_origin(tp) is typing.Annotated:
            for meta in tp.__metadata__:
                if isinstance(meta, Range):
                    bounds.update(meta.bounds())
            tp = typing.get_args(tp)[0]
        out[name] = (tp, bounds)
    return out


# The methods an object a factory of these kinds returns must have (their protocols:
# fedloom.aggregate.base.Aggregator, fedloom.compress.base.Compressor). A plug-in's
# factory that returns something else is one line naming it (build), not a traceback
# from deep inside the first round.
_SHAPES: dict[str, tuple[str, ...]] = {"aggregator": ("init", "__call__"),
                                       "compressor": ("encode", "decode")}


def _check_shape(kind: str, name: str, obj: object, field: str) -> None:
    """``ValueError`` naming the config's name field, the factory and what it returned
    when ``obj`` lacks a method of :data:`_SHAPES` [kind]."""
    missing = [m for m in _SHAPES.get(kind, ()) if not callable(getattr(obj, m, None))]
    if missing:
        shown = repr(obj)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        needs = " and ".join(f"{m}()" for m in _SHAPES[kind])
        an = "an" if kind[0] in "aeiou" else "a"
        raise ValueError(f"{field.removesuffix('.options')}.name: {name} returned {shown} "
                         f"(type {type(obj).__name__}), not {an} {kind} (one has {needs}; "
                         f"{missing[0]}() is missing)")


def build(kind: str, name: str, options: dict[str, Any], field: str) -> Any:
    """Call the factory of ``name`` with ``options``; an unknown option raises a
    one-line ``ValueError`` naming ``field.option``, and a factory whose result is not
    of its kind (:data:`_SHAPES`) one naming the name field, the factory and the result."""
    import inspect

    factory = get(kind, name)
    params = inspect.signature(factory).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:
            raise ValueError(
                f"{field}.{unknown[0]}: unknown option for {kind} {name!r} "
                f"(expected one of: {', '.join(sorted(params)) or 'none'})"
            )
    try:
        obj = factory(**options)
    except TypeError as e:
        raise ValueError(f"{field}: {e}") from None
    _check_shape(kind, name, obj, field)
    return obj
