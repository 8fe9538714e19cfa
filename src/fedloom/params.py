"""Model parameters as one flat vector.

Every method in fedloom works on a model's trainable parameters flattened into
one vector ``w ∈ R^d``. A :class:`Layout` records where each named tensor lives
in that vector and how tensors form **layer groups** (the unit of CRAFT's
per-layer correction; see :mod:`fedloom.aggregate.craft`).

Layer groups: the parameters owned directly by one module form a group (weight
and bias together); a normalisation layer's parameters join the group of the
module registered just before it under the same parent (a conv followed by its
GroupNorm is one group), as in CRAFT's public code where a block's norm layer
is treated as part of the preceding convolution.
A BatchNorm layer's affine parameters group the same way; its running
statistics are buffers, not parameters, and are not in ``w`` at all
(:mod:`fedloom.buffers`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["Group", "Layout", "TensorSpec", "functional_forward", "training_mode"]

_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.GroupNorm,
    nn.LayerNorm,
    nn.LocalResponseNorm,
)
if hasattr(nn, "RMSNorm"):
    _NORM_TYPES = (*_NORM_TYPES, nn.RMSNorm)


@dataclass(frozen=True)
class TensorSpec:
    """One named tensor inside the flat vector: ``w[offset : offset + numel]``."""

    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def slice(self) -> slice:
        return slice(self.offset, self.offset + self.numel)


@dataclass(frozen=True)
class Group:
    """A layer group: consecutive tensors ``[start, stop)`` of the flat vector."""

    name: str
    tensors: tuple[str, ...]
    start: int
    stop: int

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)

    @property
    def size(self) -> int:
        return self.stop - self.start


class Layout:
    """Named tensors and layer groups over one flat float vector.

    Args:
        specs: ``(name, shape)`` pairs in flattening order.
        groups: lists of tensor names; each list must be a run of consecutive
            tensors, and together they must cover every tensor exactly once.
            ``None`` puts every tensor in its own group.
    """

    def __init__(
        self,
        specs: Sequence[tuple[str, Sequence[int]]],
        groups: Sequence[Sequence[str]] | None = None,
    ) -> None:
        tensors: list[TensorSpec] = []
        offset = 0
        seen: set[str] = set()
        for name, shape in specs:
            if name in seen:
                raise ValueError(f"Layout: duplicate tensor name {name!r}")
            seen.add(name)
            spec = TensorSpec(name, tuple(int(s) for s in shape), offset)
            tensors.append(spec)
            offset += spec.numel
        self.tensors: tuple[TensorSpec, ...] = tuple(tensors)
        self.size: int = offset
        self._by_name = {t.name: t for t in self.tensors}
        if groups is None:
            groups = [[t.name] for t in self.tensors]
        self.groups: tuple[Group, ...] = self._make_groups(groups)

    def _make_groups(self, groups: Sequence[Sequence[str]]) -> tuple[Group, ...]:
        order = [t.name for t in self.tensors]
        flat = [n for g in groups for n in g]
        if flat != order:
            raise ValueError(
                "Layout: groups must list every tensor once, in flattening order"
            )
        out = []
        for names in groups:
            if not names:
                raise ValueError("Layout: empty layer group")
            first, last = self._by_name[names[0]], self._by_name[names[-1]]
            gname = _common_prefix(names)
            out.append(Group(gname, tuple(names), first.offset, last.offset + last.numel))
        return tuple(out)

    # ----------------------------------------------------------------- builders
    @classmethod
    def flat(cls, d: int, name: str = "w") -> Layout:
        """A one-tensor layout of size ``d`` (raw vectors, tests)."""
        if d <= 0:
            raise ValueError(f"Layout.flat: d must be positive, got {d}")
        return cls([(name, (d,))])

    @classmethod
    def from_module(cls, module: nn.Module) -> Layout:
        """The layout of ``module``'s trainable parameters, with layer groups.

        Tensors are ordered as ``module.named_parameters()``. Each module that
        owns parameters directly starts a group, except a normalisation layer
        whose previous sibling (same parent) owns parameters: it joins that group.

        >>> from torch import nn
        >>> net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 2))
        >>> layout = Layout.from_module(net)
        >>> layout.size
        29
        >>> [g.tensors for g in layout.groups]  # the BatchNorm joins the Linear before it
        [('0.weight', '0.bias', '1.weight', '1.bias'), ('3.weight', '3.bias')]
        >>> layout["3.weight"]
        TensorSpec(name='3.weight', shape=(2, 3), offset=21)
        """
        own_groups = getattr(module, "fedloom_layer_groups", None)
        if callable(own_groups):
            # The module names its groups (fedloom.models.llm: a LoRA adapter's A and B
            # are two modules but one adapted projection, one group).
            shapes = {n: tuple(p.shape) for n, p in module.named_parameters()
                      if p.requires_grad}
            if not shapes:
                raise ValueError("Layout.from_module: the module has no trainable parameters")
            return cls(list(shapes.items()), own_groups())
        specs: list[tuple[str, tuple[int, ...]]] = []
        groups: list[list[str]] = []
        last_parent: dict[str, int] = {}  # parent path -> index of its last group
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        for mod_name, mod in module.named_modules():
            own = [
                (f"{mod_name}.{n}" if mod_name else n, p)
                for n, p in mod.named_parameters(recurse=False)
            ]
            own = [(n, p) for n, p in own if n in trainable]
            if not own:
                continue
            for n, p in own:
                specs.append((n, tuple(p.shape)))
            names = [n for n, _ in own]
            parent = mod_name.rpartition(".")[0]
            prev = last_parent.get(parent)
            if isinstance(mod, _NORM_TYPES) and prev is not None and prev == len(groups) - 1:
                groups[prev].extend(names)
            else:
                groups.append(names)
            last_parent[parent] = len(groups) - 1
        if not specs:
            raise ValueError("Layout.from_module: the module has no trainable parameters")
        order = [n for n, p in module.named_parameters() if p.requires_grad]
        if [n for g in groups for n in g] != order:
            # Shared or re-registered parameters: fall back to per-tensor groups
            # in named_parameters() order, which is always consistent.
            shapes = dict((n, tuple(p.shape)) for n, p in module.named_parameters())
            return cls([(n, shapes[n]) for n in order])
        return cls(specs, groups)

    def regroup(self, mode: str) -> Layout:
        """``"layer"`` keeps the layer groups; ``"global"`` makes one group."""
        if mode == "layer":
            return self
        if mode == "global":
            return Layout([(t.name, t.shape) for t in self.tensors], [self.names])
        raise ValueError(f"Layout.regroup: unknown mode {mode!r} (expected 'layer' or 'global')")

    # ---------------------------------------------------------------- accessors
    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def __getitem__(self, name: str) -> TensorSpec:
        return self._by_name[name]

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Layout)
            and self.tensors == other.tensors
            and self.groups == other.groups
        )

    def __hash__(self) -> int:
        return hash((self.tensors, self.groups))

    def __repr__(self) -> str:
        return f"Layout(d={self.size}, tensors={len(self.tensors)}, groups={len(self.groups)})"

    def lora_pairs(self) -> tuple[tuple[int, int, int, int, int], ...]:
        """The LoRA adapters: ``(a_offset, r, fan_in, b_offset, fan_out)`` for each
        ``….lora_A.…`` tensor ``[r, in]`` whose ``….lora_B.…`` namesake ``[out, r]``
        is in the same layer group (:mod:`fedloom.models.llm` groups them per
        adapted projection). Read by the LoRA-aware aggregators and local methods."""
        pairs: list[tuple[int, int, int, int, int]] = []
        for g in self.groups:
            for name in g.tensors:
                if ".lora_A." not in name:
                    continue
                b_name = name.replace(".lora_A.", ".lora_B.", 1)
                if b_name not in g.tensors:
                    continue
                a, b = self[name], self[b_name]
                if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]:
                    raise ValueError(f"{name} {a.shape} and {b_name} {b.shape} are not a "
                                     "LoRA pair (A [r, in], B [out, r])")
                pairs.append((a.offset, a.shape[0], a.shape[1], b.offset, b.shape[0]))
        return tuple(pairs)

    def lora_rank_cut(self, rank: int) -> torch.Tensor:
        """The coordinates a client of LoRA rank ``rank`` does not hold (bool ``[d]``):
        the rows ``rank:`` of every adapter's ``A`` and the columns ``rank:`` of its
        ``B`` (HetLoRA's truncation: that client's ``B A`` is the first ``rank`` terms
        of the full one's)."""
        cut = torch.zeros(self.size, dtype=torch.bool)
        for a0, r, fin, b0, fout in self.lora_pairs():
            if rank < r:
                cut[a0 + rank * fin:a0 + r * fin] = True
                cut[b0:b0 + fout * r].view(fout, r)[:, rank:] = True
        return cut

    # ----------------------------------------------------------- (un)flattening
    def flatten(self, tensors: Mapping[str, torch.Tensor] | nn.Module) -> torch.Tensor:
        """Concatenate named tensors (or a module's parameters) into one vector."""
        if isinstance(tensors, nn.Module):
            tensors = dict(tensors.named_parameters())
        missing = [n for n in self.names if n not in tensors]
        if missing:
            raise KeyError(f"Layout.flatten: missing tensors {missing}")
        for t in self.tensors:
            if tuple(tensors[t.name].shape) != t.shape:
                raise ValueError(
                    f"Layout.flatten: {t.name} has shape {tuple(tensors[t.name].shape)}, "
                    f"expected {t.shape}"
                )
        return torch.cat([tensors[n].detach().reshape(-1) for n in self.names])

    def unflatten(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``w`` shaped as the named tensors (gradients flow into ``w``)."""
        if w.ndim != 1 or w.shape[0] != self.size:
            raise ValueError(f"Layout.unflatten: expected a vector of size {self.size}, "
                             f"got shape {tuple(w.shape)}")
        return {t.name: w[t.slice].view(t.shape) for t in self.tensors}

    def load_into(self, module: nn.Module, w: torch.Tensor) -> None:
        """Copy ``w`` into ``module``'s parameters in place."""
        params = dict(module.named_parameters())
        with torch.no_grad():
            for name, view in self.unflatten(w).items():
                params[name].copy_(view)


def lora_default_ranks(r: int) -> tuple[int, ...]:
    """HetLoRA's client ranks when none are given (:mod:`fedloom.client.hetlora`,
    :class:`fedloom.aggregate.lora.HetLoRA`): ``(r/4, r/2, r)`` rounded down, at least
    1 — three device classes, (2, 4, 8) for rank-8 adapters."""
    return (max(1, r // 4), max(1, r // 2), r)


def functional_forward(
    module: nn.Module, layout: Layout, w: torch.Tensor, *args: torch.Tensor,
    buffers: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Run ``module`` with its parameters taken from the flat vector ``w`` (and
    the named ``buffers``, e.g. BatchNorm statistics, where given; the module's
    own otherwise).

    Uses :func:`torch.func.functional_call`; autograd flows into ``w``, so one
    backward pass gives the flat gradient ``∇_w f`` directly. The module runs in
    whatever mode it is in (see :func:`training_mode`).
    """
    tensors = layout.unflatten(w)
    if buffers:
        tensors = {**tensors, **buffers}
    out: torch.Tensor = functional_call(module, tensors, args)
    return out


@contextmanager
def training_mode(module: nn.Module, mode: bool) -> Iterator[nn.Module]:
    """``module`` in train (``True``) or eval (``False``) mode for a block, each
    submodule's own flag restored after."""
    flags = [(m, m.training) for m in module.modules()]
    module.train(mode)
    try:
        yield module
    finally:
        for m, f in flags:
            m.training = f


def _common_prefix(names: Sequence[str]) -> str:
    if len(names) == 1:
        return names[0].rpartition(".")[0] or names[0]
    parts = [n.split(".") for n in names]
    prefix: list[str] = []
    for level in zip(*parts, strict=False):
        if all(p == level[0] for p in level):
            prefix.append(level[0])
        else:
            break
    return ".".join(prefix) or names[0]
