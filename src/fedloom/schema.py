"""The config's JSON Schema, generated from the dataclasses of :mod:`fedloom.config`.

``fedloom schema > fedloom.schema.json`` writes it; an editor with a YAML
language server then completes and checks config keys when the file starts with::

    # yaml-language-server: $schema=fedloom.schema.json

What it carries, from the same dataclasses and field metadata that
:func:`fedloom.config.load_config` validates against (so it cannot drift):
every section and key (``additionalProperties: false``: an unknown key is
flagged, as loading refuses it), each key's type, ``Literal`` choices as
``enum``, defaults, and the numeric bounds (``ge``/``gt``/``le``/``lt`` →
``minimum``/``exclusiveMinimum``/``maximum``/``exclusiveMaximum``; every integer
key but ``seed`` has ``maximum`` :data:`fedloom.config.MAX_COUNT` at most). Name fields
that the registry resolves (``aggregator.name``, ``compression.name``, …) list
the registered names as suggestions but accept any string, as plug-ins
(entry points, ``module:attr``) may add names. Cross-field rules (``cohort.size
<= data.num_clients``) and component options (``aggregator.options``) are left
to loading, which names the field.

The schema is written by our own walk of the dataclasses rather than by
pydantic: the bounds live in field metadata that pydantic does not read, and
the walk is the same type dispatch as the loader's.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from fedloom.config import Config, field_bounds
from fedloom.config.sections import SHORTHAND_SECTIONS

__all__ = ["config_schema"]

_DIALECT = "https://json-schema.org/draft/2020-12/schema"

# Dotted config fields whose value is a registry name: (registry kind).
_NAMED = {
    "data.name": "dataset",
    "model.name": "model",
    "aggregator.name": "aggregator",
    "backend.name": "backend",
    "client.method.name": "method",
    "compression.name": "compressor",
    "compression.feedback.name": "feedback",
    "compression.adaptive.name": "planner",
    "attack.name": "attack",
    "data.partition.name": "partitioner",
    "server.optimizer.name": "server_optimizer",
}

_BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


def _names(kind: str) -> list[str]:
    from fedloom.registry import available

    try:
        return available(kind)
    except KeyError:  # a kind this registry does not have
        return []


def _type(tp: Any, path: str, bounds: dict[str, float]) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin in (typing.Union, types.UnionType):
        return {"anyOf": [_type(a, path, bounds) for a in typing.get_args(tp)]}
    if tp is type(None):
        return {"type": "null"}
    if origin is list:
        (inner,) = typing.get_args(tp)
        return {"type": "array", "items": _type(inner, f"{path}[]", bounds)}
    if origin is dict:
        return {"type": "object"}
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # a section's class
        return _object(tp, path)
    if tp is bool:
        return {"type": "boolean"}
    if tp in (int, float):
        out: dict[str, Any] = {"type": "integer" if tp is int else "number"}
        out.update({_BOUNDS[k]: v for k, v in bounds.items()})
        return out
    if tp is str:
        kind = _NAMED.get(path)
        names = _names(kind) if kind else []
        if names:
            # Suggested (editors complete them), not required: plug-ins add names.
            return {"anyOf": [{"enum": names}, {"type": "string"}]}
        return {"type": "string"}
    return {}  # Any


def _object(cls: type, path: str) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    props: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        where = f"{path}.{f.name}" if path else f.name
        tp = hints[f.name]
        prop = _type(tp, where, field_bounds(f, tp))  # MAX_COUNT on counts, as loading
        if f.default is not dataclasses.MISSING:
            prop["default"] = f.default
        elif f.default_factory is not dataclasses.MISSING and not dataclasses.is_dataclass(tp):
            prop["default"] = f.default_factory()
        props[f.name] = prop
    out: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    doc = (cls.__doc__ or "").strip()
    if doc and not doc.startswith(f"{cls.__name__}("):  # not dataclass's generated signature
        out["description"] = " ".join(doc.split("\n\n")[0].split())
    return out


def config_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a fedloom YAML config."""
    schema = _object(Config, "")
    # `backend: NAME` is short for `backend: {name: NAME}`, and so for every
    # `{name, options}` section (fedloom.config.SHORTHAND_SECTIONS).
    for path in SHORTHAND_SECTIONS:
        *outer, last = path.split(".")
        props = schema["properties"]
        for part in outer:
            props = props[part]["properties"]
        section = props[last]
        props[last] = {"anyOf": [section, _type(str, f"{path}.name", {})],
                       "description": section.get("description", "")}
    return {"$schema": _DIALECT, "$id": "https://fedloom/config.schema.json",
            "title": "fedloom experiment config", **schema}
