"""One transform protocol for the client's local step and the server's step.

In optax's shape: a transform holds its settings; ``init(w)`` gives its state
and ``update(d, state, ctx)`` returns the new direction and the new state.
:func:`chain` composes transforms: its state is the tuple of theirs, one entry a
transform in order, so two transforms of a kind keep their states apart and
nothing in a chain depends on which transforms it holds. The two sides differ
only in what ``ctx`` is:

- the local step (:mod:`fedloom.client.transforms`): a
  :class:`~fedloom.client.transforms.StepContext` (the step, the parameters
  ``W``, the anchor ``W0``, which rows still step), ``d`` of shape ``[d]`` or
  ``[m, d]`` with one row a client; a transform may update ``d`` and its state
  in place;
- the server step (:mod:`fedloom.server_opt.transforms`): the parameters ``w``
  themselves (optax's ``params``); a transform never modifies ``d`` or its state
  in place (the engine keeps the old state when a step is not finite, and reads
  the aggregate after the step). :meth:`Chain.step` is the server optimizer's
  ``w ← w − chain(agg)``.

A stateless transform's state is ``None``. :class:`Scale` reads no context and
serves both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch

__all__ = ["Chain", "Scale", "Transform", "chain", "scale"]

Ctx = TypeVar("Ctx", contravariant=True)
C = TypeVar("C")


class Transform(Protocol[Ctx]):
    """A term of a step: ``init(w)`` → its state; ``update(d, state, ctx)`` →
    the new direction and the new state."""

    def init(self, w: torch.Tensor) -> Any: ...

    def update(self, d: torch.Tensor, state: Any, ctx: Ctx) -> tuple[torch.Tensor, Any]: ...


@dataclass(frozen=True)
class Chain(Generic[C]):
    """The transforms in order; its state is the tuple of theirs."""

    transforms: tuple[Transform[C], ...]

    def init(self, w: torch.Tensor) -> tuple[Any, ...]:
        return tuple(t.init(w) for t in self.transforms)

    def update(self, d: torch.Tensor, state: tuple[Any, ...], ctx: C
               ) -> tuple[torch.Tensor, tuple[Any, ...]]:
        new = []
        for t, s in zip(self.transforms, state, strict=True):
            d, s = t.update(d, s, ctx)
            new.append(s)
        return d, tuple(new)

    def step(self: Chain[torch.Tensor], w: torch.Tensor, agg: torch.Tensor,
             state: tuple[Any, ...]) -> tuple[torch.Tensor, tuple[Any, ...]]:
        """``w − chain(agg)`` and the new state, the parameters ``w`` the context
        (a chain of server transforms as a server optimizer: ``init``, ``step``)."""
        d, new = self.update(agg, state, w)
        return w - d, new


def chain(*transforms: Transform[C]) -> Chain[C]:
    """The transforms applied one after the other (an empty chain is the identity)."""
    return Chain(tuple(transforms))


@dataclass(frozen=True)
class Scale:
    """``d ← factor·d`` (a step size: the last term of a server optimizer)."""

    factor: float

    def init(self, w: torch.Tensor) -> None:
        return None

    def update(self, d: torch.Tensor, state: None, ctx: object) -> tuple[torch.Tensor, None]:
        return self.factor * d, None


def scale(factor: float) -> Scale:
    """``d ← factor·d`` (:class:`Scale`)."""
    return Scale(factor)
