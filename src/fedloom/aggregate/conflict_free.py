"""ConFIG: conflict-free inverse gradients.

Liu et al., "ConFIG: Towards Conflict-free Training of Physics Informed Neural
Networks" (ICLR 2025); public code github.com/tum-pbs/ConFIG. With unit rows
``u_i = g_i/‖g_i‖``::

    g_u = U⁺ 1,   ĝ = g_u / ‖g_u‖,   g = (Σ_i ⟨g_i, ĝ⟩) ĝ

computed on the Gram matrix: ``g_u = Uᵀλ``, ``λ = G⁺1``, ``‖g_u‖² = λᵀGλ``,
``⟨g_i, ĝ⟩ = ‖g_i‖ (Gλ)_i / ‖g_u‖``.

Departure: ConFIG sums the projections over its (few) losses. Over a cohort
of m clients the sum is m times FedAvg's step, so the default here is the
mean over the usable clients (``length="mean"``); ``length="sum"`` gives the
original. Zero rows are dropped.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from fedloom.aggregate.base import CohortInfo, Stateless
from fedloom.aggregate.gram import Precision, gram, pinv_solve
from fedloom.registry import register

__all__ = ["ConFIG"]


class ConFIG(Stateless):
    def __init__(self, length: Literal["mean", "sum"] = "mean", rtol: float = 1e-6,
                 precision: Precision = "mixed") -> None:
        if length not in ("mean", "sum"):
            raise ValueError(f"aggregator.options.length: must be 'mean' or 'sum', got {length!r}")
        self.length, self.rtol, self.precision = length, rtol, precision

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: None, *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, None, Mapping[str, float]]:
        G_raw, _ = gram(updates, precision=self.precision)
        sq = G_raw.diagonal()
        idx = (sq > 0).nonzero().squeeze(1)
        if idx.numel() == 0:
            return updates.new_zeros(updates.shape[1]), state, {}
        norms = sq[idx].sqrt()
        G = G_raw[idx][:, idx] / (norms[:, None] * norms[None, :])
        lam, _ = pinv_solve(G, torch.ones(idx.numel(), dtype=torch.float64), self.rtol)
        gu_norm = float(torch.sqrt(lam @ G @ lam))
        if gu_norm <= 0:
            return updates.new_zeros(updates.shape[1]), state, {}
        proj = norms * (G @ lam) / gu_norm            # ⟨g_i, ĝ⟩
        length = proj.sum() if self.length == "sum" else proj.mean()
        # g = length · ĝ = length/‖g_u‖ · Σ λ_i u_i = Σ (length λ_i / (‖g_u‖ ‖g_i‖)) g_i
        coef = torch.zeros(updates.shape[0], dtype=torch.float64)
        coef[idx] = (float(length) / gu_norm) * lam / norms  # zero rows are not copied out
        return coef.to(updates.dtype) @ updates, state, {"config_length": float(length)}


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "config")(ConFIG)
