"""Lock-step's plan: the model traced by ``torch.fx`` into a chain of ops, one frozen
dataclass per kind of layer (``_Linear``, ``_Conv``, ``_MaxPool``, … ``_BatchNorm``;
``_Op`` is their union), each with the fields of its kind only.

:func:`lockstep_plan` turns a module into the list of ops one step runs
(:mod:`fedloom.engine.trainers.lockstep.step`), or says in one line why it cannot.

Supported: models ``torch.fx`` traces to a chain of ``nn.Linear``, ``nn.Conv2d``
(``groups = 1``, no ``"same"`` padding), ``nn.MaxPool2d``, ``nn.AvgPool2d``,
``nn.Dropout``, ``nn.GroupNorm``, ``nn.BatchNorm1d/2d``, ReLU, Flatten and
Identity, ending in the logits, trained with plain SGD/FedProx. Everything else
(other layers, residual networks, other local methods, ``client.amp``,
augmentation) trains on the sequential path with one log line naming why. The
full list of conditions: docs/explanation/backends.md (Which models).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, TypeAlias, cast

import torch
from torch import nn
from torch.nn import functional as F

from fedloom.buffers import buffer_names
from fedloom.params import Layout


@dataclass(frozen=True)
class _Linear:
    """``nn.Linear``: its weight/bias slices of ``w`` and ``shape = (out, in)``."""

    kind: ClassVar[str] = "linear"
    params: ClassVar[bool] = True
    weight: slice
    bias: slice | None
    shape: tuple[int, int]


@dataclass(frozen=True)
class _Conv:
    """``nn.Conv2d`` (``groups = 1``): weight/bias slices, ``shape = (out, in, kh, kw)``
    and its geometry as pairs."""

    kind: ClassVar[str] = "conv"
    params: ClassVar[bool] = True
    weight: slice
    bias: slice | None
    shape: tuple[int, int, int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]


@dataclass(frozen=True)
class _MaxPool:
    """``nn.MaxPool2d`` (without ``return_indices``), its geometry as pairs."""

    kind: ClassVar[str] = "maxpool"
    params: ClassVar[bool] = False
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    dilation: tuple[int, int]
    ceil_mode: bool


@dataclass(frozen=True)
class _AvgPool:
    """``nn.AvgPool2d``, its geometry as pairs; ``divisor``: its ``divisor_override``."""

    kind: ClassVar[str] = "avgpool"
    params: ClassVar[bool] = False
    kernel: tuple[int, int]
    stride: tuple[int, int]
    padding: tuple[int, int]
    ceil_mode: bool
    count_include_pad: bool
    divisor: int | None


@dataclass(frozen=True)
class _Flatten:
    """Flatten the per-sample dims ``start..end`` into one, as ``nn.Flatten`` counts them
    (the batch is dim 0; ``start`` is always 1)."""

    kind: ClassVar[str] = "flatten"
    params: ClassVar[bool] = False
    start: int
    end: int


@dataclass(frozen=True)
class _Relu:
    """ReLU (``nn.ReLU``, ``torch.relu``, ``F.relu``), not in place."""

    kind: ClassVar[str] = "relu"
    params: ClassVar[bool] = False


@dataclass(frozen=True)
class _Dropout:
    """``nn.Dropout`` with ``0 < p < 1``, not in place."""

    kind: ClassVar[str] = "dropout"
    params: ClassVar[bool] = False
    p: float


@dataclass(frozen=True)
class _GroupNorm:
    """Affine ``nn.GroupNorm``: weight/bias slices, ``channels``, ``groups`` and ε."""

    kind: ClassVar[str] = "groupnorm"
    params: ClassVar[bool] = True
    weight: slice
    bias: slice
    channels: int
    groups: int
    eps: float


@dataclass(frozen=True)
class _BatchNorm:
    """``nn.BatchNorm1d/2d``: weight/bias slices (``None`` without affine parameters),
    ``features``, ε, ``momentum`` (``None``: the cumulative average), ``stats`` (its
    buffers' names, ``None`` without running statistics) and ``dims`` (the per-sample
    ranks it takes)."""

    kind: ClassVar[str] = "batchnorm"
    weight: slice | None
    bias: slice | None
    features: int
    eps: float
    momentum: float | None
    stats: tuple[str, str, str] | None
    dims: tuple[int, ...]

    @property
    def params(self) -> bool:
        return self.weight is not None


# One layer of the chain; each kind's forward and backward: step.py
_Op: TypeAlias = (_Linear | _Conv | _MaxPool | _AvgPool | _Flatten | _Relu | _Dropout | _GroupNorm
       | _BatchNorm)


def lockstep_plan(module: nn.Module, layout: Layout) -> tuple[list[_Op] | None, str | None]:
    """The module as a chain of supported layers, or ``(None, why not)``."""
    names = {n for n, _ in module.named_parameters()}
    if names != set(layout._by_name):
        return None, "the model has frozen parameters"
    import torch.fx  # only here: tracing is this backend's business

    try:
        gm = torch.fx.symbolic_trace(module)
    except Exception as e:  # anything fx cannot trace is not a chain we know
        return None, f"the model cannot be traced by torch.fx ({type(e).__name__})"
    mods = dict(module.named_modules())
    ops: list[_Op] = []
    prev = None
    seen: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if prev is not None:
                return None, "the model takes more than one input"
            prev = node
            continue
        if node.op == "output":
            if node.args[0] is not prev:
                return None, "the model's output is not the last layer's"
            break
        tensors = [a for a in node.all_input_nodes]
        # the first check makes prev this node's input, a graph node
        if tensors != [prev] or len(cast("torch.fx.Node", prev).users) != 1:
            return None, f"the model is not a chain of layers (at {node.name})"
        op = _as_op(node, mods, layout, seen)
        if isinstance(op, str):
            return None, op
        if op is not None:
            ops.append(op)
        prev = node
    if not any(o.params for o in ops):
        return None, "the model has no Linear or Conv2d layer"
    # every buffer must be a BatchNorm's running statistics (per client, see _train)
    owned = {n for o in ops if isinstance(o, _BatchNorm) and o.stats is not None
             for n in o.stats}
    other = [n for n in buffer_names(module) if n not in owned]
    if other:
        return None, f"the model has buffers other than BatchNorm's ({other[0]})"
    return ops, None


def _as_op(node, mods: dict[str, nn.Module], layout: Layout,
           seen: set[str]) -> _Op | str | None:
    """The node as an op, ``None`` for an identity, or why it is not supported."""
    if node.op == "call_module":
        if node.target in seen:
            return "a layer is called twice (shared weights)"
        seen.add(node.target)
        mod = mods[node.target]
        if isinstance(mod, nn.Identity):
            return None
        if isinstance(mod, nn.ReLU):
            return _Relu()
        if isinstance(mod, nn.Flatten):
            return _flatten(mod.start_dim, mod.end_dim)
        if type(mod) is nn.Linear:
            p = node.target + "."
            w = layout._by_name[p + "weight"]
            b = layout._by_name.get(p + "bias")
            return _Linear(w.slice, b.slice if b is not None else None,
                           (mod.out_features, mod.in_features))
        if type(mod) is nn.Conv2d:
            return _conv(node.target, mod, layout)
        if type(mod) in (nn.MaxPool2d, nn.AvgPool2d):
            return _pool(node.target, cast("nn.MaxPool2d | nn.AvgPool2d", mod))
        if type(mod) is nn.GroupNorm:
            if not mod.affine:
                return f"GroupNorm without affine parameters ({node.target}) is not supported"
            w = layout._by_name[node.target + ".weight"]
            b = layout._by_name[node.target + ".bias"]
            return _GroupNorm(w.slice, b.slice, mod.num_channels, mod.num_groups,
                              float(mod.eps))
        if type(mod) in (nn.BatchNorm1d, nn.BatchNorm2d):
            return _batchnorm(node.target, cast("nn.BatchNorm1d | nn.BatchNorm2d", mod), layout)
        if type(mod) is nn.Dropout:
            if mod.inplace:
                return f"in-place Dropout ({node.target}) is not supported"
            if mod.p == 0:  # torch's dropout returns its input and draws nothing
                return None
            if mod.p >= 1:
                return f"Dropout(p={mod.p}) ({node.target}) is not supported"
            return _Dropout(float(mod.p))
        return f"layer {type(mod).__name__} ({node.target}) is not supported"
    if node.op == "call_function" and node.target in (torch.relu, F.relu):
        if node.kwargs.get("inplace") or len(node.args) > 1:
            return "in-place relu is not supported"
        return _Relu()
    if node.op == "call_function" and node.target is torch.flatten:
        a, kw = node.args, node.kwargs
        start = a[1] if len(a) > 1 else kw.get("start_dim", 0)
        end = a[2] if len(a) > 2 else kw.get("end_dim", -1)
        return _flatten(start, end)
    return f"operation {node.target} ({node.name}) is not supported"


def _conv(name: str, mod: nn.Conv2d, layout: Layout) -> _Op | str:
    if mod.groups != 1:
        return f"a grouped Conv2d ({name}, groups={mod.groups}) is not supported"
    if mod.padding_mode != "zeros":
        return f"Conv2d padding_mode {mod.padding_mode} ({name}) is not supported"
    pad = mod.padding
    if isinstance(pad, str):
        if pad != "valid":  # "same" may pad asymmetrically: another kernel call
            return f"Conv2d padding='{pad}' ({name}) is not supported"
        pad = (0, 0)
    w = layout._by_name[name + ".weight"]
    b = layout._by_name.get(name + ".bias")
    kh, kw = mod.kernel_size
    return _Conv(w.slice, b.slice if b is not None else None,
                 (mod.out_channels, mod.in_channels, kh, kw), _pair(mod.stride), _pair(pad),
                 _pair(mod.dilation))


def _batchnorm(name: str, mod: nn.BatchNorm1d | nn.BatchNorm2d,
               layout: Layout) -> _BatchNorm:
    w = layout._by_name.get(name + ".weight") if mod.affine else None
    b = layout._by_name.get(name + ".bias") if mod.affine else None
    stats = None
    if mod.track_running_stats:
        stats = (f"{name}.running_mean", f"{name}.running_var", f"{name}.num_batches_tracked")
    return _BatchNorm(w.slice if w is not None else None, b.slice if b is not None else None,
                      mod.num_features, float(mod.eps),
                      None if mod.momentum is None else float(mod.momentum), stats,
                      (1, 2) if isinstance(mod, nn.BatchNorm1d) else (3,))


def _pool(name: str, mod: nn.MaxPool2d | nn.AvgPool2d) -> _Op | str:
    k = _pair(mod.kernel_size)
    # nn's pools take stride None (or empty) for "the kernel size"
    stride = _pair(mod.stride) if mod.stride not in (None, ()) else k
    if isinstance(mod, nn.MaxPool2d):
        if mod.return_indices:
            return f"MaxPool2d with return_indices ({name}) is not supported"
        return _MaxPool(k, stride, _pair(mod.padding), _pair(mod.dilation),
                        bool(mod.ceil_mode))
    return _AvgPool(k, stride, _pair(mod.padding), bool(mod.ceil_mode),
                    bool(mod.count_include_pad), mod.divisor_override)


def _pair(v) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    t = tuple(int(x) for x in v)
    return (t[0], t[0]) if len(t) == 1 else (t[0], t[1])


def _flatten(start: int = 1, end: int = -1) -> _Op | str:
    if start != 1:
        return "a flatten that merges the batch dimension is not supported"
    return _Flatten(start, end)
