"""Component objects recorded by import path and options, and rebuilt from the record.

A component given as a Python object (:mod:`fedloom.engine.objects`) is written into
the config as ``{name: "object MODULE.QUALNAME", options: {...}}``: a dataclass's
``init`` fields, or a plain class's constructor parameters read back from its
attributes of the same name (or its ``constructor_arguments()``, parameter → value,
where it keeps them otherwise); a value that is itself such an object is a nested record of
the same shape (a chain's transforms). Options hold only YAML/JSON-safe
values (None, bools, numbers, strings, lists, string-keyed mappings, nested records).
What cannot be recorded (a tensor, a function, ``*args``/``**kwargs``, a parameter
with no attribute of its name, a class defined inside a function, options that do
not rebuild an object with the same options) is left out and the record's options
say so under the key :data:`UNRECORDED` (no parameter can be named so).

:func:`rebuild` imports the class and calls it with the recorded options; a record
marked unrecorded, a class that is not importable, and a record without options of
a class that takes some (what versions before this module wrote: the name alone)
are refused in one ``ValueError`` line naming the field. Departure from a full
snapshot: only constructor arguments are recorded, never attributes set afterwards.
A file the run directory keeps for its record (a model's initial weights, data given
in Python) is named ``run:NAME`` (:data:`RUN_FILE`), made absolute when the config
is read from its file (:func:`run_files`), so that no path depends on the current folder.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import pkgutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["OBJECT_PREFIX", "RUN_FILE", "UNRECORDED", "WEIGHTS", "describe", "import_object",
           "is_object", "object_name", "rebuild", "record", "run_files", "unrecorded"]

# A space, so that the name can never be a registry name or a `module:attr` reference.
OBJECT_PREFIX = "object "
# The options key saying what was not recorded: not an identifier, so never a parameter.
UNRECORDED = "<unrecorded>"
# Values of these libraries' types are data, not components: never recorded as objects
# (a tensor's class would "rebuild" as an empty tensor).
_DATA_LIBRARIES = frozenset({"builtins", "torch", "numpy", "pandas", "collections",
                             "functools", "types", "random", "typing", "enum"})
_MAX_DEPTH = 16
# A path of a run directory's config that names a file of that directory (run:NAME).
RUN_FILE = "run:"
# The option of a module's record naming its initial weights (no parameter is so named).
WEIGHTS = "<weights>"


def object_name(obj: object) -> str:
    """``object MODULE.CLASS``: how the config names a component given as an object."""
    return f"{OBJECT_PREFIX}{type(obj).__module__}.{type(obj).__qualname__}"


def is_object(name: object) -> bool:
    """Whether ``name`` (a config name field) names a component given as an object."""
    return isinstance(name, str) and name.startswith(OBJECT_PREFIX)


def _parameters(cls: type) -> list[inspect.Parameter]:
    """The constructor's parameters (``ValueError`` when it has no Python signature)."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        raise ValueError("its constructor has no Python signature") from None
    return list(sig.parameters.values())


def _is_component(v: object) -> bool:
    """Whether ``v`` is recorded as a nested object rather than refused as data."""
    if isinstance(v, type) or inspect.isroutine(v):
        return False
    return type(v).__module__.partition(".")[0] not in _DATA_LIBRARIES


def _value(v: Any, depth: int, verify: bool) -> Any:
    """``v`` as YAML/JSON-safe data; ``ValueError`` saying why when it is not."""
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if depth > _MAX_DEPTH:
        raise ValueError(f"nested deeper than {_MAX_DEPTH}")
    if isinstance(v, list | tuple):
        return [_value(x, depth + 1, verify) for x in v]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise ValueError("a mapping with keys that are not strings")
        return {k: _value(x, depth + 1, verify) for k, x in v.items()}
    if _is_component(v):
        return {"name": object_name(v), "options": _record(v, depth + 1, verify)}
    raise ValueError(f"a {type(v).__module__}.{type(v).__qualname__} is not YAML-safe data")


