"""The terms of the server step, transforms of :mod:`fedloom.transforms`.

A transform holds its settings; ``init(w)`` gives its state and
``update(d, state, w)`` returns the new direction and state, the context being
the parameters ``w``. :func:`~fedloom.transforms.chain` composes them, and its
``step`` is the server optimizer's ``w ← w − chain(agg)`` (the interface the
engine calls: ``init(w)`` and ``step(w, agg, state) → (w, state)``)::

    chain(heavy_ball(0.9), scale(0.5))               # FedAvgM at η = 0.5
    chain(scale_by_adam(0.9, 0.99, 1e-3, lr=0.01))   # FedAdam at η = 0.01

Transforms never modify ``d`` or the state in place: the engine keeps the old
state when a step is not finite, and reads the aggregate after the step.

A preconditioner (:func:`scale_by_adam`, :func:`scale_by_yogi`,
:func:`scale_by_adagrad`) gives the direction ``(lr·num)/den``, the order the named
optimizers (:mod:`fedloom.server_opt.optimizers`) have always rounded the step in.

The names differ from the local step's where the meaning does:
:func:`heavy_ball` is the server's momentum (its buffer ``v`` starts at zero and
lives across rounds), :class:`fedloom.client.transforms.Momentum` the local
step's (torch.optim.SGD's, restarted every round). ``momentum``, ``adam``,
``yogi`` and ``adagrad``, these transforms' earlier names, still work and warn.
A chain's state, rounding against ``scale(η)``: docs/explanation/methods.md (Server
transforms in detail).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from fedloom.transforms import Chain, Scale, Transform, chain, scale

__all__ = ["Adagrad", "Adam", "Chain", "HeavyBall", "Scale", "ServerTransform", "State",
           "Yogi", "adagrad", "adam", "chain", "heavy_ball", "momentum", "scale",
           "scale_by_adagrad", "scale_by_adam", "scale_by_yogi", "yogi"]

State = dict[str, torch.Tensor]
# A term of the server step: its context is the parameters w.
ServerTransform = Transform[torch.Tensor]


@dataclass(frozen=True)
class HeavyBall:
    """Heavy ball: ``v ← β·v + d``, the direction is ``v`` (FedAvgM: Hsu, Qi &
    Brown 2019). State ``{"v"}``, zero at the start; no dampening."""

    beta: float

    def init(self, w: torch.Tensor) -> State:
        return {"v": torch.zeros_like(w)}

    def update(self, d: torch.Tensor, state: State, w: torch.Tensor
               ) -> tuple[torch.Tensor, State]:
        v = self.beta * state["v"] + d
        return v, {"v": v}


def _quotient(lr: float, num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``(lr·num)/den`` (``num/den`` at ``lr`` 1: the same bits)."""
    return (num if lr == 1.0 else lr * num) / den


@dataclass(frozen=True)
class Adam:
    """FedAdam (Reddi et al. 2021, Algorithm 2): ``m ← β₁m + (1−β₁)d``,
    ``v ← β₂v + (1−β₂)d²``, the direction ``(lr·m)/(√v + τ)``. As in the paper,
    no bias correction; ``v`` starts at ``τ²``. State ``{"v", "m"}``."""

    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-3
    lr: float = 1.0

    def init(self, w: torch.Tensor) -> State:
        return {"v": torch.full_like(w, self.eps**2), "m": torch.zeros_like(w)}

    def _second(self, v: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
        return self.b2 * v + (1 - self.b2) * sq

    def update(self, d: torch.Tensor, state: State, w: torch.Tensor
               ) -> tuple[torch.Tensor, State]:
        sq = d * d
        m = self.b1 * state["m"] + (1 - self.b1) * d
        v = self._second(state["v"], sq)
        return _quotient(self.lr, m, v.sqrt() + self.eps), {"v": v, "m": m}


@dataclass(frozen=True)
class Yogi(Adam):
    """FedYogi (Reddi et al. 2021): as :class:`Adam` with the additive second
    moment ``v ← v − (1−β₂)d²·sign(v − d²)``."""

    def _second(self, v: torch.Tensor, sq: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.b2) * sq * torch.sign(v - sq)


@dataclass(frozen=True)
class Adagrad:
    """FedAdagrad (Reddi et al. 2021): ``v ← v + d²``, the direction
    ``(lr·d)/(√v + τ)``; ``v`` starts at ``τ²``, no first moment. State ``{"v"}``."""

    eps: float = 1e-3
    lr: float = 1.0

    def init(self, w: torch.Tensor) -> State:
        return {"v": torch.full_like(w, self.eps**2)}

    def update(self, d: torch.Tensor, state: State, w: torch.Tensor
               ) -> tuple[torch.Tensor, State]:
        v = state["v"] + d * d
        return _quotient(self.lr, d, v.sqrt() + self.eps), {"v": v}


def heavy_ball(beta: float = 0.9) -> HeavyBall:
    """The server's momentum ``v ← β·v + d`` (:class:`HeavyBall`)."""
    return HeavyBall(beta)


def scale_by_adam(b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3, *,
                  lr: float = 1.0) -> Adam:
    """FedAdam's ``(lr·m)/(√v + τ)`` (:class:`Adam`)."""
    return Adam(b1, b2, eps, lr)


def scale_by_yogi(b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3, *,
                  lr: float = 1.0) -> Yogi:
    """FedYogi's ``(lr·m)/(√v + τ)`` (:class:`Yogi`)."""
    return Yogi(b1, b2, eps, lr)


def scale_by_adagrad(eps: float = 1e-3, *, lr: float = 1.0) -> Adagrad:
    """FedAdagrad's ``(lr·d)/(√v + τ)`` (:class:`Adagrad`)."""
    return Adagrad(eps, lr)


# The earlier names (a chain's state was one flat mapping, kept apart by `prefix`).
def _renamed(old: str, new: str) -> None:
    warnings.warn(f"fedloom.server_opt.{old} is now {new} (the prefix option is gone: a "
                  f"chain keeps each transform's state apart; a scale after a "
                  "preconditioner now multiplies its quotient, give it lr= for the named "
                  "optimizer's rounding)", DeprecationWarning, stacklevel=3)


def momentum(beta: float = 0.9, *, prefix: str = "") -> HeavyBall:
    """Deprecated: :func:`heavy_ball`."""
    _renamed("momentum", "heavy_ball")
    return HeavyBall(beta)


def adam(b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3, *, prefix: str = "") -> Adam:
    """Deprecated: :func:`scale_by_adam`."""
    _renamed("adam", "scale_by_adam")
    return Adam(b1, b2, eps)


def yogi(b1: float = 0.9, b2: float = 0.99, eps: float = 1e-3, *, prefix: str = "") -> Yogi:
    """Deprecated: :func:`scale_by_yogi`."""
    _renamed("yogi", "scale_by_yogi")
    return Yogi(b1, b2, eps)


def adagrad(eps: float = 1e-3, *, prefix: str = "") -> Adagrad:
    """Deprecated: :func:`scale_by_adagrad`."""
    _renamed("adagrad", "scale_by_adagrad")
    return Adagrad(eps)
