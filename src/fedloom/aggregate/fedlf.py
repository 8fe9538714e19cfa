"""FedLF: layer-wise fair federated learning.

Pan et al., "FedLF: Layer-Wise Fair Federated Learning" (AAAI 2024); public
code github.com/zibinpan/FedLF (``gfedplat/algorithm/FedLF/FedLF.py``). For the
cohort's updates ``g_i`` (rows), losses ``l`` at the received model and the
preference ``p = 1/√m``, per group ``q``:

1. Rescale each client's update to the cohort's mean norm ``μ_q``: ``Q_i = μ_q g_i^q / ‖g_i^q‖``.
2. A fairness direction ``h = ((l·p) l/‖l‖ − p ‖l‖)/‖l‖²``, ``f = μ_q (hQ)/‖hQ‖``, appended.
3. Solve ``min_{λ∈Δ} ‖λᵀ Q'‖²`` (the min-norm point of the rows' hull); ``d_q = λᵀ Q'``.

The groups' directions are concatenated and rescaled to ``‖(1/m) Σ_k g_k‖``. ``groups``:
``"tensor"`` (default, the public code: one group per parameter tensor) or ``"layer"``.

Checked against the public rule (tests/test_baselines_public.py, re-derived in NumPy with
an exact min-norm solver; float64 cohorts, m = 2 … 5, distinct and equal losses): max
difference 1.4e-14 (directions of norm ≈ 1). Departures: fedloom runs on whatever rows it
receives (the public code on full-batch gradients); no history rows of absent clients; a
zero update, or a min-norm point shorter than ``1e-6·μ_q``, gives its group a zero
direction (``fedlf_zero_groups``); equal losses leave the fairness row out (the public
code gets rounding noise or NaN); the public final guard is not needed.

The groups, equal losses, each departure and the numerics with measurements:
docs/explanation/methods.md (FedLF in detail).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from fedloom.aggregate.base import CohortInfo
from fedloom.aggregate.gram import gram, lincomb64, out_of_range, row_scales, safe_norm
from fedloom.capabilities import AggregatorCaps
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["FedLF", "min_norm_point"]

_GROUPS = ("tensor", "layer")
# A group's min-norm point shorter than this fraction of the cohort's mean norm μ_q
# is the origin within the solver's accuracy (see FedLF.__call__).
_ZERO_REL = 1e-6


def min_norm_point(P: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``argmin_{λ∈Δ} λᵀPλ`` for a Gram matrix ``P = QQᵀ``: the min-norm point of the
    rows' convex hull, by Wolfe's algorithm (Wolfe, Math. Programming 11, 1976).

    A corral ``S`` of affinely independent rows is grown by the row ``j`` least
    aligned with the current point ``x = λᵀQ`` while ``‖x‖² − ⟨x, q_j⟩ > eps·max‖q_i‖²``
    (the optimality gap); each minor cycle moves to the affine minimiser of ``S``
    (the bordered system ``[P_S 1; 1ᵀ 0]``) or, if that leaves the hull, to the
    first boundary on the way and drops the rows whose weight reached zero. Exact up
    to rounding in finitely many steps, also for rank-deficient ``P`` (more clients
    than a tensor's width) and norms spread over many orders, where a projected
    gradient method stalls (measured on 600 random Gram matrices, n ≤ 7, norms
    spread 1e-3 … 1e3, nearly duplicated rows: max error of ``λᵀQ`` 4.5e-11
    relative to ``max‖q_i‖`` against an exhaustive active-set search, where 2000
    FISTA steps reach 5.3e-3 and take several hundred times as long).

    Scale-invariant: ``P`` is divided by ``max P_ii`` first (the weights of ``c·Q``
    are those of ``Q``), so the result is the same for ``‖q‖`` from 1e-12 to 1e12
    (max error 6.4e-15 of ``max‖q‖`` against the exact search; see
    docs/explanation/methods.md (FedLF in detail) for the error before). A non-finite
    ``P`` gives uniform weights.
    """
    G = P.detach().to(torch.float64).cpu().numpy()  # a small m × m solve, on the host
    n = G.shape[0]
    diag = np.diag(G)
    scale = float(diag.max()) if n else 0.0
    if not scale > 0 or not np.isfinite(G).all():
        # every row is zero, or P is not a (finite) Gram matrix: any λ
        return torch.full((n,), 1.0 / max(n, 1), dtype=torch.float64, device=P.device)
    # The min-norm weights of c·Q are those of Q: solve on P / max‖q_i‖², so that the
    # bordered system [P_S 1; 1ᵀ 0] is balanced whatever the rows' scale (unscaled,
    # its lstsq lost the P block against the 1s: 2–3 % off at ‖q‖ = 1e4, up to 17 %
    # or λ = 0 at 1e6, 5–27 % at 1e-8).
    G = G / scale
    scale = 1.0
    lam = np.zeros(n)
    S = [int(np.argmin(diag))]
    lam[S[0]] = 1.0
    for _ in range(50 * n + 50):
        Gl = G @ lam
        j = int(np.argmin(Gl))
        if float(lam @ Gl - Gl[j]) <= eps * scale or j in S:
            break  # optimal: no row lies further towards the origin than x
        S.append(j)
        while True:  # minor cycle
            k = len(S)
            A = np.ones((k + 1, k + 1))
            A[:k, :k] = G[np.ix_(S, S)]
            A[k, k] = 0.0
            rhs = np.zeros(k + 1)
            rhs[k] = 1.0
            # least squares: rounding can make a nearly dependent corral singular
            alpha = np.linalg.lstsq(A, rhs, rcond=None)[0][:k]
            if float(alpha.min()) > 0:
                lam[:] = 0.0
                lam[S] = alpha / alpha.sum()
                break
            cur = lam[S]
            out = alpha <= 0
            ratio = np.full(k, np.inf)
            ratio[out] = cur[out] / (cur[out] - alpha[out])
            hit = int(np.argmin(ratio))
            new = cur + float(ratio[hit]) * (alpha - cur)
            new[hit] = 0.0
            alive = new > 1e-15
            S = [s for s, a in zip(S, alive.tolist(), strict=True) if a]
            lam[:] = 0.0
            lam[S] = new[alive] / new[alive].sum()
            if j not in S:
                # the new row left at once: no progress is possible in floating point
                return torch.from_numpy(lam).to(P.device)
    return torch.from_numpy(lam).to(P.device)


