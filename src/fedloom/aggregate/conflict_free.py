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
from fedloom.aggregate.gram import Precision, combine, gram, gram_noise, truncated_solve
from fedloom.registry import register

__all__ = ["ConFIG"]


class ConFIG(Stateless):
    """Conflict-free inverse gradients over the cohort (see the module docstring).

    Args:
        length: ``"mean"`` (default) or ``"sum"`` (the public rule) of the projections.
        rtol, sv_floor: singular values of ``U`` below ``max(sv_floor, rtol·σ_max)``
            count as zero (least squares on the rest).
        precision: ``"mixed"`` (fast path, float64 where it cannot decide) or ``"float64"``.
    """

    def __init__(self, length: Literal["mean", "sum"] = "mean", rtol: float = 1e-6,
                 sv_floor: float = 1e-3, precision: Precision = "mixed") -> None:
        if length not in ("mean", "sum"):
            raise ValueError(f"aggregator.options.length: must be 'mean' or 'sum', got {length!r}")
        if not rtol > 0:
            raise ValueError(f"aggregator.options.rtol: must be > 0, got {rtol}")
        if not sv_floor >= 0:
            raise ValueError(f"aggregator.options.sv_floor: must be >= 0, got {sv_floor}")
        if precision not in ("float64", "mixed"):
            raise ValueError(
                f"aggregator.options.precision: must be 'float64' or 'mixed', got {precision!r}"
            )
        self.length, self.rtol, self.sv_floor, self.precision = length, rtol, sv_floor, precision

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: None, *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, None, Mapping[str, float]]:
        fast = self.precision == "mixed" and updates.dtype != torch.float64
        for precision in (("mixed", "float64") if fast else ("float64",)):
            out = self._solve(updates, precision, final=precision == "float64")
            if out is not None:
                return out[0], state, out[1]
        raise AssertionError("unreachable: the float64 path always returns")

    def _solve(
        self, updates: torch.Tensor, precision: Precision, *, final: bool
    ) -> tuple[torch.Tensor, dict[str, float]] | None:
        m, d = updates.shape
        G_raw, _ = gram(updates, precision=precision)
        if not bool(torch.isfinite(G_raw).all()):
            if not final:
                return None  # float32 products overflowed: redo in float64
            return updates.new_full((d,), float("nan")), {}  # non-finite input: rejected upstream
        sq = G_raw.diagonal()
        idx = (sq > 0).nonzero().squeeze(1)
        k = idx.numel()
        if k == 0:
            return updates.new_zeros(d), {}
        norms = sq[idx].sqrt()
        G = G_raw[idx][:, idx] / (norms[:, None] * norms[None, :])
        ones = torch.ones(k, dtype=torch.float64)
        gram_dtype = updates.dtype if precision == "mixed" else torch.float64
        sol = truncated_solve(G, ones, sv_floor=self.sv_floor, rtol=self.rtol,
                              noise=gram_noise(k, gram_dtype), final=final)
        if sol is None:
            return None  # an eigenvalue within the mixed Gram's rounding of the cut
        # ‖g_u‖² = λᵀGλ summed over the kept eigenvalues (each term ≥ 0): never the
        # cancelling quadratic form, which went negative (NaN) on dependent rows
        gu_norm = sol.energy ** 0.5
        if not gu_norm > 0:
            return updates.new_zeros(d), {}
        # Gλ = 1 − (the part of 1 no λ reaches): ⟨u_i, g_u⟩, exactly on the kept space
        proj = norms * (ones - sol.dropped) / gu_norm            # ⟨g_i, ĝ⟩
        length = proj.sum() if self.length == "sum" else proj.mean()
        # g = length · ĝ = length/‖g_u‖ · Σ λ_i u_i = Σ (length λ_i / (‖g_u‖ ‖g_i‖)) g_i
        coef = torch.zeros(m, dtype=torch.float64)
        coef[idx] = (float(length) / gu_norm) * sol.lam / norms  # zero rows are not copied out
        if precision == "float64":
            g, _ = combine(updates, coef, precision="float64")  # formed in float64, rounded once
        else:
            g = coef.to(updates.dtype) @ updates
        metrics = {"config_length": float(length),
                   # no direction at equal angles exists: dependent rows (e.g. g and −g)
                   "config_infeasible": float(bool(sol.dropped.abs().max() > 1e-6))}
        return g, metrics


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "config")(ConFIG)
