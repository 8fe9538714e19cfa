"""FedFV: federated fair averaging by mitigating gradient conflicts.

Wang et al., "Federated Learning with Fair Averaging" (IJCAI 2021), Algorithm 1,
as in the authors' public code (github.com/WwZzz/easyFL, ``fedfv.py``). Round
``t = 1, 2, …`` (``info.round + 1``), cohort of ``m`` updates ``g_k = w − w_k``
with losses ``F_k`` at the received model:

1. **Internal conflicts.** Sorted by loss, the ``m − ⌈(m − 1)(1 − α)⌉`` highest-loss
   clients keep their update; every other ``g_i'`` is projected against each ``g_j``
   in ascending-loss order whenever ``⟨g_j, g_i'⟩ < 0``.
2. ``g = (1/m) Σ_i g_i'`` (uniform, as the paper and the public code).
3. **External conflicts** (only when ``t ≥ τ``): for ``s = t − τ + 1, …, t``, the
   clients last seen in round ``s`` with ``⟨g, g_k⟩ < 0`` sum to ``g_con``; if
   ``⟨g, g_con⟩ < 0``, ``g ← g − ⟨g, g_con⟩/‖g_con‖² g_con``.
4. Rescale: ``g ← g · ‖(1/m) Σ_k g_k‖ / ‖g‖``.

Checked against the public rule (tests/test_baselines_public.py, re-derived in
NumPy; float64 Gaussian cohorts, m = 2 … 14, d = 16, α ∈ {0, 0.1, 0.3, 0.5, 1},
τ ∈ {0, 1, 2, 3}, five rounds with recurring clients): max difference 6.7e-16.
Departures (robustness only): a zero ``g`` is returned as zero (not 0/0); rows with
``‖g_j‖ = 0`` never project; a projection that leaves only rounding is set to
exactly 0; rows whose squares over- or underflow are scaled by a power of two.

The steps in full, the Gram implementation, the state, the rule before, degenerate
cohorts and range: docs/explanation/methods.md (FedFV in detail).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypedDict

import torch

from fedloom.aggregate.base import CohortInfo
from fedloom.aggregate.gram import gram, lincomb64, matvec, out_of_range, row_scales, safe_norm
from fedloom.capabilities import AggregatorCaps
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["FedFV", "kept_count"]

_CHUNK = 1 << 15


class FedFVState(TypedDict):
    """The latest update of each client last seen in one of the previous τ − 1 rounds."""

    clients: torch.Tensor  # int64 [n]
    rounds: torch.Tensor   # int64 [n], the public round t (1-based) of that update
    rows: torch.Tensor     # [n, d]


def kept_count(m: int, alpha: float) -> int:
    """Clients that keep their update: ``m − ⌈(m − 1)(1 − α)⌉`` (0 at ``α = 0``).

    The public code's expression, evaluated in the same floating point. It
    differs from ``⌈αm⌉`` e.g. at α = 0.3 for m = 4, 7, 14 (1, 2, 4 instead of
    2, 3, 5).
    """
    if alpha <= 0 or m == 0:
        return 0
    return m - math.ceil((m - 1) * (1 - alpha))


def _parallel_tol(m: int, dtype: torch.dtype) -> float:
    """A projection that leaves less than ``(8·m·eps(dtype))²`` of ``‖x‖²`` (or of the
    rounding scale of the Gram quadratic form, ``8·m·eps64``) removed a direction
    parallel to ``x`` within the rows' rounding (``3v`` in float32 is ``v``'s
    direction only to ``eps32``): the exact result is 0, and the remainder is
    rounding whose direction and sign follow the rows' order."""
    return max((8 * m * torch.finfo(dtype).eps) ** 2, 8 * m * torch.finfo(torch.float64).eps)


def _internal(
    G: torch.Tensor, order: list[int], keep: set[int], tol: float
) -> tuple[torch.Tensor, int]:
    """Step 1 as coefficients ``C`` (``g_i' = Σ_j C_ij g_j``) on the Gram ``G``.

    A ``g_i'`` that a projection leaves at zero within rounding (``C_iᵀGC_i ≤
    tol·|C_i|ᵀ|G||C_i|``: a numerically rank-one cohort, ``g_j = −c·g_i``) is set to
    exactly 0, so that no later projection acts on its rounding noise.
    """
    m = G.shape[0]
    C = torch.eye(m, dtype=torch.float64, device=G.device)
    absG = G.abs()
    conflicts = 0
    for i in range(m):
        if i in keep:
            continue
        for j in order:
            if j == i or G[j, j] <= 0:
                continue
            dot = float(G[j] @ C[i])  # ⟨g_j, g_i'⟩
            if dot < 0:
                C[i, j] -= dot / float(G[j, j])
                conflicts += 1
                c = C[i]
                if float(c @ G @ c) <= tol * float(c.abs() @ absG @ c.abs()):
                    C[i] = 0.0
                    break
    return C, conflicts