class FedLF:
    """FedLF with the public code's per-tensor groups by default.

    Args:
        groups: ``"tensor"`` (one group per parameter tensor, the public code)
            or ``"layer"`` (fedloom's layer groups).

    Reference:
        paper: Pan et al., "FedLF: Layer-Wise Fair Federated Learning", AAAI 2024.
        code: zibinpan/FedLF (``gfedplat/algorithm/FedLF/FedLF.py``).
        departures: runs on the rows it receives (local-training pseudo-gradients; the public
            code uses full-batch gradients); no history rows of absent clients; a group with a
            zero update, or whose min-norm point is below 1e-6·μ_q, gets a zero direction; equal
            losses leave the fairness row out; the public final guard is not reproduced (the
            exact min-norm point never needs it).
        measured: max difference 1.4e-14 against the public rule re-derived in NumPy with an
            exact min-norm solver (tests/test_baselines_public.py).
    """

    # server.lr=auto: rescaled to the FedAvg step's norm ‖(1/m) Σ g_k‖: FedAvg's step.
    default_server_lr = 1.0

    capabilities = AggregatorCaps(requires=frozenset({"start_losses"}))

    def __init__(self, groups: str = "tensor") -> None:
        if groups not in _GROUPS:
            raise ValueError(
                f"aggregator.options.groups: must be one of {', '.join(_GROUPS)}, got {groups!r}"
            )
        self.groups = groups

    def init(self, layout: Layout) -> tuple[tuple[int, int], ...]:
        if self.groups == "tensor":
            return tuple((t.offset, t.offset + t.numel) for t in layout.tensors)
        return tuple((g.start, g.stop) for g in layout.groups)

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: tuple[tuple[int, int], ...],
        *, info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, tuple[tuple[int, int], ...], Mapping[str, float]]:
        if info is None or info.start_losses is None:
            raise ValueError("fedlf: needs the clients' losses (info.start_losses)")
        if not state or state[-1][1] != updates.shape[1]:
            raise ValueError(
                f"fedlf: updates have {updates.shape[1]} columns, the layout has "
                f"{state[-1][1] if state else 0}"
            )
        m = updates.shape[0]
        h = _fairness(info.start_losses.to(device=updates.device, dtype=torch.float64))
        out = torch.zeros(updates.shape[1], dtype=torch.float64, device=updates.device)
        zero_groups = 0
        for start, stop in state:
            coef, scale = _group_coef(updates[:, start:stop], h)
            if coef is None:
                zero_groups += 1
                continue
            out[start:stop] = lincomb64(updates[:, start:stop], coef, scale=scale)
        # rescaled to ‖(1/m) Σ g_k‖, both norms taken without squaring the entries
        m_inv = torch.full((m,), 1.0 / m, dtype=torch.float64, device=updates.device)
        target = safe_norm(lincomb64(updates, m_inv, scale=None))
        norm = safe_norm(out)
        if norm > 0:
            out = (out / norm) * target
        return out.to(updates.dtype), state, {"fedlf_zero_groups": float(zero_groups)}


