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


for _k in ("sgd", "momentum", "adam", "yogi", "adagrad"):
    register("server_optimizer", _k)(lambda _k=_k, **kw: ServerOptimizer(_k, **kw))
