"""Plain data: what a checkpoint may hold, so that reading one runs no code.

A pickle names functions that the reader calls; ``torch.load(weights_only=True)``
rebuilds only tensors, ``None``, ``bool``, ``int``, ``float``, ``str``,
``bytes``, lists, tuples and dicts, calling nothing a file chooses. A run's
state also holds NumPy arrays (the state store, in memory) and a few dataclasses
(an aggregator's state, e.g. CRAFT's). :func:`encode` turns those into the plain
types and :func:`decode` rebuilds them:

- a NumPy array or scalar of any dtype without Python objects becomes
  ``{"__fedloom__": "ndarray", "dtype": "<f4", "shape": [...], "bytes": uint8
  tensor}`` (its exact bytes; ``"scalar": True`` for a scalar);
- a dataclass registered with :func:`state_type` becomes ``{"__fedloom__":
  "dataclass", "type": "module.Qualname", "fields": {...}}``. :func:`decode`
  finds the class by that name among the registered ones only; it never imports
  a module a file names, so a file cannot reach a class nobody registered.

Anything else (an arbitrary object, a set, an object array, a tensor subclass)
is refused by :func:`encode` with :class:`PlainDataError` naming where it is,
before anything is written: a plug-in whose state is a class of its own
registers it (``@fedloom.plain.state_type`` on a dataclass of plain fields).

The key ``"__fedloom__"`` is reserved: a state dict that holds it is refused.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = ["PlainDataError", "decode", "encode", "registered_types", "state_type"]

TAG = "__fedloom__"

T = TypeVar("T")

_TYPES: dict[str, type] = {}
_LOCK = threading.Lock()


class PlainDataError(TypeError):
    """A value that a checkpoint cannot hold (encode) or a damaged encoding
    (decode); one line naming where it is."""


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def state_type(cls: type[T]) -> type[T]:
    """Register the dataclass ``cls`` as a type a checkpoint may hold (a class
    decorator). Its fields must be plain data themselves (checked when one is
    encoded); it is rebuilt by calling ``cls(**fields)``."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"state_type: {cls!r} is not a dataclass")
    with _LOCK:
        _TYPES[_name(cls)] = cls
    return cls


def registered_types() -> tuple[type, ...]:
    """The dataclasses registered with :func:`state_type`."""
    with _LOCK:
        return tuple(_TYPES.values())


def _array(a: np.ndarray | np.generic, where: str) -> dict[str, Any]:
    arr = np.asarray(a)
    if arr.dtype.hasobject or arr.dtype.fields is not None or arr.dtype.itemsize == 0:
        raise PlainDataError(f"{where}: a NumPy array of dtype {arr.dtype} (Python objects, "
                             "fields or no bytes) cannot be checkpointed")
    flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return {TAG: "ndarray", "dtype": arr.dtype.str, "shape": list(arr.shape),
            "scalar": isinstance(a, np.generic), "bytes": torch.from_numpy(flat)}


def encode(obj: Any, where: str = "state") -> Any:
    """``obj`` as plain data (see the module docstring); raises
    :class:`PlainDataError` naming the first value that cannot be encoded."""
    # NumPy first: np.float64 is a float, and would come back as a plain one.
    if isinstance(obj, (np.ndarray, np.generic)):
        return _array(obj, where)
    if obj is None or type(obj) in (bool, int, float, str, bytes):
        return obj
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise PlainDataError(f"{where}: a {type(obj).__name__} (a tensor subclass) cannot "
                                 "be checkpointed")
        return obj.detach() if isinstance(obj, torch.nn.Parameter) else obj
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if isinstance(k, bool) or not isinstance(k, (str, int)):
                raise PlainDataError(f"{where}: a dict key {k!r} ({type(k).__name__}); "
                                     "checkpointed dicts have str or int keys")
            if k == TAG:
                raise PlainDataError(f"{where}: the key {TAG!r} is reserved")
            out[k] = encode(v, f"{where}.{k}")
        return out
    if type(obj) in (list, tuple):
        items = [encode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if type(obj) is list else tuple(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        name = _name(type(obj))
        with _LOCK:
            known = _TYPES.get(name) is type(obj)
        if not known:
            raise PlainDataError(f"{where}: a {name} is not a registered state type "
                                 "(decorate the dataclass with fedloom.plain.state_type)")
        fields = {f.name: encode(getattr(obj, f.name), f"{where}.{f.name}")
                  for f in dataclasses.fields(obj) if f.init}
        return {TAG: "dataclass", "type": name, "fields": fields}
    raise PlainDataError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be "
                         "checkpointed (tensors, NumPy arrays, plain data and registered "
                         "state types only)")


def _decode_array(d: dict[str, Any], where: str) -> np.ndarray | np.generic:
    try:
        dtype = np.dtype(str(d["dtype"]))
        shape = tuple(int(s) for s in d["shape"])
        raw = d["bytes"]
    except (KeyError, TypeError, ValueError) as e:
        raise PlainDataError(f"{where}: a damaged array ({type(e).__name__})") from None
    if dtype.hasobject or dtype.fields is not None or dtype.itemsize == 0:
        raise PlainDataError(f"{where}: an array of dtype {dtype} is never checkpointed")
    if not (isinstance(raw, torch.Tensor) and raw.dtype == torch.uint8 and raw.dim() == 1
            and all(s >= 0 for s in shape)
            and raw.numel() == dtype.itemsize * int(np.prod(shape, dtype=np.int64))):
        raise PlainDataError(f"{where}: a damaged array (its bytes do not match dtype "
                             f"{dtype} and shape {shape})")
    # One copy into memory of the array's own dtype (aligned, whatever the tensor's
    # storage offset).
    arr = np.empty(shape, dtype=dtype)
    arr.reshape(-1).view(np.uint8)[:] = raw.numpy()
    return arr[()] if d.get("scalar") is True else arr


def decode(obj: Any, where: str = "state") -> Any:
    """The inverse of :func:`encode`; raises :class:`PlainDataError` for an
    unknown or damaged encoding."""
    if isinstance(obj, dict):
        kind = obj.get(TAG)
        if kind is None:
            return {k: decode(v, f"{where}.{k}") for k, v in obj.items()}
        if kind == "ndarray":
            return _decode_array(obj, where)
        if kind == "dataclass":
            name, fields = obj.get("type"), obj.get("fields")
            with _LOCK:
                cls: Callable[..., Any] | None = _TYPES.get(name) if isinstance(name, str) else None
            if cls is None:
                raise PlainDataError(f"{where}: state type {name!r} is not registered in this "
                                     "process (its plug-in is not loaded)")
            if not isinstance(fields, dict):
                raise PlainDataError(f"{where}: a damaged {name} (no fields)")
            try:
                return cls(**{k: decode(v, f"{where}.{k}") for k, v in fields.items()})
            except TypeError as e:
                raise PlainDataError(f"{where}: a {name} that does not match its class "
                                     f"({e})") from None
        raise PlainDataError(f"{where}: unknown encoding {kind!r}")
    if type(obj) is list:
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if type(obj) is tuple:
        return tuple(decode(v, f"{where}[{i}]") for i, v in enumerate(obj))
    return obj
