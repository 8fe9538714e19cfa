"""A stock Flower app's model as fedloom sees it: the ``ArrayRecord`` of a state dict.

A ClientApp written the way Flower's PyTorch examples write it sends and
receives ``ArrayRecord(model.state_dict())``: every parameter *and* every
buffer (BatchNorm's running statistics, ``num_batches_tracked``) by name, in
the module's order. :class:`StateLayout` splits such a record into

- the **parameters**, flattened into fedloom's vector ``w`` with a
  :class:`~fedloom.params.Layout` whose layer groups are CRAFT's units, and
- the **buffers**, which are averaged (or kept), never solved for.

With ``model=`` the module's trainable parameters are the parameters and the
groups are :meth:`Layout.from_module`'s; without, the names decide (BatchNorm's
statistics and non-floating tensors are buffers). Checked: for fedloom's ``mlp``,
``cnn``, ``resnet`` and ``craft_cnn`` the key-derived layout equals
``Layout.from_module``'s (tests/test_flower_strategies.py). :meth:`join` writes
the same keys, order and dtypes back. The rules in detail: docs/deploy.md (How a
record splits into parameters and buffers).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import SupportsFloat, SupportsInt, cast

import torch
from torch import nn

from fedloom.params import Layout

try:
    from flwr.app import ArrayRecord
except ImportError as e:  # pragma: no cover (the extra is missing)
    raise ImportError("fedloom.integrations.flower needs Flower: pip install 'fedloom[flower]'"
                      ) from e

__all__ = ["BATCHNORM_BUFFERS", "StateLayout", "pack_buffers", "state_dict_of",
           "unpack_buffers"]

# Flower types a record's value as the union of all a record may hold (numbers,
# strings, bytes, lists); the keys fedloom reads hold the scalar it wrote. These are
# int(), float() and bytes() as before: a reply holding something else fails in them.
def rec_int(value: object) -> int:
    return int(cast(SupportsInt, value))


def rec_float(value: object) -> float:
    return float(cast(SupportsFloat, value))


def rec_bytes(value: object) -> bytes:
    return bytes(cast(bytes, value))


# A MetricRecord's values (flwr's MetricRecordValues).
MetricValue = int | float | list[int] | list[float]

# The buffers PyTorch's BatchNorm layers register (torch.nn.modules.batchnorm).
BATCHNORM_BUFFERS = frozenset({"running_mean", "running_var", "num_batches_tracked"})


def state_dict_of(rec: object, what: str = "arrays") -> OrderedDict[str, torch.Tensor]:
    """The tensors of an ArrayRecord, in order (a one-line ``ValueError`` naming
    ``what`` when it is not an ArrayRecord or holds an array torch cannot take)."""
    if not isinstance(rec, ArrayRecord):
        raise ValueError(f"{what}: a {type(rec).__name__}, not an ArrayRecord")
    try:
        return OrderedDict(rec.to_torch_state_dict())
    except (TypeError, RuntimeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{what}: {first}") from None


@dataclass(frozen=True)
class StateLayout:
    """Where each key of a state-dict record goes (see the module doc)."""

    layout: Layout                          # the parameters, with layer groups
    keys: tuple[str, ...]                   # every key, in the record's order
    buffers: tuple[str, ...]                # the keys that are not parameters
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, torch.dtype]

    @classmethod
    def from_arrays(cls, rec: ArrayRecord, *, model: nn.Module | None = None,
                    buffers: Iterable[str] | Callable[[str], bool] | None = None
                    ) -> StateLayout:
        sd = state_dict_of(rec)
        if not sd:
            raise ValueError("arrays: the record holds no tensor")
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
        dtypes = {k: v.dtype for k, v in sd.items()}
        if model is not None:
            layout = Layout.from_module(model)
            missing = [n for n in layout.names if n not in sd]
            if missing:
                raise ValueError(f"arrays: no tensor {missing[0]!r} of the model in the record")
            for t in layout.tensors:
                if shapes[t.name] != t.shape:
                    raise ValueError(f"arrays: tensor {t.name!r} has shape {shapes[t.name]}, "
                                     f"the model has {t.shape}")
            params = set(layout.names)
            order = [k for k in sd if k in params]
            if order != layout.names:
                raise ValueError("arrays: the record's parameters are not in the model's order")
        else:
            is_buffer = _buffer_rule(buffers)
            names = [k for k, v in sd.items() if v.is_floating_point() and not is_buffer(k)]
            if not names:
                raise ValueError("arrays: no floating-point parameter in the record")
            layout = Layout([(k, shapes[k]) for k in names], _groups(list(sd), names))
            params = set(names)
        return cls(layout, tuple(sd), tuple(k for k in sd if k not in params), shapes, dtypes)

    def split(self, rec: object, dtype: torch.dtype, what: str = "arrays"
              ) -> tuple[torch.Tensor, OrderedDict[str, torch.Tensor]]:
        """``(w, buffers)`` of a record of this layout: ``w`` flat in ``dtype``; the
        buffers as they are. A missing, extra or misshapen key, or a parameter that
        is not floating point, raises a one-line ``ValueError`` naming it."""
        sd = state_dict_of(rec, what)
        if tuple(sd) != self.keys:
            extra = [k for k in sd if k not in self.shapes]
            missing = [k for k in self.keys if k not in sd]
            why = (f"unknown tensor {extra[0]!r}" if extra else
                   f"no tensor {missing[0]!r}" if missing else "the tensors are in another order")
            raise ValueError(f"{what}: {why}")
        for k, v in sd.items():
            if tuple(v.shape) != self.shapes[k]:
                raise ValueError(f"{what}: tensor {k!r} has shape {tuple(v.shape)}, "
                                 f"expected {self.shapes[k]}")
        for t in self.layout.tensors:
            if not sd[t.name].is_floating_point():
                raise ValueError(f"{what}: parameter {t.name!r} is {sd[t.name].dtype}")
        w = torch.cat([sd[t.name].reshape(-1).to(dtype) for t in self.layout.tensors])
        bufs = OrderedDict((k, sd[k]) for k in self.buffers)
        return w, bufs

    def cast_buffers(self, bufs: Mapping[str, torch.Tensor], what: str = "buffers"
                     ) -> OrderedDict[str, torch.Tensor]:
        """``bufs`` (of :meth:`split`) in the record's dtypes. A buffer that holds a
        value its dtype cannot (``num_batches_tracked`` sent as float32 ``1e30``, or
        ``2.5``, NaN) raises a one-line ``ValueError`` naming it: cast, it would
        wrap to ``−2**63`` and become the global count."""
        out: OrderedDict[str, torch.Tensor] = OrderedDict()
        for k, v in bufs.items():
            dt = self.dtypes[k]
            if v.dtype != dt and v.is_floating_point() and not dt.is_floating_point:
                x = v.double()
                info = torch.iinfo(dt) if dt != torch.bool else None
                bad = ~torch.isfinite(x) | (x != torch.round(x))
                if info is not None:
                    # the int64 bounds, as float64 (2**63 itself is out of range)
                    bad |= (x < float(info.min)) | (x >= -float(info.min))
                if bool(bad.any()):
                    first = float(x[bad].reshape(-1)[0])
                    raise ValueError(f"{what}: {k!r} holds {first:g} as {v.dtype}, not a "
                                     f"{dt} value")
            out[k] = v if v.dtype == dt else v.to(dt)
        return out

    def join(self, w: torch.Tensor, buffers: Mapping[str, torch.Tensor]) -> ArrayRecord:
        """The record of ``w`` and ``buffers``: this layout's keys, order and dtypes."""
        params = self.layout.unflatten(w.detach())
        out = OrderedDict()
        for k in self.keys:
            v = params[k] if k in params else buffers[k]
            out[k] = v.detach().to(self.dtypes[k]).cpu().clone()
        return ArrayRecord(out)


