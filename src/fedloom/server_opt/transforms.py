"""The server step as one chain of transforms, in the manner of optax.

A transform holds its settings; ``init(w)`` gives its state (a mapping of named
tensors) and ``update(d, state, w)`` returns the new direction and its new
entries of the state. :func:`chain` composes them, and its :meth:`Chain.step`
is the server optimizer's ``w ← w − chain(agg)`` (the interface the engine
calls: ``init(w)`` and ``step(w, agg, state) → (w, state)``)::

    chain(momentum(0.9), scale(0.5))      # FedAvgM at η = 0.5
    chain(adam(0.9, 0.99, 1e-3), scale(0.01))   # FedAdam at η = 0.01

The chain's state is one flat mapping (what a checkpoint stores as
``opt_state``): each transform keeps its entries under its own names (``v``,
``m``; ``prefix`` renames them, for two transforms of a kind in one chain), so
the named optimizers keep the keys they always had.

Transforms never modify ``d`` or the state in place: the engine keeps the old
state when a step is not finite, and reads the aggregate after the step.

A preconditioner (:class:`Adam`, :class:`Yogi`, :class:`Adagrad`) gives its
direction as a numerator and a denominator; in a chain, the scales right after
it multiply the numerator before the division, ``(η·m)/(√v + τ)``: the same
step as ``η·(m/(√v + τ))`` in exact arithmetic, and bit for bit the step of the
optimizers these chains replace (they evaluated it in that order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["Adagrad", "Adam", "Chain", "Momentum", "Preconditioner", "Scale",
           "ServerTransform", "State", "Yogi", "adagrad", "adam", "chain", "momentum",
           "scale", "yogi"]

State = dict[str, torch.Tensor]


class ServerTransform(Protocol):
    """One term of the server step: ``init(w)`` → its state; ``update(d, state,
    w)`` → the new direction and the new values of its own state entries
    (``state`` may hold other transforms' entries too)."""

    def init(self, w: torch.Tensor) -> State: ...

    def update(self, d: torch.Tensor, state: State, w: torch.Tensor
               ) -> tuple[torch.Tensor, State]: ...


@dataclass(frozen=True)
class Scale:
    """``d ← η·d`` (a step size; after a preconditioner, on its numerator)."""

    factor: float

    def init(self, w: torch.Tensor) -> State:
        return {}

    def update(self, d: torch.Tensor, state: State, w: torch.Tensor
               ) -> tuple[torch.Tensor, State]:
        return self.factor * d, {}


@dataclass(frozen=True)
class Momentum:
    """Heavy ball: ``v ← β·v + d``, the direction is ``v`` (FedAvgM: Hsu, Qi &
    Brown 2019). State ``v``, zero at the start; no dampening."""

    beta: float
    prefix: str = ""

    def init(self, w: torch.Tensor) -> State:
        return {self.prefix + "v": torch.zeros_like(w)}

    def update(self, d: torch.Tensor, state: State, w: torch.Tensor
               ) -> tuple[torch.Tensor, State]:
        v = self.beta * state[self.prefix + "v"] + d
        return v, {self.prefix + "v": v}


class Preconditioner:
    """A transform whose direction is ``num / den``; :meth:`precondition` gives
    the two apart (so that a chain's following scales apply to ``num``)."""

    def init(self, w: torch.Tensor) -> State:
        raise NotImplementedError

    def precondition(self, d: torch.Tensor, state: State, w: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, State]:
        raise NotImplementedError

    def update(self, d: torch.Tensor, state: State, w: torch.Tensor
               ) -> tuple[torch.Tensor, State]:
        num, den, new = self.precondition(d, state, w)
        return num / den, new


@dataclass(frozen=True)
class Adam(Preconditioner):
    """FedAdam (Reddi et al. 2021, Algorithm 2): ``m ← β₁m + (1−β₁)d``,
    ``v ← β₂v + (1−β₂)d²``, the direction ``m/(√v + τ)``. As in the paper, no
    bias correction; ``v`` starts at ``τ²``. State ``m``, ``v``."""

    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-3
    prefix: str = ""

    def init(self, w: torch.Tensor) -> State:
        # "v" first: the order the pre-move optimizer wrote (a checkpoint's opt_state)
        return {self.prefix + "v": torch.full_like(w, self.eps**2),
                self.prefix + "m": torch.zeros_like(w)}

    def _second(self, v: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
        return self.b2 * v + (1 - self.b2) * sq

    def precondition(self, d: torch.Tensor, state: State, w: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, State]:
        p = self.prefix
        sq = d * d
        m = self.b1 * state[p + "m"] + (1 - self.b1) * d
        v = self._second(state[p + "v"], sq)
        return m, v.sqrt() + self.eps, {p + "m": m, p + "v": v}


@dataclass(frozen=True)
class Yogi(Adam):
    """FedYogi (Reddi et al. 2021): as :class:`Adam` with the additive second
    moment ``v ← v − (1−β₂)d²·sign(v − d²)``."""

    def _second(self, v: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.b2) * sq * torch.sign(v - sq)


@dataclass(frozen=True)
class Adagrad(Preconditioner):
    """FedAdagrad (Reddi et al. 2021): ``v ← v + d²``, the direction
    ``d/(√v + τ)``; ``v`` starts at ``τ²``, no first moment. State ``v``."""

    eps: float = 1e-3
    prefix: str = ""

    def init(self, w: torch.Tensor) -> State:
        return {self.prefix + "v": torch.full_like(w, self.eps**2)}

    def precondition(self, d: torch.Tensor, state: State, w: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, State]:
        v = state[self.prefix + "v"] + d * d
        return d, v.sqrt() + self.eps, {self.prefix + "v": v}


@dataclass(frozen=True)
class Chain:
    """The transforms in order, and the server step ``w ← w − chain(agg)``.

    Its state is the union of theirs (two transforms may not keep an entry of
    one name: give one a ``prefix``). A preconditioner's division waits for the
    scales that follow it (see the module docstring)."""

    transforms: tuple[ServerTransform, ...]

    def init(self, w: torch.Tensor) -> State:
        state: State = {}
        for t in self.transforms:
            own = t.init(w)
            clash = sorted(state.keys() & own.keys())
            if clash:
                raise ValueError(f"server chain: two transforms keep the state {clash[0]!r} "
                                 "(give one a prefix)")
            state.update(own)
        return state

    def update(self, d: torch.Tensor, state: State, w: torch.Tensor
               ) -> tuple[torch.Tensor, State]:
        new: State = {}
        den: torch.Tensor | None = None  # a preconditioner's, until a non-scale term
        for t in self.transforms:
            if den is not None and not isinstance(t, Scale):
                d, den = d / den, None
            if isinstance(t, Preconditioner):
                d, den, own = t.precondition(d, state, w)
            else:
                d, own = t.update(d, state, w)
            new.update(own)
        if den is not None:
            d = d / den
        for k, v in state.items():  # entries no transform updated stay as they were
            new.setdefault(k, v)
        return d, new

    def step(self, w: torch.Tensor, agg: torch.Tensor, state: State
             ) -> tuple[torch.Tensor, State]:
        """``w − chain(agg)`` and the new state (the engine's server step)."""
        d, new = self.update(agg, state, w)
        return w - d, new


def chain(*transforms: ServerTransform) -> Chain:
    """The transforms applied one after the other (an empty chain: ``w ← w − agg``)."""
    return Chain(tuple(transforms))


def scale(factor: float) -> Scale:
    """``d ← factor·d``."""
    return Scale(factor)


def momentum(beta: float = 0.9, *, prefix: str = "") -> Momentum:
    """Heavy ball ``v ← β·v + d`` (:class:`Momentum`)."""
    return Momentum(beta, prefix)


def adam(b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3, *, prefix: str = "") -> Adam:
    """FedAdam's ``m/(√v + τ)`` (:class:`Adam`)."""
    return Adam(b1, b2, eps, prefix)


def yogi(b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3, *, prefix: str = "") -> Yogi:
    """FedYogi's ``m/(√v + τ)`` (:class:`Yogi`)."""
    return Yogi(b1, b2, eps, prefix)


def adagrad(eps: float = 1e-3, *, prefix: str = "") -> Adagrad:
    """FedAdagrad's ``d/(√v + τ)`` (:class:`Adagrad`)."""
    return Adagrad(eps, prefix)
