"""LoRA-aware aggregation: FedIT's mean of the factors, and the exact mean of the products.

A LoRA adapter changes a projection by ``(α/r) B A`` (``A`` is ``[r, in]``, ``B`` is
``[out, r]``; :mod:`fedloom.models.llm`). Averaging the factors, as FedAvg does on the
flat adapter vector, gives ``mean(B_k) mean(A_k)``, which is not the mean of the
clients' changes ``mean(B_k A_k)``: the difference is the clients' covariance,
``B̄Ā − mean(B_k A_k) = ḡ_B ḡ_A − mean(g_{B,k} g_{A,k})`` in their updates ``g``.

- ``fedit`` (Zhang et al. 2024) is that mean of the factors, FedAvg itself, and
  measures its error each round: ``lora_product_error`` = ``‖B̄Ā − M‖_F / ‖M‖_F``
  with ``M = Σ_k p_k B_k A_k``, pooled over the adapted projections (the square root
  of the summed squared numerators over that of the summed squared denominators),
  and ``lora_product_error_max``, the largest projection's.
- ``lora_exact`` computes ``M`` per adapted projection, keeps its best rank-``r``
  approximation (truncated SVD) and refactorises it into the next global ``A``
  and ``B``; it reports the FedIT error it avoids and the truncation it makes.

Both read the A/B pairing of the :class:`~fedloom.params.Layout` (the tensors named
``….lora_A.…`` and ``….lora_B.…`` of one layer group, as
:meth:`fedloom.models.llm.CausalLM.fedloom_layer_groups` makes them) and the global
model the cohort's rows are relative to (``CohortInfo.w``, asked for with
``requires={"w"}``): ``B_k = B − g_{B,k}``, ``A_k = A − g_{A,k}``. Each rule's paper,
public code and departures are in its class's docstring; the numerics and the
coordinates outside any pair: docs/explanation/methods.md (LoRA aggregation in detail).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fedloom.aggregate.base import CohortInfo, check_cohort, normalise_weights
from fedloom.aggregate.mean import FedAvg
from fedloom.capabilities import AggregatorCaps
from fedloom.params import Layout, lora_default_ranks
from fedloom.plain import state_type
from fedloom.registry import register

__all__ = ["FedIT", "HetLoRA", "LoRAExact", "LoRAPairs", "RankCuts", "lora_pairs", "mean_product",
           "refactorise"]

log = logging.getLogger("fedloom")

# A singular value at or below this fraction of a projection's largest is read as zero:
# the products are formed in float64 from float32 (or float64) factors, whose rounding
# is about 1e-16 of the largest; 1e-12 leaves four orders of margin.
_RANK_TOL = 1e-12
# The closest split is kept when B'A' is M_r to this relative accuracy (float64
# rounding is ~1e-15 of it); else C was singular and the balanced split is used.
_EXACT_TOL = 1e-8
# ... and when the part of Ā it keeps on M's row space is at least this fraction of the
# clients' A_k (a root-mean-square row norm): B' grows as its inverse, and float32's
# 1e-7 of A in the next global model becomes about 1e-4 of the product at this bound.
_COND_TOL = 1e-3
Pair = tuple[int, int, int, int, int]  # a_offset, r, fan_in, b_offset, fan_out


@state_type  # checkpoints hold it (fedloom.plain)
@dataclass
class LoRAPairs:
    """The adapted projections of a layout: ``(a_offset, r, in, b_offset, out)`` each,
    and the layout's size (the rows' width)."""

    pairs: tuple[Pair, ...]
    d: int


def lora_pairs(layout: Layout) -> LoRAPairs:
    """Each layer group's ``lora_A`` and ``lora_B`` tensors, paired by name
    (:meth:`fedloom.params.Layout.lora_pairs`)."""
    try:
        return LoRAPairs(layout.lora_pairs(), layout.size)
    except ValueError as e:
        raise ValueError(f"aggregator: {e}") from None


def _clients(pair: Pair, w: torch.Tensor, rows: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``A [r, in]``, ``B [out, r]`` of the global model and the clients' ``A_k [m, r, in]``,
    ``B_k [m, out, r]``, float64."""
    a0, r, fin, b0, fout = (int(v) for v in pair)
    m = rows.shape[0]
    a = w[a0:a0 + r * fin].double().view(r, fin)
    b = w[b0:b0 + fout * r].double().view(fout, r)
    ak = a - rows[:, a0:a0 + r * fin].double().view(m, r, fin)
    bk = b - rows[:, b0:b0 + fout * r].double().view(m, fout, r)
    return a, b, ak, bk


