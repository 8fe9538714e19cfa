"""ConFIG: conflict-free inverse gradients.

Liu et al., "ConFIG: Towards Conflict-free Training of Physics Informed Neural
Networks" (ICLR 2025); public code github.com/tum-pbs/ConFIG
(``conflictfree/grad_operator.py``, ``ConFIG_update`` with ``EqualWeight`` and
``ProjectionLength``). With unit rows ``u_i = g_i/‖g_i‖``::

    g_u = U⁺ 1,   ĝ = g_u / ‖g_u‖,   g = (Σ_i ⟨g_i, ĝ⟩) ĝ

computed on the Gram matrix: ``g_u = Uᵀλ``, ``λ = G_cut⁺1``, with singular
values of ``U`` below ``σ_cut = max(sv_floor, rtol·σ_max)`` dropped (as in CRAFT:
same options, same numerics, gram.py). ``config_infeasible`` = 1 when no
direction makes equal angles with every client. ``‖g‖ ≤ mean_i ‖g_i‖`` always.

Checked against the public rule (``length="sum"``, float32 rows, ``pinv(units)
@ 1``; independent, correlated, near-collinear, low-rank, duplicated and
norm-spread cohorts): relative difference ≤ 3.3e-6, and 2.0e-4 near-collinear
(the public float32 pinv's own distance to the float64 rule; ours 1.6e-5).
Departure: ConFIG sums the projections over its (few) losses; over m clients
that is m times FedAvg's step, so the default is the mean over the usable
clients (``length="mean"``; ``length="sum"`` gives the original). Zero rows are
dropped.

Dependent rows, range and degenerate cohorts, and the measurements:
docs/explanation/methods.md (ConFIG in detail).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from fedloom.aggregate.base import CohortInfo, Stateless
from fedloom.aggregate.gram import (
    Precision,
    TruncatedSolve,
    combine,
    gram,
    gram_noise,
    out_of_range,
    row_scales,
    truncated_solve,
)
from fedloom.capabilities import AggregatorCaps
from fedloom.registry import register

__all__ = ["ConFIG"]


class ConFIG(Stateless):
    """Conflict-free inverse gradients over the cohort (see the module docstring).

    Args:
        length: ``"mean"`` (default) or ``"sum"`` (the public rule) of the projections.
        rtol, sv_floor: singular values of ``U`` below ``max(sv_floor, rtol·σ_max)``
            count as zero (least squares on the rest).
        precision: ``"mixed"`` (fast path, float64 where it cannot decide) or ``"float64"``.

    Reference:
        paper: Liu et al., "ConFIG: Towards Conflict-free Training of Physics Informed Neural
            Networks", ICLR 2025.
        code: tum-pbs/ConFIG (``conflictfree/grad_operator.py``, ``ConFIG_update``).
        departures: the length is the mean of the projections over the cohort (``length="sum"``
            is the original, m times FedAvg's step); singular values below ``max(sv_floor,
            rtol·σ_max)`` are dropped and the system is solved in float64; zero rows are
            dropped.
        measured: relative difference to the public pinv rule ≤ 3.3e-6 on nine cohort kinds,
            2.0e-4 near-collinear (the public float32 pinv's own distance to the float64 rule;
            ours 1.6e-5).
    """

    # server.lr=auto: length="mean" keeps FedAvg's scale (‖g‖ ≤ mean ‖g_i‖): FedAvg's step.
    default_server_lr = 1.0
    # No optional CohortInfo field; not linear (a projection of the updates, not a sum).
    capabilities = AggregatorCaps()

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
        scale = None
        if out_of_range(G_raw, updates, updates.dtype if precision == "mixed" else torch.float64):
            if not final:
                return None  # float32 squares over- or underflowed: redo in float64
            scale = row_scales(updates)  # powers of two: the unit-row Gram is unchanged
            G_raw, _ = gram(updates, precision=precision, scale=scale)
        if not bool(torch.isfinite(G_raw).all()):
            return updates.new_full((d,), float("nan")), {}  # non-finite input: rejected upstream
        sq = G_raw.diagonal()
        idx = (sq > 0).nonzero().squeeze(1)
        k = idx.numel()
        if k == 0:
            return updates.new_zeros(d), {}
        norms = sq[idx].sqrt()                  # of the (scaled) rows
        true_norms = norms if scale is None else norms / scale[idx]   # ‖g_i‖
        G = G_raw[idx][:, idx] / (norms[:, None] * norms[None, :])
        ones = torch.ones(k, dtype=torch.float64, device=G.device)
        gram_dtype = updates.dtype if precision == "mixed" else torch.float64
        sol = truncated_solve(G, ones, sv_floor=self.sv_floor, rtol=self.rtol,
                              noise=gram_noise(k, gram_dtype), final=final)
        if sol is None:
            return None  # an eigenvalue within the mixed Gram's rounding of the cut
        # ‖g_u‖² = λᵀGλ summed over the kept eigenvalues (each term ≥ 0): never the
        # cancelling quadratic form, which went negative (NaN) on dependent rows
        gu_norm = sol.energy ** 0.5
        infeasible = float(bool(sol.dropped.abs().max() > 1e-6))
        if not gu_norm > 0 or _unreachable(sol, ones, updates.dtype):
            # g_u = U_cut⁺1 = 0: 1 is orthogonal to every kept direction (rows ± one
            # direction whose signs cancel, e.g. v, −2v, 3v, −0.5v); what the solve gives
            # is rounding, in a direction and length set by the rows' order
            return updates.new_zeros(d), {"config_length": 0.0, "config_infeasible": infeasible}
        # Gλ = 1 − (the part of 1 no λ reaches): ⟨u_i, g_u⟩, exactly on the kept space
        proj = true_norms * (ones - sol.dropped) / gu_norm       # ⟨g_i, ĝ⟩
        length = proj.sum() if self.length == "sum" else proj.mean()
        # g = length · ĝ = length/‖g_u‖ · Σ λ_i u_i = Σ (length λ_i / (‖g_u‖ ‖g_i‖)) g_i
        coef = torch.zeros(m, dtype=torch.float64, device=updates.device)
        coef[idx] = (float(length) / gu_norm) * sol.lam / norms  # zero rows are not copied out
        if precision == "float64" or not _fits(coef, updates.dtype):
            # formed in float64 and rounded once; also where a coefficient is beyond the
            # rows' dtype (float32 norms spread over ≳ 1e38 make some |coef| overflow)
            g, _ = combine(updates, coef, precision="float64", scale=scale)
        else:
            g = coef.to(updates.dtype) @ updates
        metrics = {"config_length": float(length),
                   # no direction at equal angles exists: dependent rows (e.g. g and −g)
                   "config_infeasible": infeasible}
        return g, metrics


def _fits(coef: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every non-zero coefficient is a normal number of ``dtype`` with room for a sum."""
    fi = torch.finfo(dtype)
    a = coef.abs()
    a = a[a > 0]
    return not a.numel() or (float(a.max()) < fi.max / 16 and float(a.min()) > fi.tiny / fi.eps)


def _unreachable(sol: TruncatedSolve, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """``‖P b‖ = ‖V_keptᵀ b‖`` is zero within rounding, so ``G_cut⁺b = 0`` exactly.

    Resolution ``√k·max(8·k·eps(dtype), 8·k·eps64·s_max/s_min)``: the rows' own rounding
    (``3v`` in float32 is ``v``'s direction only to ``eps32``), and the float64 solve's
    rounding of the eigenvectors (its Gram's error ``8·k·eps64·s_max`` over the
    smallest kept eigenvalue). A cohort whose ``1`` is that close to orthogonal to
    every kept direction has no direction of equal angles to round to.
    """
    if sol.rank == 0:
        return True
    k = b.numel()
    res = max(8 * k * torch.finfo(dtype).eps,
              8 * k * torch.finfo(torch.float64).eps * float(sol.s.max() / sol.s.min()))
    return bool(float(torch.linalg.vector_norm(sol.V.T @ b)) <= res * k**0.5)


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "config")(ConFIG)
