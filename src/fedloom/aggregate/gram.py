"""Gram-matrix kernels shared by the rules that solve on ``U Uᵀ`` (CRAFT, ConFIG, FedLF).

For ``R ∈ R^{m×d}`` the Gram matrix ``G = R Rᵀ`` (m × m) is accumulated over
column chunks in float64: a single float32 ``R @ R.T`` over millions of columns
loses about three digits (2.4e-3 relative error measured at d = 11M), while a
float64 accumulator over chunks keeps the error at the level of one chunk.

``precision``:

- ``"float64"``: each chunk is converted to float64 before its product, so the
  Gram is exact to float64 rounding (about 2× the time of ``mixed``);
- ``"mixed"``: chunk products in the input dtype (sgemm), accumulated in
  float64; the fast path of CRAFT and ConFIG, which fall back to ``float64``
  where it cannot decide (:func:`truncated_solve`, :func:`gram_noise`).

:func:`gram_noise` bounds the mixed Gram's rounding on unit rows (``8·k·eps``):
an eigenvalue within it of a cut-off cannot be told apart from it.
:func:`row_scales` gives exact powers of two for rows whose squares would over-
or underflow (rows in range are never scaled), and every product runs in full
float32 (:func:`full_precision`: never TF32) where the rows are.

Measurements of the rounding, the range and devices in detail:
docs/explanation/methods.md (Gram kernels in detail).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, ParamSpec, TypeVar

import torch

__all__ = ["Precision", "TruncatedSolve", "combine", "full_precision", "gram", "gram_noise",
           "lincomb64", "matvec", "out_of_range", "project_simplex", "row_scales", "safe_norm",
           "truncated_solve"]

Precision = Literal["float64", "mixed"]
_P = ParamSpec("_P")
_R = TypeVar("_R")


@contextlib.contextmanager
def full_precision() -> Iterator[None]:
    """float32 matrix products in full float32 inside the block (no TF32 on CUDA,
    no reduced precision in oneDNN); the previous settings come back after."""
    from fedloom.device import full_float32

    restore = full_float32()
    try:
        yield
    finally:
        restore()


def _no_tf32(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with full_precision():
            return fn(*args, **kwargs)

    return wrapper


@_no_tf32
def gram(
    rows: torch.Tensor,
    vec: torch.Tensor | None = None,
    *,
    chunk: int = 1 << 15,
    precision: Precision = "float64",
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(R Rᵀ, R v)`` in float64, accumulated over column chunks of width ``chunk``.

    ``scale`` (float64 path only; powers of two from :func:`row_scales`): the Gram
    of ``diag(scale) R``, each chunk scaled on the fly (exact), never copied whole.
    """
    m, d = rows.shape
    G = torch.zeros(m, m, dtype=torch.float64, device=rows.device)
    Rv = torch.zeros(m, dtype=torch.float64, device=rows.device) if vec is not None else None
    for s in range(0, d, chunk):
        c = rows[:, s : s + chunk]
        if precision == "float64":
            c = _scaled(c, scale)
        G += (c @ c.T).to(torch.float64)
        if vec is not None and Rv is not None:
            Rv += (c @ vec[s : s + chunk].to(c.dtype)).to(torch.float64)
    return G, Rv


@_no_tf32
def matvec(
    rows: torch.Tensor, vec: torch.Tensor, *, chunk: int = 1 << 15,
    precision: Precision = "float64",
) -> torch.Tensor:
    """``R v`` in float64, accumulated over column chunks."""
    out = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
    for s in range(0, rows.shape[1], chunk):
        c = rows[:, s : s + chunk]
        v = vec[s : s + chunk]
        if precision == "float64":
            c, v = c.to(torch.float64), v.to(torch.float64)
        out += (c @ v.to(c.dtype)).to(torch.float64)
    return out


