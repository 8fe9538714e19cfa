"""Krum and Multi-Krum: Byzantine-robust selection of client updates.

Blanchard, El Mhamdi, Guerraoui, Stainer, "Machine Learning with Adversaries:
Byzantine Tolerant Gradient Descent" (NeurIPS 2017). With ``n`` updates of
which up to ``f`` may be Byzantine, each update gets the score
``s(i) = Σ_{j ∈ N_k(i)} ‖g_i − g_j‖²``, ``k = n − f − 2``, where ``N_k(i)`` are the ``k``
updates closest to ``g_i`` (``j ≠ i``). Krum returns the update with the lowest score;
Multi-Krum (``multi = m'``) returns the plain mean of the ``m'`` updates with the lowest
scores (scores computed once, as in the paper's Section 5). The paper's guarantee needs
``2f + 2 < n``.

Public code: none by the authors. Flower 1.42's ``aggregate_krum`` (the same score,
``k = max(1, n − f − 2)``), 300 random cohorts: Krum identical in the 674 untied cases,
Multi-Krum to 1.8e-15. ``neighbours: n-f-1`` counts ByzFL's ``k = n − f − 1`` (the
default stays the paper's ``n − f − 2``): ByzFL 0.0.11's ``Krum`` to 2.0e-16 and
``MultiKrum`` (``multi = n − f``) to 3.4e-16 relative to the rows' scale, on random,
near-collinear, duplicated, huge and ``2f + 1 = n`` cohorts (tests/test_byzfl_equality.py).

Departures: ``k = max(1, n − f − 2)`` (Flower's rule) also where ``2f + 2 < n``
fails; tied scores share the last places equally (order-independent; Flower
picks by position); unweighted, as in the paper; near ties of the Gram's distances
decided by exact ones; rows whose squares over- or underflow scaled by a power of two.

Distances, ties, range and the metrics (``krum_*``): docs/explanation/methods.md
(Krum in detail).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch

from fedloom.aggregate.base import CohortInfo, Stateless, check_cohort
from fedloom.aggregate.distances import common_scale, pairwise_sq_distances
from fedloom.aggregate.gram import gram, out_of_range, row_scales
from fedloom.capabilities import AggregatorCaps
from fedloom.registry import register

__all__ = ["Krum", "krum_scores"]

_EPS64 = torch.finfo(torch.float64).eps


def krum_scores(G: torch.Tensor, k: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores ``s(i)`` from the float64 Gram ``G`` (n × n) and their rounding bounds."""
    G.shape[0]
    sq = G.diagonal()
    dist = (sq[:, None] + sq[None, :] - 2.0 * G).clamp_min(0.0)
    # Rounding of G_ij on d products: |δ| ≲ d ε (G_ii + G_jj)/2 per entry, three entries.
    err = (sq[:, None] + sq[None, :]) * (4.0 * d * _EPS64)
    return _scores(dist, err, k)


