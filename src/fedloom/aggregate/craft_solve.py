"""CRAFT's per-group solve: ``g = ĝ + Uᵀλ``, ``λ = G_cut⁺(ρ − Uĝ)`` through the Gram
matrix, the mixed fast path with its check and refinement, the float64 fallback and
``match_reference``'s public ``pinv`` path. The method, its bounds and the measurements
are in :mod:`fedloom.aggregate.craft`'s docstring (the "Numerics" paragraphs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass(frozen=True)
class GroupSolve:
    g: torch.Tensor
    violation: float          # max |⟨u_i, g⟩ − ρ_i| (nan when not solved)
    min_alignment: float      # min ⟨u_i, g⟩ (nan when not solved)
    infeasible: bool


class CraftSolver:
    """The solve of one layer group, a base of :class:`~fedloom.aggregate.craft.CRAFT`
    (which sets these options)."""

    match_reference: bool
    precision: Precision
    chunk: int
    rtol: float
    sv_floor: float
    atol: float

    def _solve(
        self, R: torch.Tensor, weights: torch.Tensor, prev: torch.Tensor | None
    ) -> GroupSolve:
        if self.match_reference:
            return self._solve_reference(R, weights, prev)
        ref = _unit(prev, R.dtype) if prev is not None else None
        # The fast path (chunk products in the input dtype) is tried first; a
        # cut it cannot decide, a non-finite Gram or a failed check sends the
        # group to the float64 path, which is final.
        fast = self.precision == "mixed" and R.dtype != torch.float64
        for precision in (("mixed", "float64") if fast else ("float64",)):
            solve = self._solve_in(R, weights, ref, precision, final=precision == "float64")
            if solve is not None:
                return solve
        raise AssertionError("unreachable: the float64 path always returns")

    def _solve_in(
        self, R: torch.Tensor, weights: torch.Tensor, ref: torch.Tensor | None,
        precision: Precision, *, final: bool,
    ) -> GroupSolve | None:
        """One try of the Gram solve at ``precision``; ``None`` hands the group on to float64."""
        nan = float("nan")
        dq = R.shape[1]
        # One pass for the Gram and R·ĝ, one (fused) pass for g and the check R·g;
        # rows of the cohort are never copied (unusable ones get coefficient 0).
        G_raw, Rref = gram(R, ref, chunk=self.chunk, precision=precision)
        scale = None
        if out_of_range(G_raw, R, R.dtype if precision == "mixed" else torch.float64):
            if not final:
                # float32 squares overflowed (|values| ≳ 1e19) or underflowed (≲ 1e-22,
                # where a row read as zero dropped its constraint): redo in float64
                return None
            # rows scaled by powers of two (exact): no square over- or underflows
            scale = row_scales(R, chunk=self.chunk)
            G_raw, Rref = gram(R, ref, chunk=self.chunk, precision=precision, scale=scale)
        if not (bool(torch.isfinite(G_raw).all())
                and (Rref is None or bool(torch.isfinite(Rref).all()))):
            if not final:
                return None
            # non-finite input: a NaN direction the engine rejects
            return GroupSolve(R.new_full((dq,), nan), nan, nan, False)
        sq = G_raw.diagonal().clone()
        usable = sq > 0
        k = int(usable.sum())
        if k == 0:
            return GroupSolve(R.new_zeros(dq), nan, nan, False)
        idx = usable.nonzero().squeeze(1)
        if k == 1:
            return GroupSolve(R[idx[0]].clone(), nan, nan, False)
        norms = sq[idx].sqrt()
        rho = _normalise(weights[idx].to(torch.float64))
        G = G_raw[idx][:, idx] / (norms[:, None] * norms[None, :])
        Uref = (Rref[idx] / norms if Rref is not None
                else torch.zeros(k, dtype=torch.float64, device=G.device))
        b = rho - Uref
        gram_dtype = R.dtype if precision == "mixed" else torch.float64
        sol = truncated_solve(G, b, sv_floor=self.sv_floor, rtol=self.rtol,
                              noise=gram_noise(k, gram_dtype), final=final)
        if sol is None:
            return None  # an eigenvalue within the Gram's rounding of the cut
        return self._refine(R, ref, precision, scale, idx, norms, rho, sol, final=final)

    def _refine(
        self, R: torch.Tensor, ref: torch.Tensor | None, precision: Precision,
        scale: torch.Tensor | None, idx: torch.Tensor, norms: torch.Tensor,
        rho: torch.Tensor, sol: TruncatedSolve, *, final: bool,
    ) -> GroupSolve | None:
        """Form ``g`` from the solve's ``λ``, refine ``λ`` against the measured residual
        and report the constraints ``g`` meets; ``None`` when the mixed check fails."""
        m, dq = R.shape
        k = len(idx)

        def form(lam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
            # g = ĝ + Uᵀλ = ĝ + Rᵀ(λ/‖g_i‖), then the constraints as actually met by
            # the returned g (in its dtype), so a violation is visible, not assumed away.
            coef = torch.zeros(m, dtype=torch.float64, device=R.device)
            coef[idx] = lam / norms
            g, Rg = combine(R, coef, ref, chunk=self.chunk, precision=precision, scale=scale)
            Ug = Rg[idx] / norms
            # U g − ρ = Gλ − b = −(the part of b no λ reaches); any other residual
            # is rounding in the Gram, the solve or the forming of g
            err = float((Ug - rho + sol.dropped).abs().max())
            return g, Ug, err

        # The mixed check is itself rounded (float32 products): trust it only with a
        # margin of 8·eps·‖g‖ (measured against the float64 product: at most
        # 6.3·eps·‖g‖ on independent, correlated and norm-spread rows, d = 1e3 …
        # 4e6); the float64 check is the product of the returned g, exact to
        # float64 rounding.
        margin = 8.0 * torch.finfo(R.dtype).eps if precision == "mixed" else 0.0

        def trusted(g: torch.Tensor, err: float) -> bool:
            return err + margin * float(torch.linalg.vector_norm(g)) <= self.atol

        lam = sol.lam
        g, Ug, err = form(lam)
        # Iterative refinement on λ against the measured residual: one step on the
        # mixed path (its Gram is a good preconditioner: the error, ≲ 2.2·k·eps
        # measured, is under a third of every eigenvalue it kept, > 8·k·eps), two
        # on the float64 path.
        for _ in range(2 if final else 1):
            if trusted(g, err):
                break
            lam2 = lam - sol.apply(Ug - rho + sol.dropped)
            g2, Ug2, err2 = form(lam2)
            if not err2 < err:
                break
            lam, g, Ug, err = lam2, g2, Ug2, err2
        if not final and not trusted(g, err):
            return None
        viol = float((Ug - rho).abs().max())
        if not bool(torch.linalg.vector_norm(g) > 0):
            g = R.new_zeros(dq)
        # infeasible: dependent directions whose targets disagree, so the constraints
        # cannot all hold; the least-squares solution on the kept directions is returned
        return GroupSolve(g, viol, float(Ug.min()), sol.rank < k and viol > self.atol)

    def _solve_reference(
        self, R: torch.Tensor, weights: torch.Tensor, prev: torch.Tensor | None
    ) -> GroupSolve:
        """The public code's formula: ``ĝ + pinv(U) (ρ − U ĝ)`` in the input dtype."""
        nan = float("nan")
        dq = R.shape[1]
        norms = torch.linalg.vector_norm(R, dim=1)
        usable = norms > 0
        if not bool(usable.any()):
            return GroupSolve(R.new_zeros(dq), nan, nan, False)
        Ru = R[usable]
        if Ru.shape[0] == 1:
            return GroupSolve(Ru[0].clone(), nan, nan, False)
        # Weights are normalised over the cohort, then again over the usable
        # clients, all in the input dtype, exactly as the public code does.
        rho = _normalise(_normalise(weights.to(R.dtype))[usable])
        U = torch.nan_to_num(Ru / norms[usable].unsqueeze(1), nan=0.0, posinf=0.0, neginf=0.0)
        ref = R.new_zeros(dq)
        if prev is not None:
            pn = torch.linalg.vector_norm(prev)
            if bool(pn > 0):
                ref = prev / pn
        g = ref + torch.linalg.pinv(U) @ (rho - U @ ref)
        Ug = (U.double() @ g.double())
        viol = float((Ug - rho.double()).abs().max())
        rank = int(torch.linalg.matrix_rank(U))
        if not bool(torch.linalg.vector_norm(g) > 0):
            g = R.new_zeros(dq)
        return GroupSolve(g, viol, float(Ug.min()), rank < Ru.shape[0])


def _normalise(w: torch.Tensor) -> torch.Tensor:
    total = w.sum()
    return w / total if float(total) > 0 else torch.full_like(w, 1.0 / w.numel())


def _unit(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    x = v.to(torch.float64)
    n = torch.linalg.vector_norm(x)
    if not (bool(n > 1e-150) and bool(torch.isfinite(n))):
        # the squares over- or underflowed (a norm-matched reference of huge or tiny
        # updates): divide by the largest entry first; a zero vector stays zero
        a = x.abs().max() if x.numel() else x.new_zeros(())
        if not (bool(a > 0) and bool(torch.isfinite(a))):
            return torch.zeros_like(v, dtype=dtype)
        x = x / a
        n = torch.linalg.vector_norm(x)
    out: torch.Tensor = (x / n).to(dtype)
    return out
