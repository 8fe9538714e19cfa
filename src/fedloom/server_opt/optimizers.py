"""The named server optimizers (``server.optimizer``), each a chain of
:mod:`fedloom.server_opt.transforms` with the step size ``η``, built from the
table of kinds (kind → the chain at a :class:`ServerOptimizer`'s settings):

- sgd:      ``scale(η)``
- momentum: ``heavy_ball(β), scale(η)``
- adam:     ``scale_by_adam(β₁, β₂, τ, lr=η)``
- yogi:     ``scale_by_yogi(β₁, β₂, τ, lr=η)``
- adagrad:  ``scale_by_adagrad(τ, lr=η)``

Each gives the model of the optimizers these chains replaced, bit for bit; their
state is the chain's tuple (:mod:`fedloom.transforms`), and a checkpoint written
when it was one flat mapping (keys ``v``, ``m``) resumes through
:func:`fedloom.engine.runs.legacy.legacy_opt_state`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Annotated, Any

import torch

from fedloom.registry import Range, register
from fedloom.server_opt import transforms as tx
from fedloom.transforms import Chain

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
    def chain(self) -> Chain[torch.Tensor]:
        """The chain of :attr:`kind` at these settings."""
        build = _CHAINS.get(self.kind)
        if build is None:
            raise ValueError(f"server.optimizer: unknown {self.kind!r}")
        return build(self)

    def init(self, w: torch.Tensor) -> tuple[Any, ...]:
        return self.chain.init(w)

    def step(self, w: torch.Tensor, agg: torch.Tensor, state: tuple[Any, ...]
             ) -> tuple[torch.Tensor, tuple[Any, ...]]:
        """``w − η·opt(agg)`` and the new state."""
        return self.chain.step(w, agg, state)


# kind -> its chain at an optimizer's settings. A preconditioner takes the step size
# itself: it multiplies the numerator, (η·m)/(√v + τ), as these optimizers always did.
_CHAINS: dict[str, Callable[[ServerOptimizer], Chain[torch.Tensor]]] = {
    "sgd": lambda o: tx.chain(tx.scale(o.lr)),
    "momentum": lambda o: tx.chain(tx.heavy_ball(o.momentum), tx.scale(o.lr)),
    "adam": lambda o: tx.chain(tx.scale_by_adam(o.beta1, o.beta2, o.eps, lr=o.lr)),
    "yogi": lambda o: tx.chain(tx.scale_by_yogi(o.beta1, o.beta2, o.eps, lr=o.lr)),
    "adagrad": lambda o: tx.chain(tx.scale_by_adagrad(o.eps, lr=o.lr)),
}


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
