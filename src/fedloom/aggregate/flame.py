"""FLAME: the majority cluster by cosine distance, clipped to the median norm, noised.

Nguyen et al., "FLAME: Taming Backdoors in Federated Learning" (USENIX Security 2022),
Algorithm 1, on the round's ``n`` updates ``g_i``:

1. HDBSCAN on the pairwise cosine distances ``1 − cos(g_i, g_j)`` with
   ``min_cluster_size = ⌊n/2⌋ + 1``, ``min_samples = 1``, a single cluster allowed: the
   updates of the largest cluster are admitted, the others (HDBSCAN's outliers and
   smaller clusters) are dropped;
2. ``S = median_i ‖g_i‖`` over all ``n``; each admitted update clipped to ``S``:
   ``g_i · min(1, S/‖g_i‖)``; their plain mean;
3. Gaussian noise ``N(0, (λ S)² I)`` added (``λ = 0.001``, the paper's for images; 0
   switches it off), drawn from ``(seed, round, "flame-noise")`` (:mod:`fedloom.rng`).

Public code: none by the authors; Blades' ``Flame`` (OPPO) clusters the same way with the
``hdbscan`` package (``metric="cosine"``). Here scikit-learn's ``HDBSCAN`` (a port of that
package) on a precomputed float64 cosine matrix; checked in tests/test_defences.py: the
admitted set equals scikit-learn's HDBSCAN with ``metric="cosine"`` on the raw rows (Blades'
call) on 30 cohorts, the clipped mean a golden value, the noise's standard deviation
``λ S`` within 1 %. Departures: the noise is added to the aggregate (the paper adds it to
the new model: the same law at ``server.lr = 1``); Blades' noise subtraction and its
``pow(λS, 2)`` standard deviation are not followed; when HDBSCAN finds no cluster every
update is admitted (``flame_admitted`` says so); the rows clustered in an order of
their values (HDBSCAN breaks equal distances by position); unweighted; needs scikit-learn.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import numpy as np
import torch

from fedloom.aggregate.base import CohortInfo, Stateless, check_cohort
from fedloom.aggregate.distances import check_rows, common_scale
from fedloom.capabilities import AggregatorCaps
from fedloom.registry import Range, register
from fedloom.rng import Purpose, torch_gen

__all__ = ["Flame", "flame_admitted"]


def _norms(rows: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Row norms of the rows scaled by one power of two (float64) and that scale."""
    s = common_scale(rows)
    return torch.linalg.vector_norm(rows.to(torch.float64) * s, dim=1), s


def flame_admitted(rows: torch.Tensor, min_cluster_size: int) -> torch.Tensor:
    """The boolean mask of the largest HDBSCAN cluster of the rows' cosine distances
    (every row where there is no cluster)."""
    n = rows.shape[0]
    if n < 3:  # HDBSCAN needs more points than min_samples + 1; one cluster
        return torch.ones(n, dtype=torch.bool)
    from sklearn.cluster import HDBSCAN

    norm, s = _norms(rows)
    unit = rows.to(torch.float64) * s / norm.clamp_min(torch.finfo(torch.float64).tiny)[:, None]
    dist = (1.0 - unit @ unit.T).clamp(0.0, 2.0)
    # to 2^-40 (~1e-12): the product's rounding depends on the rows' positions, and
    # HDBSCAN's choices between near-equal distances must not
    dist = torch.round(dist * 2.0**40) / 2.0**40
    dist = torch.minimum(dist, dist.T)
    dist.fill_diagonal_(0.0)
    # HDBSCAN breaks equal distances by position: cluster in an order of the rows'
    # values (norm, then a fixed projection), so the clients' order cannot matter
    proj = torch.arange(1, rows.shape[1] + 1, dtype=torch.float64, device=rows.device)
    proj = torch.remainder(proj * 0.6180339887498949, 1.0)
    key = (unit @ proj).cpu().numpy()
    order = np.lexsort((key, norm.cpu().numpy()))
    D = dist.cpu().numpy()[np.ix_(order, order)]
    labels = np.empty(n, dtype=np.int64)
    labels[order] = HDBSCAN(min_cluster_size=min_cluster_size, min_samples=1,
                            allow_single_cluster=True, metric="precomputed",
                            copy=True).fit_predict(D)
    found = labels[labels >= 0]
    if found.size == 0:
        return torch.ones(n, dtype=torch.bool)
    biggest = int(np.bincount(found).argmax())
    return torch.from_numpy(labels == biggest)


class Flame(Stateless):
    """FLAME (Nguyen et al. 2022).

    Args:
        lam: the noise level ``λ ≥ 0`` (standard deviation ``λ S``; 0: no noise).
        min_cluster_size: HDBSCAN's (``None``: ``⌊n/2⌋ + 1``, the paper's).
        seed: the run's seed (fedloom passes it).

    Reference:
        paper: Nguyen et al., "FLAME: Taming Backdoors in Federated Learning",
            USENIX Security 2022, Algorithm 1.
        code: none by the authors; Blades' ``Flame`` (its clustering call).
        departures: noise on the aggregate; every update admitted without a cluster;
            unweighted.
        measured: admitted sets equal to scikit-learn's HDBSCAN on raw rows (30 cohorts);
            noise std within 1 % of λS (tests/test_defences.py).
    """

    # server.lr=auto: a mean of clipped updates: FedAvg's step.
    default_server_lr = 1.0
    # No optional CohortInfo field; not linear (clusters and clipping read the rows).
    capabilities = AggregatorCaps()

    def __init__(self, lam: Annotated[float, Range(ge=0)] = 0.001,
                 min_cluster_size: int | None = None, seed: int = 0) -> None:
        if isinstance(lam, bool) or not isinstance(lam, int | float) or not 0 <= lam < 1e300:
            raise ValueError(f"aggregator.options.lam: must be a number >= 0, got {lam!r}")
        if min_cluster_size is not None and (not isinstance(min_cluster_size, int)
                                             or isinstance(min_cluster_size, bool)
                                             or min_cluster_size < 2):
            raise ValueError("aggregator.options.min_cluster_size: must be an integer >= 2 "
                             f"or null, got {min_cluster_size!r}")
        self.lam, self.min_cluster_size, self.seed = float(lam), min_cluster_size, seed

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: None, *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, None, Mapping[str, float]]:
        check_cohort("flame", updates, weights)
        check_rows("flame", updates)
        n, d = updates.shape
        size = self.min_cluster_size if self.min_cluster_size is not None else n // 2 + 1
        ok = flame_admitted(updates, min(size, n)).to(updates.device)
        norm, s = _norms(updates)
        S = float(torch.quantile(norm, 0.5))  # the mean of the middle two for even n
        factor = torch.where(norm > S, S / norm.clamp_min(torch.finfo(torch.float64).tiny),
                             torch.ones_like(norm))
        coef = torch.where(ok, factor, torch.zeros_like(factor)) / int(ok.sum())
        out = coef @ updates.to(torch.float64)
        S_units = S / s  # in the updates' units
        if self.lam > 0 and S_units > 0:
            gen = torch_gen(self.seed, info.round if info is not None else 0, -1,
                            Purpose.FLAME_NOISE)
            noise = torch.randn(d, generator=gen, dtype=torch.float64)
            out = out + (self.lam * S_units) * noise.to(updates.device)
        return out.to(updates.dtype), state, {
            "flame_admitted": float(ok.sum()), "flame_clip_norm": S_units}


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "flame")(Flame)
