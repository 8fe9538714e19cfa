"""The named server optimizers (``server.optimizer``), each a chain of
:mod:`fedloom.server_opt.transforms` ending in the step size ``η``:

- sgd:      ``scale(η)``
- momentum: ``momentum(β), scale(η)``
- adam:     ``adam(β₁, β₂, τ), scale(η)``
- yogi:     ``yogi(β₁, β₂, τ), scale(η)``
- adagrad:  ``adagrad(τ), scale(η)``

Each gives the model and the state (keys ``v``, ``m``) of the optimizers these
chains replaced, bit for bit: checkpoints written before resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Annotated

import torch

from fedloom.registry import Range, register
from fedloom.server_opt import transforms as tx
from fedloom.server_opt.transforms import Chain, ServerTransform, State

__all__ = ["ServerOptimizer", "adagrad", "adam", "make_server_optimizer",
           "momentum", "sgd", "yogi"]


@dataclass(frozen=True)
class ServerOptimizer:
    """A named server optimizer by its settings (those its ``kind`` does not use
    are ignored); ``init`` and ``step`` are its :attr:`chain`'s."""

    kind: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3

    @cached_property
    def chain(self) -> Chain:
        """The transforms of :attr:`kind`, then ``scale(lr)``."""
        first: tuple[ServerTransform, ...]
        if self.kind == "sgd":
            first = ()
        elif self.kind == "momentum":
            first = (tx.momentum(self.momentum),)
        elif self.kind == "adam":
            first = (tx.adam(self.beta1, self.beta2, self.eps),)
        elif self.kind == "yogi":
            first = (tx.yogi(self.beta1, self.beta2, self.eps),)
        elif self.kind == "adagrad":
            first = (tx.adagrad(self.eps),)
        else:
            raise ValueError(f"server.optimizer: unknown {self.kind!r}")
        return tx.chain(*first, tx.scale(self.lr))

    def init(self, w: torch.Tensor) -> State:
        return self.chain.init(w)

    def step(self, w: torch.Tensor, agg: torch.Tensor, state: State
             ) -> tuple[torch.Tensor, State]:
        """``w − η·opt(agg)`` and the new state."""
        return self.chain.step(w, agg, state)


def make_server_optimizer(kind: str, **kw: float) -> ServerOptimizer:
    return ServerOptimizer(kind, **kw)


# The factories (server.optimizer); their options are the server section's keys.
_REFERENCE = """

    Reference:
        paper: Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2
            (FedAvgM: Hsu, Qi & Brown, arXiv 1909.06335, 2019).
        code: none checked (the update equations of the paper).
        departures: the pseudo-gradient sign (``agg`` points like a gradient); as
            in the paper, no bias correction and the second moment starts at τ².
    """


# The bounds of the options (server.optimizer.options, checked when a config loads): a
# momentum or decay rate in [0, 1), an epsilon above 0. The step `lr` is server.lr.
_Rate = Annotated[float, Range(ge=0, lt=1)]
_Eps = Annotated[float, Range(gt=0)]


@register("server_optimizer", "sgd")
def sgd(lr: float = 1.0) -> ServerOptimizer:
    return ServerOptimizer("sgd", lr=lr)


@register("server_optimizer", "momentum")
def momentum(lr: float = 1.0, momentum: _Rate = 0.9) -> ServerOptimizer:
    return ServerOptimizer("momentum", lr=lr, momentum=momentum)


@register("server_optimizer", "adam")
def adam(lr: float = 1.0, beta1: _Rate = 0.9, beta2: _Rate = 0.99,
         eps: _Eps = 1e-3) -> ServerOptimizer:
    return ServerOptimizer("adam", lr=lr, beta1=beta1, beta2=beta2, eps=eps)


@register("server_optimizer", "yogi")
def yogi(lr: float = 1.0, beta1: _Rate = 0.9, beta2: _Rate = 0.99,
         eps: _Eps = 1e-3) -> ServerOptimizer:
    return ServerOptimizer("yogi", lr=lr, beta1=beta1, beta2=beta2, eps=eps)


@register("server_optimizer", "adagrad")
def adagrad(lr: float = 1.0, eps: _Eps = 1e-3) -> ServerOptimizer:
    return ServerOptimizer("adagrad", lr=lr, eps=eps)


sgd.__doc__ = "``w ← w − η agg`` (FedAvg's server step at η = 1)." + _REFERENCE
momentum.__doc__ = "FedAvgM: ``v ← β v + agg``, ``w ← w − η v``." + _REFERENCE
adam.__doc__ = ("FedAdam: ``m ← β₁m + (1−β₁)agg``, ``v ← β₂v + (1−β₂)agg²``, "
                "``w ← w − η m/(√v + τ)``." + _REFERENCE)
yogi.__doc__ = ("FedYogi: as FedAdam with ``v ← v − (1−β₂) agg² sign(v − agg²)``."
                + _REFERENCE)
adagrad.__doc__ = "FedAdagrad: ``v ← v + agg²``, ``w ← w − η agg/(√v + τ)``." + _REFERENCE
