"""AFL: agnostic federated learning (stochastic mirror-descent form).

Mohri, Sivek, Suresh, "Agnostic Federated Learning" (ICML 2019). The model
minimises the worst mixture of client losses, ``min_w max_{λ∈Δ} Σ λ_k F_k(w)``:

    direction = Σ_k λ_k g_k / η_l          (g_k/η_l estimates ∇F_k(w))
    λ ← Proj_Δ(λ + γ_λ F(w))               (after the model step)

with ``F(w)`` the clients' losses at the received model. Every client takes
part in every round (``cohort.size = data.num_clients``); the server step
``w ← w − γ·direction`` uses ``server.lr`` as γ. The paper reports the average
of the iterates: set ``eval.average_iterates=true``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedloom.aggregate.base import CohortInfo
from fedloom.aggregate.gram import project_simplex
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["AFL"]


class AFL:
    requires = frozenset({"start_losses", "lr"})
    full_participation = True

    def __init__(self, gamma_lambda: float = 0.1) -> None:
        if gamma_lambda <= 0:
            raise ValueError(f"aggregator.options.gamma_lambda: must be > 0, got {gamma_lambda}")
        self.gamma_lambda = gamma_lambda

    def init(self, layout: Layout) -> torch.Tensor | None:
        return None  # λ, created uniform at the first round (N is known then)

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: torch.Tensor | None, *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Mapping[str, float]]:
        if info is None or info.start_losses is None or info.lr is None:
            raise ValueError("afl: needs the start losses and the client lr (info)")
        N = info.num_clients
        lam = state if state is not None else torch.full((N,), 1.0 / N, dtype=torch.float64)
        ids = info.clients
        # Rows missing this round (rejected updates) drop out of this step only.
        coef = lam[ids] / lam[ids].sum()
        direction = (coef / info.lr).to(updates.dtype) @ updates
        losses = torch.zeros(N, dtype=torch.float64)
        losses[ids] = info.start_losses.to(torch.float64)
        new = lam.clone()
        new[ids] = lam[ids] + self.gamma_lambda * losses[ids]
        new = project_simplex(new)
        return direction, new, {"afl_lambda_max": float(new.max()),
                                "afl_worst_loss": float(info.start_losses.max())}


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "afl")(AFL)
