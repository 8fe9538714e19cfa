"""Name → factory for every pluggable component.

Each component module registers itself with :func:`register`; adding an
algorithm touches its implementation file and one line of ``_MODULES`` here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["available", "build", "check_name", "get", "register"]

_KINDS = ("dataset", "model", "aggregator", "backend", "partitioner", "server_optimizer",
          "compressor", "method", "attack")
_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {k: {} for k in _KINDS}

# Modules whose import registers components.
_MODULES = (
    "fedloom.data.sources",
    "fedloom.data.user",
    "fedloom.data.shakespeare",
    "fedloom.data.partition",
    "fedloom.models",
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
    "fedloom.client.methods",
    "fedloom.client.scaffold",
    "fedloom.client.ditto",
    "fedloom.aggregate.server_opt",
    "fedloom.engine.backends",
    "fedloom.engine.vmap",
    "fedloom.engine.parallel",
    "fedloom.engine.auto",
    "fedloom.engine.ray_backend",
    "fedloom.compress.identity",
    "fedloom.compress.sparse",
    "fedloom.compress.quant",
    "fedloom.attack",
)
_loaded = False


def _ensure_loaded() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for mod in _MODULES:
            importlib.import_module(mod)


def register(kind: str, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``@register("aggregator", "fedavg")``."""
    if kind not in _REGISTRY:
        raise KeyError(f"unknown component kind {kind!r}")

    def deco(factory: Callable[..., Any]) -> Callable[..., Any]:
        if name in _REGISTRY[kind]:
            raise KeyError(f"{kind} {name!r} is registered twice")
        _REGISTRY[kind][name] = factory
        return factory

    return deco


def available(kind: str) -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY[kind])


def get(kind: str, name: str) -> Callable[..., Any]:
    _ensure_loaded()
    try:
        return _REGISTRY[kind][name]
    except KeyError:
        raise KeyError(
            f"unknown {kind} {name!r} (available: {', '.join(available(kind))})"
        ) from None


def check_name(field: str, kind: str, name: str) -> None:
    """Raise a one-line ``ConfigError`` naming ``field`` if ``name`` is not registered."""
    from fedloom.config import ConfigError

    if name not in available(kind):
        raise ConfigError(
            f"{field}: unknown {kind} {name!r} (available: {', '.join(available(kind))})"
        )


def build(kind: str, name: str, options: dict[str, Any], field: str) -> Any:
    """Call the factory of ``name`` with ``options``; an unknown option raises a
    one-line ``ValueError`` naming ``field.option``."""
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
        return factory(**options)
    except TypeError as e:
        raise ValueError(f"{field}: {e}") from None