def _fairness(loss: torch.Tensor) -> torch.Tensor:
    """The fairness row's weights ``h = ((l·p) l/‖l‖ − p‖l‖)/‖l‖²`` (``p = 1/√m``) for
    the losses ``l``, up to a positive factor; 0 for equal losses (see FedLF).

    ``h(c·l) = h(l)/c`` for ``c > 0`` and only ``h``'s direction is used (``f`` is
    normalised, ``w = λ + λ_f h/‖Σ h_i û_i‖`` too, the equal-losses test is scale-free),
    so ``h`` is taken of ``l/max|l|`` (one rounding per entry, none for a power of two):
    ``‖l‖`` and ``‖l‖²`` stay in range for every finite ``l``. Before, losses of 1e160
    (``‖l‖² = inf``) or 1e-170 (``‖l‖ = 0``) dropped the fairness row without a word.
    tests/test_loss_range.py: losses of either sign from 1e-300 to 1e300, spreads of 600
    decades. A NaN or infinite loss raises ValueError (the engine rejects such clients).
    """
    if not bool(torch.isfinite(loss).all()):
        raise ValueError(f"fedlf: the start losses must be finite, got {loss.tolist()}")
    m = loss.numel()
    h = torch.zeros(m, dtype=torch.float64, device=loss.device)
    top = float(loss.abs().max()) if m else 0.0
    if not top > 0:
        return h
    loss = loss / top
    p = torch.full((m,), m**-0.5, dtype=torch.float64, device=loss.device)
    ln: torch.Tensor = torch.linalg.vector_norm(loss)
    h = (torch.dot(loss, p) * loss / ln - p * ln) / (ln * ln)
    if float(torch.linalg.vector_norm(h) * ln) < 1e-12:
        h.zero_()  # equal losses: the row would not move d* (see the FedLF docstring)
    return h


def _group_coef(
    R: torch.Tensor, h: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One group's ``d_q = Σ_i c_i (s_i r_i)``: ``(c, s)``, or ``(None, None)`` for a zero
    direction (a zero row, or a min-norm point below ``1e-6·μ_q``).

    Solved on unit rows ``û_i = r_i/‖r_i‖``: ``Q = μ_q Û`` and ``f = μ_q f̂`` with
    ``f̂ = Σ h_i û_i / ‖Σ h_i û_i‖``, so the min-norm weights are those of ``[Û; f̂]``
    (scale-free) and ``d_q = μ_q (Σ_i λ_i û_i + λ_f f̂)``. The Gram is taken of the rows
    scaled by powers of two where their squares would over- or underflow
    (:func:`~fedloom.aggregate.gram.row_scales`).
    """
    G, _ = gram(R)
    scale = None
    if out_of_range(G, R, torch.float64):
        scale = row_scales(R)
        G, _ = gram(R, scale=scale)
    if not bool(torch.isfinite(G).all()):  # non-finite input: a NaN direction, rejected
        return torch.full((G.shape[0],), float("nan"), dtype=torch.float64,
                          device=G.device), None
    n = G.diagonal().clamp_min(0).sqrt()                 # ‖s_i r_i‖
    if not bool((n > 0).all()):
        return None, None  # a client with a zero group: the hull holds 0, d_q = 0
    true_n = n if scale is None else n / scale           # ‖r_i‖
    mu = float(true_n.mean())
    Gu = G / (n[:, None] * n[None, :])                   # Û Ûᵀ
    m = G.shape[0]
    f2 = float((h @ Gu @ h).clamp_min(0))                # ‖Σ h_i û_i‖²
    if f2 > 0:
        fn = f2**0.5
        Gp = torch.zeros(m + 1, m + 1, dtype=torch.float64, device=G.device)
        Gp[:m, :m] = Gu
        Gp[:m, m] = Gp[m, :m] = (Gu @ h) / fn            # ⟨û_i, f̂⟩
        Gp[m, m] = 1.0
        lam = min_norm_point(Gp)
        w = lam[:m] + lam[m] * h / fn                    # d_q/μ_q = Σ w_i û_i
    else:
        w = min_norm_point(Gu)
    # ‖d_q‖² = μ² wᵀ Ĝ w. When the hull (nearly) holds the origin the min-norm point is
    # 0 up to the solver's gap test (‖x‖² − ⟨x, q_j⟩ ≤ 1e-12·max‖q_i‖², so ‖x‖ ≲ 1e-6·μ_q):
    # its direction is rounding noise that the final rescaling would blow up, and it
    # depends on the clients' order.
    if not float(w @ Gu @ w) > _ZERO_REL**2:
        return None, None
    return mu * w / n, scale

# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "fedlf")(FedLF)
