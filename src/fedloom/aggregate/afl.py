"""AFL: agnostic federated learning (stochastic mirror-descent form).

Mohri, Sivek, Suresh, "Agnostic Federated Learning" (ICML 2019). The model
minimises the worst mixture of client losses, ``min_w max_{λ∈Δ} Σ λ_k F_k(w)``,
by alternating a descent step on ``w`` and an ascent step on ``λ``:

    w ← w − γ_w Σ_k λ_k ĝ_k          ĝ_k = g_k/η_l estimates ∇F_k(w)
    λ ← Proj_Δ(λ + γ_λ F(w))          (after the model step, with the old λ's step)

with ``g_k = w − w_k`` the client updates, ``F(w)`` the clients' losses at the
received model and ``λ`` starting uniform. As in the public code (easyFL's
``afl.py``, which follows the fair_flearn code), ``γ_λ = 0.01`` and ``γ_w`` is
the client learning rate ``η_l`` of the round. fedloom returns the direction
``Σ_k λ_k g_k = η_l Σ_k λ_k ĝ_k``, so the server step ``w ← w − server.lr ·
direction`` is ``γ_w = server.lr · η_l``: the default ``server.lr = 1`` is the
public step (and follows a client-lr schedule, as the public code's does).

Every client takes part in every round (``cohort.size = data.num_clients``).
The paper and the public code report the running average of the iterates: set
``eval.average_iterates=true``.

Checked against the public rule: tests/test_baselines_public.py replays two
rounds of the public update (direction and λ, NumPy) and compares to 1e-12.
Departure: a client whose update is rejected this round drops out of this
round's model step (the others' λ renormalised) and gets no loss term in this
round's λ step; the public code has no rejected updates. The former defaults:
docs/explanation/methods.md (AFL in detail).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedloom.aggregate.base import CohortInfo
from fedloom.aggregate.gram import project_simplex
from fedloom.capabilities import AggregatorCaps, FromCapabilities
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["AFL"]


class AFL:
    """AFL with the public step sizes.

    Args:
        gamma_lambda: the ascent step ``γ_λ`` on the mixture weights (public: 0.01).

    Reference:
        paper: Mohri, Sivek & Suresh, "Agnostic Federated Learning", ICML 2019.
        code: WwZzz/easyFL (``afl.py``, which follows the fair_flearn code): γ_λ = 0.01, γ_w =
            the client lr.
        departures: a client whose update is rejected drops out of the round's model step (the
            others' λ renormalised) and gets no loss term in the λ step; the public code has no
            rejected updates.
        measured: two rounds of the public update (direction and λ) replayed in NumPy: equal to
            1e-12 (tests/test_baselines_public.py).
    """

    # server.lr=auto: the direction carries η_l (module docstring), so server.lr = 1 is the
    # public step γ_w = η_l.
    default_server_lr = 1.0

    capabilities = AggregatorCaps(requires=frozenset({"start_losses"}), full_participation=True)
    requires = FromCapabilities()  # the loose flag, for the Flower strategy

    def __init__(self, gamma_lambda: float = 0.01) -> None:
        if not gamma_lambda > 0:
            raise ValueError(f"aggregator.options.gamma_lambda: must be > 0, got {gamma_lambda}")
        self.gamma_lambda = gamma_lambda

    def init(self, layout: Layout) -> torch.Tensor | None:
        return None  # λ, created uniform at the first round (N is known then)

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: torch.Tensor | None, *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, Mapping[str, float]]:
        if info is None or info.start_losses is None:
            raise ValueError("afl: needs the clients' losses (info.start_losses)")
        N = info.num_clients
        lam = (state if state is not None
               else torch.full((N,), 1.0 / N, dtype=torch.float64, device=updates.device))
        ids = info.clients
        # Rows missing this round (rejected updates) drop out of this step only.
        coef = lam[ids] / lam[ids].sum()
        direction = coef.to(updates.dtype) @ updates
        new = lam.clone()
        new[ids] = lam[ids] + self.gamma_lambda * info.start_losses.to(torch.float64)
        new = project_simplex(new)
        return direction, new, {"afl_lambda_max": float(new.max()),
                                "afl_worst_loss": float(info.start_losses.max())}


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "afl")(AFL)
