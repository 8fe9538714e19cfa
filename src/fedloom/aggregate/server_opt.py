"""Server optimizers: ``w ← w − η_g · opt(agg)``.

Reddi et al., "Adaptive Federated Optimization" (ICLR 2021), Algorithm 2, in
the pseudo-gradient sign (``agg`` points like a gradient):

- sgd:      ``w ← w − η agg``
- momentum: ``v ← β v + agg``, ``w ← w − η v``  (FedAvgM, Hsu et al. 2019)
- adam:     ``m ← β₁m + (1−β₁)agg``, ``v ← β₂v + (1−β₂)agg²``,
            ``w ← w − η m / (√v + τ)``
- yogi:     as adam with ``v ← v − (1−β₂) agg² sign(v − agg²)``
- adagrad:  ``v ← v + agg²``, ``w ← w − η agg / (√v + τ)``  (FedAdagrad; no β₁)

As in the paper there is no bias correction, ``τ`` (``eps``) is the
adaptivity floor (default 1e-3) and the second moment starts at ``τ²``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedloom.registry import register

__all__ = ["ServerOptimizer", "make_server_optimizer"]


@dataclass(frozen=True)
class ServerOptimizer:
    kind: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3

    def init(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.kind == "sgd":
            return {}
        if self.kind == "momentum":
            return {"v": torch.zeros_like(w)}
        state = {"v": torch.full_like(w, self.eps**2)}
        if self.kind in ("adam", "yogi"):
            state["m"] = torch.zeros_like(w)
        return state

    def step(
        self, w: torch.Tensor, agg: torch.Tensor, state: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.kind == "sgd":
            return w - self.lr * agg, state
        if self.kind == "momentum":
            v = self.momentum * state["v"] + agg
            return w - self.lr * v, {"v": v}
        sq = agg * agg
        if self.kind == "adagrad":
            v = state["v"] + sq
            return w - self.lr * agg / (v.sqrt() + self.eps), {"v": v}
        m = self.beta1 * state["m"] + (1 - self.beta1) * agg
        if self.kind == "adam":
            v = self.beta2 * state["v"] + (1 - self.beta2) * sq
        elif self.kind == "yogi":
            v = state["v"] - (1 - self.beta2) * sq * torch.sign(state["v"] - sq)
        else:
            raise ValueError(f"server.optimizer: unknown {self.kind!r}")
        return w - self.lr * m / (v.sqrt() + self.eps), {"m": m, "v": v}


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


@register("server_optimizer", "sgd")
def sgd(lr: float = 1.0) -> ServerOptimizer:
    return ServerOptimizer("sgd", lr=lr)


@register("server_optimizer", "momentum")
def momentum(lr: float = 1.0, momentum: float = 0.9) -> ServerOptimizer:
    return ServerOptimizer("momentum", lr=lr, momentum=momentum)


@register("server_optimizer", "adam")
def adam(lr: float = 1.0, beta1: float = 0.9, beta2: float = 0.99,
         eps: float = 1e-3) -> ServerOptimizer:
    return ServerOptimizer("adam", lr=lr, beta1=beta1, beta2=beta2, eps=eps)


@register("server_optimizer", "yogi")
def yogi(lr: float = 1.0, beta1: float = 0.9, beta2: float = 0.99,
         eps: float = 1e-3) -> ServerOptimizer:
    return ServerOptimizer("yogi", lr=lr, beta1=beta1, beta2=beta2, eps=eps)


@register("server_optimizer", "adagrad")
def adagrad(lr: float = 1.0, eps: float = 1e-3) -> ServerOptimizer:
    return ServerOptimizer("adagrad", lr=lr, eps=eps)


sgd.__doc__ = "``w ← w − η agg`` (FedAvg's server step at η = 1)." + _REFERENCE
momentum.__doc__ = "FedAvgM: ``v ← β v + agg``, ``w ← w − η v``." + _REFERENCE
adam.__doc__ = ("FedAdam: ``m ← β₁m + (1−β₁)agg``, ``v ← β₂v + (1−β₂)agg²``, "
                "``w ← w − η m/(√v + τ)``." + _REFERENCE)
yogi.__doc__ = ("FedYogi: as FedAdam with ``v ← v − (1−β₂) agg² sign(v − agg²)``."
                + _REFERENCE)
adagrad.__doc__ = "FedAdagrad: ``v ← v + agg²``, ``w ← w − η agg/(√v + τ)``." + _REFERENCE