def _record(obj: object, depth: int, verify: bool = True) -> dict[str, Any]:
    """``obj``'s options; ``verify``: check that they rebuild it (:func:`_round_trip`)."""
    cls = type(obj)
    out: dict[str, Any] = {}
    why: list[str] = []
    if "<locals>" in cls.__qualname__:
        why.append(f"{cls.__qualname__} is defined inside a function (not importable)")
    try:
        params = _parameters(cls)
    except ValueError as e:
        return {UNRECORDED: f"{cls.__qualname__}: {e}"}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            why.append(f"{'*' if p.kind is p.VAR_POSITIONAL else '**'}{p.name} cannot be "
                       "recovered from the object")
            continue
        try:
            v = _argument(obj, p.name)
        except Exception as e:  # a property of the user's class that raises
            why.append(f"{p.name}: reading it raised {type(e).__name__}")
            continue
        if v is inspect.Parameter.empty:
            why.append(f"{p.name}: the object keeps no attribute of that name")
            continue
        try:
            out[p.name] = _value(v, depth, verify)
        except ValueError as e:
            why.append(f"{p.name}: {e}")
    if verify and not why:
        why += _round_trip(obj, out, depth)
    if why:
        out[UNRECORDED] = "; ".join(why)
    return out


def _argument(obj: object, name: str) -> Any:
    """The constructor argument ``name`` of ``obj``: from its ``constructor_arguments()``
    where its class keeps an argument under another name (or derived), else the
    attribute of that name (``inspect.Parameter.empty``: none)."""
    kept = getattr(type(obj), "constructor_arguments", None)
    if callable(kept):
        given = obj.constructor_arguments()  # type: ignore[attr-defined]
        return given.get(name, inspect.Parameter.empty)
    return getattr(obj, name, inspect.Parameter.empty)


def _round_trip(obj: object, options: dict[str, Any], depth: int) -> list[str]:
    """Why ``options`` do not rebuild an object recorded the same (``[]``: they do).
    A dataclass without ``__post_init__`` keeps its arguments as its fields: trusted."""
    cls = type(obj)
    if dataclasses.is_dataclass(obj) and "__post_init__" not in dir(cls):
        return []
    try:
        again = _record(_construct(cls, options, cls.__qualname__), depth, verify=False)
    except ValueError as e:
        return [f"rebuilding it from the recorded options fails ({e})"]
    if again != options:
        diff = sorted(k for k in set(again) | set(options) if again.get(k) != options.get(k))
        return [f"rebuilt from the recorded options it holds another {diff[0]} (the "
                "constructor does not keep its arguments as they were given)"]
    return []


def record(obj: object) -> dict[str, Any]:
    """The options that rebuild ``obj`` (see the module docstring)."""
    return _record(obj, 0)


def unrecorded(options: Any, at: str = "") -> str | None:
    """The first thing ``options`` say was not recorded, with where; ``None``: nothing."""
    if isinstance(options, dict):
        if UNRECORDED in options:
            return f"{at}{': ' if at else ''}{options[UNRECORDED]}"
        for k, v in options.items():
            inner = v.get("options", {}) if _is_record(v) else v
            where = (f"{at}." if at else "") + str(k)
            if (why := unrecorded(inner, where)) is not None:
                return why
    elif isinstance(options, list):
        for i, v in enumerate(options):
            inner = v.get("options", {}) if _is_record(v) else v
            if (why := unrecorded(inner, f"{at}[{i}]")) is not None:
                return why
    return None


def _is_record(v: Any) -> bool:
    return isinstance(v, dict) and set(v) <= {"name", "options"} and is_object(v.get("name"))


def run_files(data: dict[str, Any], folder: Path) -> dict[str, Any]:
    """``data`` (a config mapping read from a file in ``folder``) with each ``run:NAME``
    (``data.options.path``, a model's :data:`WEIGHTS` option) made ``folder/NAME``, absolute."""
    def at(section: Any, key: str) -> Any:
        path = section.get(key) if isinstance(section, dict) else None
        if not (isinstance(path, str) and path.startswith(RUN_FILE)):
            return section
        return {**section, key: str(folder.absolute() / path[len(RUN_FILE):])}

    out = dict(data)
    if isinstance(out.get("data"), dict):
        out["data"] = at(out["data"], "path")  # a run directory of an earlier version
        if isinstance(out["data"].get("options"), dict):
            out["data"] = {**out["data"], "options": at(out["data"]["options"], "path")}
    model = out.get("model")
    if isinstance(model, dict) and isinstance(model.get("options"), dict):
        out["model"] = {**model, "options": at(model["options"], WEIGHTS)}
    return out