@_no_tf32
def combine(
    rows: torch.Tensor, coef: torch.Tensor, base: torch.Tensor | None = None, *,
    chunk: int = 1 << 15, precision: Precision = "float64", scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = base + Rᵀc`` (returned in the rows' dtype) and ``R g`` (float64) in one pass.

    ``scale`` (float64 path only): the rows are ``diag(scale) R`` (as in :func:`gram`),
    so ``coef`` applies to the scaled rows and ``R g`` is that of the scaled rows.

    Each column chunk of ``R`` is read once: its part of ``g`` is formed and
    immediately multiplied back while the chunk is in cache, so checking the
    constraints ``R g`` costs no second pass over the m × d updates.

    ``"mixed"`` forms ``g`` and ``R g`` in the rows' dtype. ``"float64"`` forms
    ``g`` in float64 and rounds it once to the rows' dtype (large coefficients
    of opposite sign, as near-collinear rows need, cancel exactly instead of
    in float32), and ``R g`` is taken, in float64, of the rounded ``g``: it is
    the product of what is returned.
    """
    m, d = rows.shape
    g = torch.empty(d, dtype=rows.dtype, device=rows.device)
    Rg = torch.zeros(m, dtype=torch.float64, device=rows.device)
    if precision == "float64":
        c64 = coef.to(rows.device, torch.float64)
        for s in range(0, d, chunk):
            c = _scaled(rows[:, s : s + chunk], scale)
            gc = c64 @ c
            if base is not None:
                gc = gc + base[s : s + chunk].to(torch.float64)
            g[s : s + chunk] = gc
            Rg += c @ g[s : s + chunk].to(torch.float64)
        return g, Rg
    c_in = coef.to(rows.device, rows.dtype)
    for s in range(0, d, chunk):
        c = rows[:, s : s + chunk]
        gc = c_in @ c
        if base is not None:
            gc = gc + base[s : s + chunk]
        g[s : s + chunk] = gc
        Rg += (c @ gc).to(torch.float64)
    return g, Rg


def _scaled(c: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    c = c.to(torch.float64)
    return c if scale is None else c * scale[:, None]


def row_scales(rows: torch.Tensor, *, common: bool = False, chunk: int = 1 << 15) -> torch.Tensor:
    """Powers of two ``2^−e_i`` (float64, one a row) with ``max_j |r_ij|·2^−e_i ∈ [0.5, 1)``.

    Multiplying by a power of two is exact (short of underflow), so the Gram of the
    scaled rows is ``diag(s) G diag(s)`` to the last bit while no square overflows
    (``‖r_i‖ ≳ 1e154`` in float64) or underflows (entries ≲ 1e-22 in float32,
    ≲ 1e-162 in float64). Zero and non-finite rows get 1 (a non-finite row stays
    non-finite). ``common``: one factor for all rows, from the largest entry (for
    the rules whose arithmetic mixes rows, e.g. distances).
    """
    amax = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
    for s in range(0, rows.shape[1], chunk):
        amax = torch.maximum(amax, rows[:, s : s + chunk].abs().amax(1).to(torch.float64))
    if common:
        amax = amax.max().expand(rows.shape[0]) if rows.shape[0] else amax
    _, e = torch.frexp(amax)
    ok = torch.isfinite(amax) & (amax > 0)
    one = torch.ones_like(amax)
    return torch.where(ok, torch.ldexp(one, -e.to(torch.float64)), one)


def out_of_range(G: torch.Tensor, rows: torch.Tensor, product_dtype: torch.dtype) -> bool:
    """Whether the Gram ``G`` of ``rows`` (chunk products in ``product_dtype``) lost
    rows to overflow or underflow, so the rows must be scaled (:func:`row_scales`).

    Overflow: a non-finite ``G``, or a diagonal above ``max64/(16 m²)`` (sums of m
    Gram entries, and products of two m-row combinations, would overflow float64).
    Underflow: a diagonal ``0 < G_ii < d·tiny/eps`` (each of the d products may have
    lost all its digits to the subnormal range, ``tiny``, relative to ``G_ii``), or
    ``G_ii = 0`` for a row that is not zero (every square underflowed).
    """
    m, d = rows.shape
    if not bool(torch.isfinite(G).all()):
        return True
    diag = G.diagonal()
    if m and float(diag.max()) > torch.finfo(torch.float64).max / (16.0 * m * m):
        return True
    fi = torch.finfo(product_dtype)
    small = diag < max(d, 1) * fi.tiny / fi.eps
    if not bool(small.any()):
        return False
    if bool((diag[small] > 0).any()):
        return True
    return bool(rows[small.nonzero().squeeze(1)].ne(0).any())


def lincomb64(
    rows: torch.Tensor, coef: torch.Tensor, *, scale: torch.Tensor | None = None,
    chunk: int = 1 << 15,
) -> torch.Tensor:
    """``Σ_i coef_i (scale_i r_i)`` as a float64 d-vector, over column chunks
    (no float64 copy of the rows)."""
    out = torch.empty(rows.shape[1], dtype=torch.float64, device=rows.device)
    c64 = coef.to(rows.device, torch.float64)
    for s in range(0, rows.shape[1], chunk):
        out[s : s + chunk] = c64 @ _scaled(rows[:, s : s + chunk], scale)
    return out


def safe_norm(x: torch.Tensor) -> float:
    """``‖x‖₂`` in float64 without overflow or underflow of the squares: the vector is
    divided by its largest entry first (the LAPACK ``dnrm2`` idea). Non-finite
    entries give a non-finite norm.

    >>> x = torch.tensor([3e200, 4e200], dtype=torch.float64)
    >>> float(torch.linalg.vector_norm(x)), safe_norm(x)
    (inf, 4.9999999999999995e+200)
    """
    x = x.to(torch.float64)
    a = float(x.abs().max()) if x.numel() else 0.0
    if not a > 0 or a == float("inf"):
        return a if a == a else float("nan")
    return a * float(torch.linalg.vector_norm(x / a))


def gram_noise(k: int, dtype: torch.dtype) -> float:
    """Bound ``8·k·eps(dtype)`` on ``‖E‖₂`` for a unit-row k × k Gram whose chunk
    products ran in ``dtype`` (measurements: docs/explanation/methods.md,
    Gram kernels in detail)."""
    return 8.0 * k * torch.finfo(dtype).eps


@dataclass(frozen=True)
class TruncatedSolve:
    """``λ = G_cut⁺ b`` for a unit-row Gram ``G = U Uᵀ`` cut at ``σ_cut``.

    ``V``, ``s``: the kept eigenvectors and eigenvalues (``s > σ_cut²``);
    ``dropped = (I − V Vᵀ) b``, the part of ``b`` that no ``λ`` reaches, so
    ``G λ − b = −dropped``; ``energy = λᵀGλ = Σ (vᵀb)²/s ≥ 0`` summed term by
    term (``‖Uᵀλ‖²``, never a cancelling quadratic form).
    """

    lam: torch.Tensor
    V: torch.Tensor
    s: torch.Tensor
    dropped: torch.Tensor
    energy: float
    cut: float

    @property
    def rank(self) -> int:
        return int(self.s.numel())

    def apply(self, b: torch.Tensor) -> torch.Tensor:
        """``G_cut⁺ b`` with the same eigenvectors (iterative refinement)."""
        return self.V @ ((self.V.T @ b) / self.s)


def truncated_solve(
    G: torch.Tensor, b: torch.Tensor, *, sv_floor: float, rtol: float, noise: float = 0.0,
    final: bool = False,
) -> TruncatedSolve | None:
    """Truncated pseudo-inverse solve on a unit-row Gram, or ``None`` if undecidable.

    Singular values of ``U`` below ``σ_cut = max(sv_floor, rtol·σ_max)`` count as
    zero, i.e. eigenvalues ``s ≤ σ_cut²`` of ``G``. ``noise`` bounds the error of
    ``G`` (:func:`gram_noise`). If an eigenvalue lies within ``noise`` of
    ``σ_cut²`` the cut cannot be decided on this ``G``: ``None`` asks for a more
    precise one, unless ``final`` (the most precise Gram there is), where the
    cut is raised to ``noise`` so that rounding is never inverted. Kept
    eigenvalues are thus above ``σ_cut²`` for the exact Gram too (to the
    rounding of a float64 Gram when ``final``), and
    ``‖Uᵀλ‖² = Σ (vᵀb)²/s ≤ ‖b‖²/σ_cut²``.
    """
    s, V = torch.linalg.eigh(G)
    smax = float(s.max()) if s.numel() else 0.0
    cut2 = max(sv_floor * sv_floor, rtol * rtol * max(smax, 0.0))
    if final:
        cut2 = max(cut2, noise)
    elif bool(((s - cut2).abs() <= noise).any()):
        return None
    keep = s > cut2
    Vk, sk = V[:, keep], s[keep]
    coord = Vk.T @ b
    lam = Vk @ (coord / sk)
    dropped = b - Vk @ coord
    energy = float((coord * coord / sk).sum())
    return TruncatedSolve(lam, Vk, sk, dropped, energy, cut2**0.5)


def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of ``v`` onto the simplex ``{λ ≥ 0, Σλ = 1}``, exact for any
    finite ``v`` (the sort-based rule of Held, Wolfe & Crowder 1974; Duchi et al., ICML 2008).

    The projection is ``x_i = max(v_i − θ, 0)`` with ``θ`` the one number where
    ``Σ_i max(v_i − θ, 0) = 1``: with ``u`` the entries in descending order,
    ``ρ = max{k : u_k − (Σ_{i≤k} u_i − 1)/k > 0}`` and ``θ = (Σ_{i≤ρ} u_i − 1)/ρ``.

    Scale: adding ``c`` to every entry adds ``c`` to ``θ`` and leaves ``x`` unchanged, so
    the largest entry ``M`` is subtracted first. Then ``θ − M ∈ [−1, −1/n]`` (the largest
    term, ``M − θ``, is at most the sum 1), an entry below ``M − 1`` gets 0, and entries
    below ``M − 2`` are raised to ``−2`` without changing ``x``: the sums run over numbers
    in ``[−2, 0]`` whatever the size of ``v`` (1e308 and −1e308 included; without the shift
    ``v = [1e16, .1, .1]`` lost the ``− 1`` in ``1e16 − 1``, no ``k`` passed the test and
    the call raised). ``v_i − M`` within 2 of ``M`` is rounded once, by at most half an
    ulp of 2 (not at all where ``|M| ≥ 4``: Sterbenz's lemma), so every entry of ``x`` is
    the exact projection to a few ulps of 1 (absolute; ``x ∈ [0, 1]``) and ``Σx = 1`` to
    as many. tests/test_loss_range.py checks this against rational arithmetic for
    entries from 1e-300 to 1.7e308 in magnitude, either sign, spreads of 600 decades,
    ties and ``n = 1`` … 8 (measured: at most 0.17 ulp of 1).

    Raises ValueError for an empty ``v`` or a NaN or infinite entry (no projection).

    >>> project_simplex(torch.tensor([0.5, 0.5, 1.0], dtype=torch.float64)).tolist()
    [0.16666666666666663, 0.16666666666666663, 0.6666666666666666]
    >>> project_simplex(torch.tensor([1e16, 0.1, 0.1], dtype=torch.float64)).tolist()
    [1.0, 0.0, 0.0]
    """
    n = v.numel()
    if n == 0:
        raise ValueError("project_simplex: needs at least one entry (the simplex of none is empty)")
    if not bool(torch.isfinite(v).all()):
        bad = float(v[~torch.isfinite(v)][0])
        raise ValueError(f"project_simplex: every entry must be finite, got {bad}")
    w = (v - v.max()).clamp_min(-2.0)  # −inf (e.g. −1e308 − 1e308) too: it is below M − 1
    u, _ = torch.sort(w, descending=True)
    css = torch.cumsum(u, 0) - 1
    ks = torch.arange(1, n + 1, dtype=v.dtype, device=v.device)
    cond = u - css / ks > 0  # k = 1 always passes: u_1 = 0, css_1 = −1
    r = int(cond.nonzero().max()) + 1
    theta = css[r - 1] / r
    return (w - theta).clamp_min(0)