def _buffer_rule(buffers: Iterable[str] | Callable[[str], bool] | None
                 ) -> Callable[[str], bool]:
    if callable(buffers):
        return buffers
    named = frozenset(buffers or ())
    return lambda k: k in named or k.rpartition(".")[2] in BATCHNORM_BUFFERS


def _groups(keys: list[str], params: list[str]) -> list[list[str]]:
    """Layer groups from the names: one per module prefix; a module holding
    BatchNorm statistics joins the previous group under the same parent."""
    has_stats = {k.rpartition(".")[0] for k in keys
                 if k.rpartition(".")[2] in BATCHNORM_BUFFERS}
    groups: list[list[str]] = []
    last_parent: dict[str, int] = {}   # parent path -> index of its last group
    prev_module: str | None = None
    for name in params:
        module = name.rpartition(".")[0]
        if module == prev_module and groups:
            groups[-1].append(name)
            continue
        parent = module.rpartition(".")[0]
        prev = last_parent.get(parent)
        if module in has_stats and prev is not None and prev == len(groups) - 1:
            groups[prev].append(name)
        else:
            groups.append([name])
        last_parent[parent] = len(groups) - 1
        prev_module = module
    return groups


def pack_buffers(sl: StateLayout, bufs: Mapping[str, torch.Tensor]) -> bytes:
    """The buffers as raw bytes: each in the layout's order, its own dtype, C order,
    little-endian (what a compressed reply carries beside its payload)."""
    parts = []
    for k in sl.buffers:
        v = bufs[k].detach().cpu().contiguous()
        if v.dtype != sl.dtypes[k] or tuple(v.shape) != sl.shapes[k]:
            raise ValueError(f"buffers: {k!r} is {v.dtype} {tuple(v.shape)}, the record's "
                             f"{sl.dtypes[k]} {sl.shapes[k]}")
        parts.append(v.numpy().astype(v.numpy().dtype.newbyteorder("<"), copy=False).tobytes())
    return b"".join(parts)


def unpack_buffers(sl: StateLayout, data: object) -> OrderedDict[str, torch.Tensor]:
    """The inverse of :func:`pack_buffers`; a length that is not the layout's raises
    a one-line ``ValueError``."""
    import numpy as np

    if not isinstance(data, bytes):
        raise ValueError(f"buffers: a {type(data).__name__}, not bytes")
    out: OrderedDict[str, torch.Tensor] = OrderedDict()
    pos = 0
    for k in sl.buffers:
        dt = np.dtype(torch.empty(0, dtype=sl.dtypes[k]).numpy().dtype).newbyteorder("<")
        n = int(np.prod(sl.shapes[k], dtype=np.int64)) * dt.itemsize
        if pos + n > len(data):
            raise ValueError(f"buffers: {len(data)} bytes, the model's buffers need more")
        arr = np.frombuffer(data, dtype=dt, count=n // dt.itemsize, offset=pos)
        out[k] = torch.from_numpy(arr.astype(dt.newbyteorder("="))).reshape(sl.shapes[k])
        pos += n
    if pos != len(data):
        raise ValueError(f"buffers: {len(data)} bytes, the model's buffers take {pos}")
    return out