def import_object(path: str) -> Any:
    """What ``path`` (``MODULE.QUALNAME`` or ``MODULE:QUALNAME``) names, imported; the
    exception of the import or the look-up as raised."""
    try:
        return pkgutil.resolve_name(path)
    except ModuleNotFoundError as e:
        # `fedloom run` (a console script) lacks the current folder on sys.path, where
        # `python -m` has it: look there too, as a `module:attr` reference does.
        if os.getcwd() in sys.path or not path.startswith((f"{e.name}.", f"{e.name}:")):
            raise
        sys.path.append(os.getcwd())
        importlib.invalidate_caches()
        return pkgutil.resolve_name(path)


def _decoded(v: Any, where: str) -> Any:
    """A recorded value as the constructor takes it: nested records rebuilt."""
    if _is_record(v):
        return rebuild(v["name"], v.get("options") or {}, where)
    if isinstance(v, list):
        return [_decoded(x, f"{where}[{i}]") for i, x in enumerate(v)]
    if isinstance(v, dict):
        return {k: _decoded(x, f"{where}.{k}") for k, x in v.items()}
    return v


def _construct(cls: type, options: dict[str, Any], where: str) -> Any:
    """``cls`` called with ``options`` (positional-only ones by position; a list where
    the parameter is annotated as a tuple becomes one, as the object held it)."""
    params = {p.name: p for p in _parameters(cls)}
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for k, v in options.items():
        v = _decoded(v, f"{where}.{k}")
        p = params.get(k)
        if p is not None and isinstance(v, list) and _tuple_annotation(p.annotation):
            v = tuple(v)
        if p is not None and p.kind is p.POSITIONAL_ONLY:
            args.append(v)
        else:
            kwargs[k] = v
    try:
        return cls(*args, **kwargs)
    except Exception as e:  # the class's own code: any error means it does not rebuild
        text = str(e).strip().splitlines()
        raise ValueError(f"{cls.__qualname__}(...) raised {type(e).__name__}"
                         f"{': ' + text[0] if text else ''}") from None


def _tuple_annotation(ann: Any) -> bool:
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", repr(ann))
    return text.partition("[")[0].rpartition(".")[2].lower() == "tuple"


def rebuild(name: str, options: dict[str, Any], field: str) -> Any:
    """The object recorded as ``name`` with ``options`` in config field ``field``;
    ``ValueError``, one line naming ``field``, when it cannot be rebuilt."""
    path = name[len(OBJECT_PREFIX):]
    why = unrecorded(options)
    if why is not None:
        raise ValueError(f"{field}: {path} was given in Python and cannot be rebuilt from "
                         f"the record ({why}); give the object again")
    try:
        cls = import_object(path)
    except Exception as e:  # an import runs the module's code: any error is one line
        hint = (" (a class of the script that ran; move it into a module)"
                if path.startswith("__main__.") else "")
        text = str(e).strip().splitlines()
        raise ValueError(f"{field}: cannot import {path}{hint} ({type(e).__name__}"
                         f"{': ' + text[0] if text else ''})") from None
    if not isinstance(cls, type):
        raise ValueError(f"{field}: {path} is a {type(cls).__name__}, not a class")
    try:
        takes = [p.name for p in _parameters(cls)]
        if takes and not options:
            raise ValueError(f"its options were not recorded (a record of an earlier "
                             f"fedloom: the name alone), and it takes {', '.join(takes)}; "
                             "give the object again")
        return _construct(cls, options, field)
    except ValueError as e:
        raise ValueError(f"{field}: {path}: {e}") from None


def describe(name: str, options: dict[str, Any]) -> str:
    """A record as a call: ``Chain(transforms=[HeavyBall(beta=0.9), Scale(factor=0.5)])``."""
    def shown(v: Any) -> str:
        if _is_record(v):
            return describe(v["name"], v.get("options") or {})
        if isinstance(v, list):
            return "[" + ", ".join(shown(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {shown(x)}" for k, x in v.items()) + "}"
        return repr(v)

    args = ", ".join(f"{k}={shown(v)}" for k, v in options.items() if k != UNRECORDED)
    return f"{name[len(OBJECT_PREFIX):].rpartition('.')[2]}({args})"