def _external(g: torch.Tensor, rows: torch.Tensor, tol: float) -> tuple[torch.Tensor, int]:
    """Step 3 for one round's rows: ``g`` less its projection on the sum of the rows it
    conflicts with; 0 where that removes ``g`` within rounding (``g ∥ g_con``)."""
    if rows.shape[0] == 0:
        return g, 0
    sel = (matvec(rows, g) < 0).to(torch.float64)
    if not bool(sel.any()):
        return g, 0
    g_con = lincomb64(rows, sel, chunk=_CHUNK)
    # a power of two (exact) keeps ⟨g_con, g_con⟩ finite for rows of any size
    g_con = g_con * float(row_scales(g_con[None, :])[0])
    dot, nn = float(g @ g_con), float(g_con @ g_con)
    if not (dot < 0 and nn > 0):
        return g, 0
    gg = float(g @ g)
    g = g - (dot / nn) * g_con
    if float(g @ g) <= tol * gg:
        g = torch.zeros_like(g)
    return g, 1


class FedFV:
    """FedFV with the public code's rule.

    Args:
        alpha: fraction of highest-loss clients that keep their update (public
            count ``m − ⌈(m − 1)(1 − α)⌉``).
        tau: rounds of client updates the aggregate is de-conflicted against,
            the current one included (0: none).

    Reference:
        paper: Wang et al., "Federated Learning with Fair Averaging", IJCAI 2021, Algorithm 1.
        code: WwZzz/easyFL (``fedfv.py``).
        departures: a zero aggregate is returned as zero (the public code divides 0 by 0); a
            projection that leaves only rounding (a rank-one cohort) leaves exactly 0.
        measured: max difference 6.7e-16 against the public rule re-derived in NumPy (m = 2 …
            14, five rounds; tests/test_baselines_public.py).
    """

    # server.lr=auto: the direction has the FedAvg step's norm and the public code applies it as
    # is (model − g_t): η_g = 1.
    default_server_lr = 1.0

    capabilities = AggregatorCaps(requires=frozenset({"start_losses"}))

    def __init__(self, alpha: float = 0.1, tau: int = 1) -> None:
        if not 0 <= alpha <= 1:
            raise ValueError(f"aggregator.options.alpha: must be in [0, 1], got {alpha}")
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
            raise ValueError(f"aggregator.options.tau: must be an integer >= 0, got {tau}")
        self.alpha, self.tau = alpha, tau

    def init(self, layout: Layout) -> FedFVState:
        return {"clients": torch.zeros(0, dtype=torch.int64),
                "rounds": torch.zeros(0, dtype=torch.int64),
                "rows": torch.zeros(0, layout.size)}

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: FedFVState, *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, FedFVState, Mapping[str, float]]:
        if info is None or info.start_losses is None:
            raise ValueError("fedfv: needs the clients' losses (info.start_losses)")
        m = updates.shape[0]
        t = info.round + 1  # the public code counts rounds from 1
        ids = info.clients.to(updates.device, torch.int64)  # the state lives on the device

        if not isinstance(state, dict):  # a checkpoint of the former rule: no client history
            state = self.init(Layout.flat(updates.shape[1]))
        # A client in this cohort counts only in this round from now on.
        old_ok = ~torch.isin(state["clients"], ids) & (state["rounds"] > t - self.tau)
        h_ids, h_rounds, h_rows = (state["clients"][old_ok], state["rounds"][old_ok],
                                   state["rows"][old_ok])

        # 1. internal conflicts on the Gram matrix, of the rows scaled by one power of
        # two where their squares would over- or underflow (projections are homogeneous)
        G, _ = gram(updates)
        scale = None
        if out_of_range(G, updates, torch.float64):
            scale = row_scales(updates, common=True)
            G, _ = gram(updates, scale=scale)
        order = torch.argsort(info.start_losses.to(torch.float64), stable=True)  # ascending
        n_keep = kept_count(m, self.alpha)
        keep = set(order[m - n_keep :].tolist()) if n_keep else set()
        C, conflicts = _internal(G, order.tolist(), keep, _parallel_tol(m, updates.dtype))

        # 2. uniform mean, as a float64 vector (times the scale: s·g)
        g = lincomb64(updates, C.mean(0), scale=scale, chunk=_CHUNK)

        # 3. external conflicts with the clients of rounds t − τ + 1 … t, oldest first
        external = 0
        if self.tau and t >= self.tau:
            for r in range(t - self.tau + 1, t + 1):
                rows = updates if r == t else h_rows[h_rounds == r]
                g, hit = _external(g, rows, _parallel_tol(m, updates.dtype))
                external += hit

        # 4. rescale to ‖mean_k g_k‖ (both norms without squaring the entries)
        mean = lincomb64(updates, torch.full((m,), 1.0 / m, dtype=torch.float64,
                                             device=updates.device), chunk=_CHUNK)
        target = safe_norm(mean)
        norm = safe_norm(g)
        if norm > 0:
            g = g * (target / norm) if scale is None else (g / norm) * target

        # Round t + 1 looks back to round t − τ + 2: keep only what it can use.
        live = h_rounds > t + 1 - self.tau
        new_state: FedFVState = {"clients": h_ids[live], "rounds": h_rounds[live],
                                 "rows": h_rows[live].to(updates.dtype)}
        if self.tau > 1:
            new_state = {
                "clients": torch.cat([new_state["clients"], ids]),
                "rounds": torch.cat([new_state["rounds"],
                                     torch.full((m,), t, dtype=torch.int64,
                                                device=updates.device)]),
                "rows": torch.cat([new_state["rows"], updates.detach()]),
            }
        return g.to(updates.dtype), new_state, {"fedfv_projections": float(conflicts),
                                                "fedfv_external_projections": float(external)}


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "fedfv")(FedFV)
