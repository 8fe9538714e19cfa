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

Checked against the public rule: tests/test_baselines_public.py replays two
rounds of the public update (direction and λ, NumPy) and compares to 1e-12.
Departure: a client whose update is rejected this round drops out of this
round's model step (the others' λ renormalised; no model step where the others
hold no λ) and gets no loss term in this round's λ step; the public code has no
rejected updates. The λ step is exact for any finite losses (``__call__``).
Participation, iterates, the former defaults: docs/explanation/methods.md (AFL in detail).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedloom.aggregate.base import CohortInfo
from fedloom.aggregate.gram import project_simplex
from fedloom.capabilities import AggregatorCaps
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
            others' λ renormalised; no model step where they hold no λ) and gets no loss term in
            the λ step; the public code has no rejected updates.
        measured: two rounds of the public update (direction and λ) replayed in NumPy: equal to
            1e-12 (tests/test_baselines_public.py).
    """

    # server.lr=auto: the direction carries η_l (module docstring), so server.lr = 1 is the
    # public step γ_w = η_l.
    default_server_lr = 1.0

    capabilities = AggregatorCaps(requires=frozenset({"start_losses"}), full_participation=True)

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
        """The model step ``Σ_k λ_k g_k / Σ_k λ_k`` over the accepted clients and the
        ascent step ``λ ← Proj_Δ(λ + γ_λ F)`` (``F_k`` = 0 for an absent client).

        The ascent is formed as ``Proj_Δ(λ + max(γ_λ(F − B), −4))`` with ``B = max_k F_k``:
        the projection is shift-invariant, and an entry that the floor raises stays below
        ``max − 3`` and gets 0 as before, so a finite loss of any size (1e308, or −1e308
        beside it, where ``γ_λ F`` or a difference would overflow) gives the exact
        projection (tests/test_loss_range.py: losses ±1e-300 … ±1e300, γ_λ up to 1e10,
        against rational arithmetic: at most 0.375 ulp of 1).
        Accepted clients that hold none of ``λ`` (the mass sits on a rejected one) make
        no model step (a zero direction, ``afl_no_mass`` = 1) and ``λ`` still takes its
        step; before, ``0/0`` made the direction NaN and the round, ``λ`` included, was
        skipped for as long as that client was rejected. A NaN or infinite loss raises
        ValueError (the engine rejects such clients before).
        """
        if info is None or info.start_losses is None:
            raise ValueError("afl: needs the clients' losses (info.start_losses)")
        F = info.start_losses.to(torch.float64)
        if not bool(torch.isfinite(F).all()):
            raise ValueError(f"afl: the start losses must be finite, got {F.tolist()}")
        N = info.num_clients
        lam = (state if state is not None
               else torch.full((N,), 1.0 / N, dtype=torch.float64, device=updates.device))
        ids = info.clients
        # Rows missing this round (rejected updates) drop out of this step only.
        mass = lam[ids].sum()
        if mass > 0:
            direction = (lam[ids] / mass).to(updates.dtype) @ updates
        else:
            direction = torch.zeros(updates.shape[1], dtype=updates.dtype, device=updates.device)
        b = torch.zeros_like(lam)
        b[ids] = F
        # λ + γ_λ b − γ_λ max(b): the same projection, and no overflow (docstring above)
        new = project_simplex(lam + (self.gamma_lambda * (b - b.max())).clamp_min(-4.0))
        return direction, new, {"afl_lambda_max": float(new.max()),
                                "afl_worst_loss": float(F.max()),
                                "afl_no_mass": float(not mass > 0)}


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "afl")(AFL)
