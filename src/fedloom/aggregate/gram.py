"""Gram-matrix kernels shared by the rules that solve on ``U Uᵀ`` (CRAFT, ConFIG, FedLF).

For ``R ∈ R^{m×d}`` the Gram matrix ``G = R Rᵀ`` (m × m) is accumulated over
column chunks in float64: a single float32 ``R @ R.T`` over millions of columns
loses about three digits (2.4e-3 relative error measured at d = 11M), while a
float64 accumulator over chunks keeps the error at the level of one chunk.

``precision``:

- ``"float64"``: each chunk is converted to float64 before its product, so the
  Gram is exact to float64 rounding (about 2× the time of ``mixed``);
- ``"mixed"``: chunk products in the input dtype (sgemm), accumulated in
  float64 (about 1e-7 relative error for float32 input); the default of CRAFT
  and ConFIG, whose per-round constraint metrics show what it costs.

At m = 100 the Gram is ``m² d`` flops and runs at the sgemm peak: it, not
memory traffic, bounds the rules that need it (benchmarks/results.md).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["Precision", "combine", "gram", "matvec", "min_norm_simplex", "pinv_solve",
           "project_simplex"]

Precision = Literal["float64", "mixed"]


def gram(
    rows: torch.Tensor,
    vec: torch.Tensor | None = None,
    *,
    chunk: int = 1 << 15,
    precision: Precision = "float64",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(R Rᵀ, R v)`` in float64, accumulated over column chunks of width ``chunk``."""
    m, d = rows.shape
    G = torch.zeros(m, m, dtype=torch.float64)
    Rv = torch.zeros(m, dtype=torch.float64) if vec is not None else None
    for s in range(0, d, chunk):
        c = rows[:, s : s + chunk]
        if precision == "float64":
            c = c.to(torch.float64)
        G += (c @ c.T).to(torch.float64)
        if vec is not None and Rv is not None:
            Rv += (c @ vec[s : s + chunk].to(c.dtype)).to(torch.float64)
    return G, Rv


def matvec(
    rows: torch.Tensor, vec: torch.Tensor, *, chunk: int = 1 << 15,
    precision: Precision = "float64",
) -> torch.Tensor:
    """``R v`` in float64, accumulated over column chunks."""
    out = torch.zeros(rows.shape[0], dtype=torch.float64)
    for s in range(0, rows.shape[1], chunk):
        c = rows[:, s : s + chunk]
        v = vec[s : s + chunk]
        if precision == "float64":
            c, v = c.to(torch.float64), v.to(torch.float64)
        out += (c @ v.to(c.dtype)).to(torch.float64)
    return out


def combine(
    rows: torch.Tensor, coef: torch.Tensor, base: torch.Tensor | None = None, *,
    chunk: int = 1 << 15, precision: Precision = "float64",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = base + Rᵀc`` (in the rows' dtype) and ``R g`` (float64) in one pass.

    Each column chunk of ``R`` is read once: its part of ``g`` is formed and
    immediately multiplied back while the chunk is in cache, so checking the
    constraints ``R g`` costs no second pass over the m × d updates.
    """
    m, d = rows.shape
    g = torch.empty(d, dtype=rows.dtype)
    Rg = torch.zeros(m, dtype=torch.float64)
    c_in = coef.to(rows.dtype)
    for s in range(0, d, chunk):
        c = rows[:, s : s + chunk]
        gc = c_in @ c
        if base is not None:
            gc = gc + base[s : s + chunk]
        g[s : s + chunk] = gc
        if precision == "float64":
            Rg += c.to(torch.float64) @ gc.to(torch.float64)
        else:
            Rg += (c @ gc).to(torch.float64)
    return g, Rg


def pinv_solve(
    G: torch.Tensor, b: torch.Tensor, rtol: float
) -> tuple[torch.Tensor, int]:
    """``λ = G⁺ b`` for a symmetric PSD ``G`` via its eigendecomposition.

    Eigenvalues ``s_i <= rtol² · max(s)`` are treated as zero: ``G = U Uᵀ``
    squares the singular values of ``U``, so ``rtol`` is a tolerance on the
    singular values ``σ_i / σ_max`` of ``U``, as in ``torch.linalg.pinv(U, rtol)``.
    Returns ``λ`` and the numerical rank.
    """
    s, V = torch.linalg.eigh(G)
    smax = float(s.max()) if s.numel() else 0.0
    if smax <= 0:
        return torch.zeros_like(b), 0
    keep = s > (rtol * rtol) * smax
    inv = torch.where(keep, 1.0 / torch.where(keep, s, torch.ones_like(s)), torch.zeros_like(s))
    lam = V @ (inv * (V.T @ b))
    return lam, int(keep.sum())


def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection onto ``{λ ≥ 0, Σλ = 1}`` (Duchi et al., ICML 2008)."""
    n = v.numel()
    u, _ = torch.sort(v, descending=True)
    css = torch.cumsum(u, 0) - 1
    ks = torch.arange(1, n + 1, dtype=v.dtype)
    cond = u - css / ks > 0
    r = int(cond.nonzero().max()) + 1
    theta = css[r - 1] / r
    return (v - theta).clamp_min(0)


def min_norm_simplex(G: torch.Tensor, iters: int = 2000, tol: float = 1e-12) -> torch.Tensor:
    """``argmin_{λ∈Δ} λᵀ G λ`` (the min-norm point of the rows' convex hull).

    Accelerated projected gradient (FISTA) on the m × m Gram matrix in float64;
    m is the cohort size, so each iteration is O(m²).
    """
    G = G.to(torch.float64)
    m = G.shape[0]
    lam = torch.full((m,), 1.0 / m, dtype=torch.float64)
    L = float(torch.linalg.eigvalsh(G).max())
    if L <= 0:
        return lam
    y, t = lam.clone(), 1.0
    for _ in range(iters):
        nxt = project_simplex(y - (2.0 / (2 * L)) * (G @ y))
        t_next = (1 + (1 + 4 * t * t) ** 0.5) / 2
        y = nxt + ((t - 1) / t_next) * (nxt - lam)
        if float((nxt - lam).abs().max()) < tol:
            lam = nxt
            break
        lam, t = nxt, t_next
    return lam