def exact_krum_scores(updates: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Scores from the differences themselves (:mod:`fedloom.aggregate.distances`), their
    rounding bounds and the rows' common scale ``s`` (scores in units of ``s²``)."""
    s = common_scale(updates)
    dist = pairwise_sq_distances(updates, s)
    # each entry a float64 sum of d squares: relative error below (d + 2) ε
    return (*_scores(dist, dist * ((updates.shape[1] + 2) * _EPS64), k), s)


def _scores(dist: torch.Tensor, err: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = dist.shape[0]
    dist = dist.clone()
    dist.fill_diagonal_(float("inf"))  # j ≠ i
    near = torch.topk(dist, k, dim=1, largest=False).indices
    rows = torch.arange(n, device=dist.device)[:, None]
    return dist[rows, near].sum(1), err[rows, near].sum(1)


class Krum(Stateless):
    """Krum / Multi-Krum (Blanchard et al. 2017).

    Args:
        f: the number of Byzantine clients assumed in a cohort (``≥ 0``).
        multi: ``m'``, the updates averaged (1 = Krum).
        neighbours: ``n-f-2`` (the paper's ``k``, the default) or ``n-f-1`` (ByzFL's).
        chunk: column chunk of the Gram accumulation and of the final mean.

    Reference:
        paper: Blanchard, El Mhamdi, Guerraoui & Stainer, "Machine Learning with Adversaries:
            Byzantine Tolerant Gradient Descent", NeurIPS 2017.
        code: none by the authors; Flower's ``aggregate_krum`` (flwr 1.42).
        departures: ``k = max(1, n − f − 2)`` (Flower's rule) where the paper's condition fails;
            tied scores share the last places equally; unweighted; the selected rows averaged in
            float64.
        measured: identical to flwr 1.42 in the 674 untied Krum cases of 300 cohorts; Multi-Krum
            to 1.8e-15; ByzFL 0.0.11 (``neighbours: n-f-1``): Krum 2.0e-16, Multi-Krum 3.4e-16.
    """

    # server.lr=auto: a selected update (or the mean of several): FedAvg's step.
    default_server_lr = 1.0
    # No optional CohortInfo field; not linear (which updates are selected depends on them).
    capabilities = AggregatorCaps()

    def __init__(self, f: int = 0, multi: int = 1, chunk: int = 1 << 15,
                 neighbours: Literal["n-f-2", "n-f-1"] = "n-f-2") -> None:
        for name, value, low in (("f", f, 0), ("multi", multi, 1), ("chunk", chunk, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(
                    f"aggregator.options.{name}: must be an integer >= {low}, got {value!r}"
                )
        if neighbours not in ("n-f-2", "n-f-1"):
            raise ValueError("aggregator.options.neighbours: must be n-f-2 (the paper's) or "
                             f"n-f-1 (ByzFL's), got {neighbours!r}")
        self.f, self.multi, self.chunk, self.neighbours = f, multi, chunk, neighbours

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: None, *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, None, Mapping[str, float]]:
        check_cohort("krum", updates, weights)
        n, d = updates.shape
        if n == 0:
            raise ValueError("krum: the cohort is empty")
        ids = info.clients if info is not None else torch.arange(n)
        if n == 1:
            return updates[0].clone(), state, {
                "krum_neighbours": 0.0, "krum_selected": 1.0,
                "krum_best_client": float(ids[0]), "krum_best_score": 0.0}
        k = max(n - self.f - (1 if self.neighbours == "n-f-1" else 2), 1)
        G, _ = gram(updates, chunk=self.chunk, precision="float64")
        # Distances of rows scaled by one power of two where squares would over- or
        # underflow (‖g‖ ≳ 1e154 or ≲ 1e-162): the ranking is unchanged (exact scaling).
        s_common = 1.0
        if out_of_range(G, updates, torch.float64):
            scale = row_scales(updates, common=True, chunk=self.chunk)
            G, _ = gram(updates, chunk=self.chunk, precision="float64", scale=scale)
            s_common = float(scale[0])
        score, err = krum_scores(G, k, d)
        if not bool(torch.isfinite(score).all()):
            raise ValueError("krum: non-finite distances (an update is not finite)")
        coef = _selection(score, err, min(self.multi, n))
        if _undecided(coef, min(self.multi, n)):
            # Rows that nearly coincide (near-collinear, far from 0): the Gram identity
            # cancels their distances into rounding; the differences themselves decide.
            score, err, s_common = exact_krum_scores(updates, k)
            coef = _selection(score, err, min(self.multi, n))
        out = torch.empty(d, dtype=updates.dtype, device=updates.device)
        for s in range(0, d, self.chunk):
            c = updates[:, s : s + self.chunk].to(torch.float64)
            out[s : s + self.chunk] = (coef @ c).to(updates.dtype)
        best = int(torch.argmin(score))
        return out, state, {
            "krum_neighbours": float(k),
            "krum_selected": float((coef > 0).sum()),
            "krum_best_client": float(ids[best]),
            # in the updates' units (inf where that is beyond float64)
            "krum_best_score": float(score[best]) / s_common / s_common,
        }


def _undecided(coef: torch.Tensor, multi: int) -> bool:
    """Whether some places were shared between rows tied within rounding."""
    return bool(((coef > 0) & (coef < (1.0 - 1e-9) / multi)).any())


def _selection(score: torch.Tensor, err: torch.Tensor, multi: int) -> torch.Tensor:
    """Coefficients (float64, sum 1) of the ``multi`` lowest scores, ties shared.

    ``t`` is the ``multi``-th lowest score. Rows surely below it (their
    interval ``s ± err`` ends below ``t − err_t``) get ``1/multi`` each; rows
    whose interval overlaps ``t``'s share the remaining places equally.
    """
    order = torch.argsort(score, stable=True)
    t_idx = order[multi - 1]
    t, t_err = score[t_idx], err[t_idx]
    better = score + err < t - t_err
    tied = ~better & (score - err <= t + t_err)
    slots = multi - int(better.sum())
    coef = torch.zeros_like(score)
    coef[better] = 1.0 / multi
    coef[tied] = slots / (multi * int(tied.sum()))
    return coef


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "krum")(Krum)