def _stacked(p: torch.Tensor, ak: torch.Tensor, bk: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """FLoRA's stacking: ``[p_1 B_1, …, p_m B_m]`` ``[out, m r]`` and ``[A_1; …; A_m]``
    ``[m r, in]``, whose product is ``Σ_k p_k B_k A_k``."""
    m, r, fin = ak.shape
    bc = (p.view(m, 1, 1) * bk).permute(1, 0, 2).reshape(bk.shape[1], m * r)
    return bc, ak.reshape(m * r, fin)


def mean_product(p: torch.Tensor, ak: torch.Tensor, bk: torch.Tensor) -> torch.Tensor:
    """``M = Σ_k p_k B_k A_k`` ``[out, in]``."""
    bc, ac = _stacked(p, ak, bk)
    return bc @ ac


def _svd_of_stack(bc: torch.Tensor, ac: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``U, S, V`` of ``bc @ ac`` through the QR factors of the two stacks: the SVD of a
    ``[m r, m r]`` core, not of the ``[out, in]`` product (Llama's 4096 × 4096)."""
    q1, r1 = torch.linalg.qr(bc)          # [out, k1], [k1, m r]
    q2, r2 = torch.linalg.qr(ac.T)        # [in, k2], [k2, m r]
    uk, s, vkh = torch.linalg.svd(r1 @ r2.T, full_matrices=False)
    return q1 @ uk, s, q2 @ vkh.T


def refactorise(p: torch.Tensor, ak: torch.Tensor, bk: torch.Tensor,
                split: Literal["closest", "balanced"] = "closest"
                ) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """The next global ``(A', B')`` of one projection with ``B'A' = M_r``, the best
    rank-``r`` approximation of ``M = Σ p_k B_k A_k``; with ``‖M − M_r‖²_F`` and
    ``‖M‖²_F`` (from the singular values).

    ``split="closest"``: ``A'`` is the FedAvg ``Ā = Σ p_k A_k`` projected onto the row
    space of ``M_r`` (completed, where ``M_r`` has rank ``q < r``, by the part of
    ``Ā``'s row space outside it), ``B' = M_r A'⁺``: where ``M_r`` has rank ``r``, the
    exact factorisation whose ``A'`` is nearest ``Ā``. It is FedAvg whenever the
    clients share ``A`` (then ``M = B̄A``), and it gives back ``(A, B)`` when every
    client sends the same pair; ``M = 0`` (every ``B_k`` zero, as at the start) gives
    ``(Ā, 0)``. Where ``Ā`` is (nearly) orthogonal to ``M``'s row space (the clients'
    ``A_k`` cancel in their mean) no such ``A'`` carries ``M_r``, and that projection
    gets the balanced split.
    ``split="balanced"``: ``B' = U_r √S_r``, ``A' = √S_r V_rᵀ``; both factors carry
    ``√σ``, so a small product makes a small ``A`` too (and ``M = 0`` makes ``A' = 0``,
    from which LoRA's gradients are zero).
    """
    _, r, fin = ak.shape
    bc, ac = _stacked(p, ak, bk)
    u, s, v = _svd_of_stack(bc, ac)
    total = float((s * s).sum())
    kept = s[:r]
    trunc = float((s[r:] * s[r:]).sum())
    big = float(s[0]) if s.numel() else 0.0
    q = int((kept > big * _RANK_TOL).sum()) if big > 0 else 0
    if split == "balanced":
        a_new, b_new = _balanced(u, kept, v, r, fin)
        return a_new, b_new, trunc, total
    a_bar = torch.einsum("k,kri->ri", p, ak)
    vq = v[:, :q]
    if q < r:
        # the rest of the basis from Ā's rows outside span(V_q), largest first
        rest = a_bar.T - vq @ (vq.T @ a_bar.T)
        w_, sw, _ = torch.linalg.svd(rest, full_matrices=False)
        scale = float(a_bar.abs().max()) if a_bar.numel() else 0.0
        keep = int((sw > max(scale, 1e-300) * _RANK_TOL * max(fin, r)).sum())
        vq = torch.cat([vq, w_[:, : min(keep, r - q)]], dim=1)
    c = a_bar @ vq                                    # [r, r']
    a_new = c @ vq.T                                  # Ā projected onto span(vq)
    # B' = U_q S_q V_qᵀ A'⁺ with A'⁺ = vq C⁺: U_q S_q times the first q rows of C⁺
    b_new = (u[:, :q] * s[:q]) @ torch.linalg.pinv(c)[:q]
    if q:
        # Ā (nearly) orthogonal to M's row space (clients' A_k that cancel in the mean)
        # makes C (nearly) singular: B'A' misses M_r, or A' is tiny and B' huge (float32
        # then loses A' in w − Δ). That projection gets the balanced split.
        a_rms = math.sqrt(float(torch.einsum("k,kri->", p, ak * ak)) / r)
        c_min = float(torch.linalg.svdvals(c[:, :q])[-1])
        m_r = (u[:, :q] * s[:q]) @ v[:, :q].T
        if c_min <= _COND_TOL * a_rms or float(((b_new @ a_new - m_r) ** 2).sum()) > (
                _EXACT_TOL ** 2 * float((s[:q] ** 2).sum())):
            a_new, b_new = _balanced(u, kept, v, r, fin)
    return a_new, b_new, trunc, total


def _balanced(u: torch.Tensor, kept: torch.Tensor, v: torch.Tensor, r: int, fin: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``A' = √S_r V_rᵀ``, ``B' = U_r √S_r`` (zero rows and columns past ``M``'s rank)."""
    k = kept.numel()
    root = kept.clamp(min=0).sqrt()
    a_new = torch.zeros(r, fin, dtype=torch.float64)
    b_new = torch.zeros(u.shape[0], r, dtype=torch.float64)
    a_new[:k] = root.unsqueeze(1) * v[:, :k].T
    b_new[:, :k] = u[:, :k] * root
    return a_new, b_new


def _ratio(num_sq: float, den_sq: float) -> float:
    """``√num / √den``; 0 when both are 0 (no product, no error)."""
    if den_sq > 0:
        return math.sqrt(num_sq / den_sq)
    return 0.0 if num_sq == 0 else math.inf


def _need_w(rule: str, info: CohortInfo | None, d: int) -> torch.Tensor:
    if info is None or info.w is None:
        raise ValueError(f"{rule}: needs the global model the rows are relative to "
                         "(CohortInfo.w, which the engine gives a rule that requires 'w')")
    if tuple(info.w.shape) != (d,):
        raise ValueError(f"{rule}: the global model has shape {tuple(info.w.shape)}, "
                         f"the layout {d} coordinates")
    return info.w


class FedIT(FedAvg):
    """FedIT: FedAvg of the adapters (``A`` and ``B`` averaged apart), with the error
    ``‖B̄Ā − Σ p_k B_k A_k‖_F / ‖Σ p_k B_k A_k‖_F`` logged each round
    (``lora_product_error``, pooled over the adapted projections, and
    ``lora_product_error_max``).

    Reference:
        paper: Zhang et al., "Towards Building the Federated GPT: Federated Instruction
            Tuning", ICASSP 2024 (arXiv 2305.05644).
        code: JayZhang42/FederatedGPT-Shepherd, fed_utils/model_aggregation.py (checked:
            the n_k-weighted mean of every adapter tensor, which is FedAvg on the flat
            adapter vector; tests/test_lora.py compares the two).
        departures: the error metric is fedloom's (the paper does not measure it); it
            costs one ``[out, in]`` product a projection (``measure=False`` skips it).
            It reads each client's row: under ``server.secure_aggregation`` a sum-only
            server could not compute it (the simulation does; the direction is the
            sum's), and with ``privacy.mode: central`` the rule is not called, so it is
            not logged.
    """

    def __init__(self, weighted: bool = True, measure: bool = True) -> None:
        super().__init__(weighted)
        self.measure = measure

    @property
    def capabilities(self) -> AggregatorCaps:
        """FedAvg's; the global model only to measure the error."""
        return AggregatorCaps(requires=frozenset({"w"}) if self.measure else frozenset(),
                              linear=True, dp_mean=True, weighted=bool(self.weighted))

    def init(self, layout: Layout) -> LoRAPairs:  # type: ignore[override]
        return lora_pairs(layout)

    def __call__(  # type: ignore[override]
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        state: LoRAPairs,
        *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, LoRAPairs, Mapping[str, float]]:
        out, _, _ = super().__call__(updates, weights, None, info=info)
        if not self.measure or not state.pairs:
            return out, state, {}
        w = _need_w("fedit", info, state.d)
        p = normalise_weights(weights if self.weighted else torch.ones_like(weights),
                              torch.float64).cpu()
        rows = updates.detach().cpu()
        num, den, worst = 0.0, 0.0, 0.0
        for pair in state.pairs:
            _, _, ak, bk = _clients(pair, w.detach().cpu(), rows)
            m_ = mean_product(p, ak, bk)
            mean_b, mean_a = torch.einsum("k,kor->or", p, bk), torch.einsum("k,kri->ri", p, ak)
            e = float(((mean_b @ mean_a - m_) ** 2).sum())
            t = float((m_ * m_).sum())
            num, den, worst = num + e, den + t, max(worst, _ratio(e, t))
        return out, state, {"lora_product_error": _ratio(num, den),
                            "lora_product_error_max": worst}


class LoRAExact:
    """The exact mean of the adapters' products, refactorised to rank ``r``: per adapted
    projection ``M = Σ_k p_k B_k A_k``, its truncated SVD ``M_r``, and ``(A', B')``
    with ``B'A' = M_r`` (``split``: :func:`refactorise`); the direction is the step from
    the global ``(A, B)`` to ``(A', B')``, so ``server.optimizer: sgd`` with
    ``server.lr: 1`` (the default here) makes them the next global adapters.

    What is sent: the same as FedIT, each client's ``A_k`` and ``B_k`` (as the update
    ``g_k``, through any compressor and feedback). What is lost: the rank-``r``
    truncation of ``M`` (whose rank is up to ``m r``), logged each round as
    ``lora_truncation_error`` = ``‖M − M_r‖_F / ‖M‖_F`` pooled over the projections
    (with ``lora_product_error``, FedIT's error on the same cohort, for comparison).
    The truncation error is never above FedIT's: ``B̄Ā`` has rank at most ``r`` and
    ``M_r`` is the nearest rank-``r`` matrix to ``M`` (Eckart–Young), per projection.
    With configs/llm/tiny.yaml (10 rounds) it went 0.0020 → 0.0003 while FedIT's went
    0.0030 → 0.0005, and the test perplexity matched FedAvg's to 0.01
    (docs/howto/llm.md).

    Reference:
        paper: the exact aggregation FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning
            Large Language Models with Heterogeneous Low-Rank Adaptations", NeurIPS 2024)
            and FedEx-LoRA (Singhal et al., "Exact Aggregation for Federated and
            Efficient Fine-Tuning of Foundation Models", ACL 2025) compute; both fold it
            into the frozen base instead of refactorising.
        code: ATP-1010/FederatedLLM, fed_utils/model_aggregation.py (checked: FLoRA's
            stacking, p_k on the A rows and B concatenated unweighted, whose product is
            this rule's M; tests/test_lora.py compares the two).
        departures: FLoRA merges the stacked product into the base weights and starts
            fresh adapters each round, FedEx-LoRA keeps FedAvg's factors and adds the
            residual ``M − B̄Ā`` to the base: both change the base, which fedloom keeps
            frozen, never sent and the same on every client. Here the base never
            changes and the global adapters carry ``M_r``: exact when ``M`` has rank at
            most ``r`` (e.g. clients that share ``A``), else the truncation above.
            With stale rows (buffered aggregation) the clients' factors are read
            against the current global model.
    """

    default_server_lr = 1.0

    def __init__(self, weighted: bool = True,
                 split: Literal["closest", "balanced"] = "closest") -> None:
        if split not in ("closest", "balanced"):
            raise ValueError(f"aggregator.options.split: must be 'closest' or 'balanced', "
                             f"got {split!r}")
        self.weighted = weighted
        self.split: Literal["closest", "balanced"] = split

    @property
    def capabilities(self) -> AggregatorCaps:
        """Needs the global model; not linear in the rows (a product and an SVD)."""
        return AggregatorCaps(requires=frozenset({"w"}), weighted=bool(self.weighted))

    def init(self, layout: Layout) -> LoRAPairs:
        pairs = lora_pairs(layout)
        if not pairs.pairs:
            # not an error: with model.options.lora.train: b (A shared and frozen) the mean of B
            # is already the mean of the products, and any other model has no product
            log.warning("lora_exact: the model has no LoRA pair (lora_A and lora_B tensors "
                        "in one layer group): the weighted mean (fedavg) on every coordinate")
        return pairs

    def __call__(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        state: LoRAPairs,
        *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, LoRAPairs, Mapping[str, float]]:
        check_cohort("lora_exact", updates, weights)
        p = normalise_weights(weights if self.weighted else torch.ones_like(weights),
                              updates.dtype)
        out = p @ updates  # the mean where no pair is
        if not state.pairs:
            return out, state, {}
        w = _need_w("lora_exact", info, state.d)
        p64 = p.detach().double().cpu()
        rows, w_host = updates.detach().cpu(), w.detach().cpu()
        num_fedit, trunc_sq, total_sq = 0.0, 0.0, 0.0
        for pair in state.pairs:
            a0, r, fin, b0, fout = (int(v) for v in pair)
            a, b, ak, bk = _clients(pair, w_host, rows)
            a_new, b_new, trunc, total = refactorise(p64, ak, bk, self.split)
            mean_b, mean_a = torch.einsum("k,kor->or", p64, bk), torch.einsum("k,kri->ri", p64, ak)
            num_fedit += float(((mean_b @ mean_a - mean_product(p64, ak, bk)) ** 2).sum())
            trunc_sq, total_sq = trunc_sq + trunc, total_sq + total
            out[a0:a0 + r * fin] = (a - a_new).reshape(-1).to(out)
            out[b0:b0 + fout * r] = (b - b_new).reshape(-1).to(out)
        return out, state, {"lora_truncation_error": _ratio(trunc_sq, total_sq),
                            "lora_product_error": _ratio(num_fedit, total_sq)}


@state_type  # checkpoints hold it (fedloom.plain)
@dataclass
class RankCuts:
    """Per client rank below the adapters': the coordinates that rank does not hold."""

    cuts: dict[int, torch.Tensor]
    d: int
    ranks: tuple[int, ...]  # the clients' ranks (client c: ranks[c % len])


class HetLoRA:
    """HetLoRA's aggregation: the clients' adapters of ranks ``r_k ≤ r``, zero-padded to
    rank ``r``, averaged. Client ``c`` has rank ``ranks[c % len(ranks)]``, the same
    option as the ``hetlora`` local method's (:mod:`fedloom.client.hetlora`; when not
    given, :func:`fedloom.params.lora_default_ranks` of the adapters' rank for both), whose
    clients send zeros for the terms ``i ≥ r_k`` they do not hold.

    With ``p_k`` the clients' weights and, per coordinate of an adapter's term ``i``,
    ``h_i = Σ_{k: r_k > i} p_k`` the weight of its holders:

    - ``pad: zero`` (HetLoRA's): the next global term is ``Σ_{k: r_k > i} p_k w_{k,i}``,
      a non-holder counted as a zero; the direction is ``Σ_k p_k g_{k,i} + (1 − h_i) w_i``
      (``server.lr: 1``, the default here, applies it exactly). The terms only some
      clients hold shrink by ``h_i`` each round — the known cost of zero-padding.
    - ``pad: holders``: the mean over the clients that hold the term,
      ``Σ_{k: r_k > i} p_k g_{k,i} / h_i`` (no change where no client holds it).

    Whatever a client sent for terms beyond its rank (noise of ``privacy.mode:
    local``, or ``ranks`` that disagree with the method's) is left out, and its share
    of the cohort's squared update norm is logged as ``hetlora_outside`` (0 when the
    method and the aggregator agree). Every coordinate outside the adapters gets the
    weighted mean, and so does every coordinate of a model without LoRA pairs (with a
    warning, as ``lora_exact``).

    Reference:
        paper: Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device
            Foundation Models", EMNLP 2024.
        code: ATP-1010/FederatedLLM, fed_utils/model_aggregation.py (checked: its
            HetLoRA baseline, the sample-weighted mean of the clients' A and B each
            zero-padded to the largest rank; tests/test_hetlora.py compares the
            two, float64).
        departures: the weights are the samples' (the public baseline's), not the
            paper's sparsity weights (each client's product norm); the paper's rank
            self-pruning is not modelled.
    """

    default_server_lr = 1.0

    def __init__(self, ranks: Sequence[int] | None = None, weighted: bool = True,
                 pad: Literal["zero", "holders"] = "zero") -> None:
        if pad not in ("zero", "holders"):
            raise ValueError(f"aggregator.options.pad: must be 'zero' or 'holders', got {pad!r}")
        if ranks is not None and (isinstance(ranks, (str, bytes))
                                  or not isinstance(ranks, Sequence) or not ranks):
            raise ValueError(f"aggregator.options.ranks: a non-empty list of ranks, got {ranks!r}")
        self.ranks: tuple[int, ...] = () if ranks is None else tuple(ranks)
        self.weighted = weighted
        self.pad: Literal["zero", "holders"] = pad

    def constructor_arguments(self) -> dict[str, Any]:
        """The constructor's arguments (no ranks given is kept as ``()``)."""
        return {"ranks": list(self.ranks) or None, "weighted": self.weighted, "pad": self.pad}

    @property
    def capabilities(self) -> AggregatorCaps:
        """Needs the clients' ids and, to zero-pad, the global model; linear in the rows
        for a fixed cohort, but not the plain mean."""
        return AggregatorCaps(requires=frozenset({"w"}) if self.pad == "zero" else frozenset(),
                              weighted=bool(self.weighted))

    def init(self, layout: Layout) -> RankCuts:
        pairs = layout.lora_pairs()
        if not pairs:
            # as lora_exact: every client holds every coordinate there is
            log.warning("hetlora: the model has no LoRA pair (lora_A and lora_B tensors in "
                        "one layer group): the weighted mean (fedavg) on every coordinate")
            return RankCuts({}, layout.size, (1,))
        top = min(p[1] for p in pairs)
        ranks = self.ranks or lora_default_ranks(top)
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= top:
                raise ValueError("aggregator.options.ranks: each rank a whole number from 1 "
                                 f"to the adapters' rank {top}, got {r!r}")
        return RankCuts({r: layout.lora_rank_cut(r) for r in set(ranks) if r < top},
                        layout.size, tuple(ranks))

    def __call__(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        state: RankCuts,
        *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, RankCuts, Mapping[str, float]]:
        check_cohort("hetlora", updates, weights)
        p = normalise_weights(weights if self.weighted else torch.ones_like(weights),
                              updates.dtype)
        if not state.cuts:  # every client at full rank, or no adapters: FedAvg
            return p @ updates, state, {"hetlora_outside": 0.0}
        if info is None:
            raise ValueError("hetlora: needs the cohort's client ids (CohortInfo)")
        ranks = [state.ranks[int(c) % len(state.ranks)] for c in info.clients.tolist()]
        rows = updates
        # the weight of the clients that do not hold each coordinate: 1 − h
        missing = torch.zeros(state.d, dtype=updates.dtype, device=updates.device)
        outside_sq = 0.0
        for r, cut in state.cuts.items():
            ks = [k for k, rk in enumerate(ranks) if rk == r]
            if not ks:
                continue
            cut = cut.to(updates.device)
            sent = updates[ks][:, cut]
            outside_sq += float((sent.double() ** 2).sum())
            if bool((sent != 0).any()):
                if rows is updates:
                    rows = updates.clone()  # the caller's rows stay as they were
                idx = torch.tensor(ks, device=updates.device)
                rows[idx.unsqueeze(1), cut.nonzero().squeeze(1).unsqueeze(0)] = 0
            missing += float(p[ks].sum()) * cut.to(updates.dtype)
        out = p @ rows
        if not bool(missing.any()):  # this cohort's clients all at full rank
            pass
        elif self.pad == "zero":
            w = _need_w("hetlora", info, state.d).to(updates)
            out += missing * w
        else:
            held = 1 - missing
            out = torch.where(held > 0, out / held.clamp_min(torch.finfo(held.dtype).tiny),
                              torch.zeros_like(out))
        total_sq = float((updates.double() ** 2).sum())
        return out, state, {"hetlora_outside": outside_sq / total_sq if total_sq > 0 else 0.0}


# The classes are their own factories: their constructor arguments are the config options.
register("aggregator", "fedit")(FedIT)
register("aggregator", "lora_exact")(LoRAExact)
register("aggregator", "hetlora")(HetLoRA)
