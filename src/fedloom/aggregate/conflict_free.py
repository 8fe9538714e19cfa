"""ConFIG: conflict-free inverse gradients.

Liu et al., "ConFIG: Towards Conflict-free Training of Physics Informed Neural
Networks" (ICLR 2025); public code github.com/tum-pbs/ConFIG
(``conflictfree/grad_operator.py``, ``ConFIG_update`` with ``EqualWeight`` and
``ProjectionLength``). With unit rows ``u_i = g_i/‖g_i‖``::

    g_u = U⁺ 1,   ĝ = g_u / ‖g_u‖,   g = (Σ_i ⟨g_i, ĝ⟩) ĝ

computed on the Gram matrix: ``g_u = Uᵀλ``, ``λ = G_cut⁺1``,
``‖g_u‖² = λᵀGλ = Σ_kept (vᵀ1)²/s`` (a sum of non-negative terms),
``⟨g_i, ĝ⟩ = ‖g_i‖ (1 − r)_i / ‖g_u‖`` with ``r = (I − P)1`` the part of ``1``
the kept directions cannot reach (0 at full row rank, where every client makes
the same angle with ``g``).

Dependent rows. As in CRAFT (same options, same numerics: gram.py), singular
values of ``U`` below ``σ_cut = max(sv_floor, rtol·σ_max)`` (default 1e-3) are
dropped: ``g_u`` is then the least-squares direction on the kept ones, as the
public ``torch.linalg.lstsq`` computes it. The mixed Gram is used only where
no eigenvalue lies within its rounding (``8·m·eps32``) of ``σ_cut²``; elsewhere
the Gram is recomputed and ``g`` formed in float64. ``config_infeasible`` = 1
when no direction makes equal angles with every client (``r ≠ 0``: rows ``g``
and ``−g``, more clients than width). ``‖g‖ ≤ mean_i ‖g_i‖`` (``Σ_i ‖g_i‖`` for
``length="sum"``) always: the length is a mean of projections on a unit vector.

Before the cut and the fallback (``rtol = 1e-6`` on the mixed Gram, ``‖g_u‖²``
as the quadratic form ``λᵀGλ``), rank-deficient float32 rows kept the mixed
Gram's rounding (eigenvalues ±6e-7 where the exact ones are 0) as directions:
the length shrank 1e6–1e7× (low rank, more clients than width), and rows that
are ± multiples of one direction gave ``λᵀGλ < 0`` → NaN (27 of 300 draws of 5
rows with the default precision; one is in tests/test_craft_edges.py).

Measured against the public rule (``length="sum"``; float32 rows; the public
code with ``use_least_square=False``, i.e. ``pinv(units) @ 1``, and with its
default ``torch.linalg.lstsq``): on independent, correlated (cos 0.9),
near-collinear (cos 0.9999), anti-correlated, norm-spread (1e-3 … 1e3),
low-rank, m > width, duplicated and near-duplicated rows, a zero row and ±
multiples, the relative difference to the public pinv rule is ≤ 3.3e-6, and
2.0e-4 near-collinear, which is the public float32 pinv's own distance to the
float64 rule (ours: 1.6e-5). Near-duplicates 1e-4 apart at d = 200 differ by
3.9e-3: there the public tolerance (``max(m, d)·eps·σ_max``) keeps the 1e-4
direction. The public default ``lstsq`` (LAPACK ``gelsy``
in float32) is less robust than its ``pinv``: on 20 anti-correlated rows at
d = 1e4 (κ(U) = 20) it returned a direction whose equal-angle conditions
``U x = 1`` miss by 0.71 (pinv: 3e-6, float64: 2e-14).

Range and degenerate cohorts. Where the squares over- or underflow (float32
rows ≳ 1e19 or ≲ 1e-22 go to the float64 path; there, rows of norm ≳ 1e154 or
entries ≲ 1e-162 are scaled by powers of two, exactly: gram.py's
:func:`~fedloom.aggregate.gram.row_scales`), and where a float32 coefficient
would overflow (float32 norms spread over ~1e40), ``g`` is formed in float64:
before, each gave a non-finite direction. When ``1`` is orthogonal to every kept
direction within rounding (``‖V_keptᵀ1‖ ≤ √k·max(8·k·eps, 8·k·eps64·κ)``, e.g.
rows ``v, −2v, 3v, −0.5v``), ``U_cut⁺1 = 0`` and the result is 0 with
``config_infeasible = 1``; before, the result was the solve's rounding: for
those rows (d = 40, ‖v‖ = 6.4) ‖g‖ = 7.0 in one order under the test suite's
thread settings and 0 in a plain process; 0, 3.7, 7.4 or 11 over the orders of
another such cohort (d = 50). In-range cohorts are computed exactly as before
(bit-identical on the property suite's ordinary cohorts).

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
