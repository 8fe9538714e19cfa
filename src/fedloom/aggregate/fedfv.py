"""FedFV: federated fair averaging by mitigating gradient conflicts.

Wang et al., "Federated Learning with Fair Averaging" (IJCAI 2021):

1. Sort the cohort by loss ``F_k`` (at the received model). The fraction ``α``
   with the highest loss keep their update unchanged.
2. Every other ``g_i'`` (starting from ``g_i``) is projected, for each ``j``
   in ascending-loss order (so the highest-loss clients act last), whenever
   ``⟨g_j, g_i'⟩ < 0``: ``g_i' ← g_i' − ⟨g_j, g_i'⟩/‖g_j‖² g_j``.
3. Average (uniformly, as the paper), then remove conflicts with the
   aggregates of the last ``τ`` rounds the same way.
4. Rescale to ``‖mean_k g_k‖``.

Each ``g_i'`` is kept as coefficients over the original rows, so step 2 runs
on the m × m Gram matrix.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedloom.aggregate.base import CohortInfo
from fedloom.aggregate.gram import gram
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["FedFV"]


class FedFV:
    requires = frozenset({"start_losses"})

    def __init__(self, alpha: float = 0.1, tau: int = 1) -> None:
        if not 0 <= alpha <= 1:
            raise ValueError(f"aggregator.options.alpha: must be in [0, 1], got {alpha}")
        if tau < 0:
            raise ValueError(f"aggregator.options.tau: must be >= 0, got {tau}")
        self.alpha, self.tau = alpha, tau

    def init(self, layout: Layout) -> list[torch.Tensor]:
        return []  # the last τ aggregates, newest last

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: list[torch.Tensor], *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor], Mapping[str, float]]:
        if info is None or info.start_losses is None:
            raise ValueError("fedfv: needs the clients' losses (info.start_losses)")
        m = updates.shape[0]
        G, _ = gram(updates)
        order = torch.argsort(info.start_losses.to(torch.float64), stable=True)  # ascending
        n_keep = math.ceil(self.alpha * m) if self.alpha > 0 else 0
        keep = set(order[m - n_keep :].tolist()) if n_keep else set()
        C = torch.eye(m, dtype=torch.float64)
        conflicts = 0
        for i in range(m):
            if i in keep:
                continue
            for j in order.tolist():
                if j == i or G[j, j] <= 0:
                    continue
                dot = float(G[j] @ C[i])  # ⟨g_j, g_i'⟩
                if dot < 0:
                    C[i, j] -= dot / float(G[j, j])
                    conflicts += 1
        coef = C.mean(0)
        g = coef.to(updates.dtype) @ updates
        for h in reversed(state):
            hh = float(h.double() @ h.double())
            dot = float(g.double() @ h.double())
            if hh > 0 and dot < 0:
                g = g - (dot / hh) * h.to(g.dtype)
        target = torch.linalg.vector_norm(updates.mean(0).double())
        norm = torch.linalg.vector_norm(g.double())
        if norm > 0:
            g = g * (target / norm).to(g.dtype)
        new_state = ([*state, g.detach().clone()])[-self.tau :] if self.tau else []
        return g, new_state, {"fedfv_projections": float(conflicts)}


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "fedfv")(FedFV)
