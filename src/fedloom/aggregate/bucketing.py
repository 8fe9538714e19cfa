"""Bucketing: the rows shuffled into buckets of ``s``, each bucket's mean a row.

Karimireddy, He & Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets via
Bucketing" (ICLR 2022), Algorithm 1: a random permutation ``π`` of the ``n`` rows, then
``⌈n/s⌉`` buckets ``y_b = mean{g_π(i) : (b−1)s < i ≤ bs}`` (the last one holds the
``n mod s`` rows left over, where there are some), handed to any rule. A pre-aggregation
step (``server.pre_aggregation: [{name: bucketing, options: {s: 2}}]``,
:mod:`fedloom.aggregate.pre`). The permutation comes from ``(seed, round,
"bucketing")`` (:mod:`fedloom.rng`): the same every rerun and resume, independent of
the order of the cohort's clients only in distribution.

A bucket's row stands for its clients together: its weight is the sum of theirs, its
client id (``info.clients``, what a rule's metrics report) its first client's, and the
per-client fields (losses, steps, start losses) are left out: a rule that needs them
is refused after bucketing (``per_client = False``).

Public code: ByzFL 0.0.11's ``Bucketing`` (the same buckets of the permuted rows, its
last incomplete bucket included; the permutation from NumPy's global generator).
Measured against it with the permutation it drew given to :func:`bucket_means`:
max difference 2.7e-16 relative to the rows' scale (tests/test_byzfl_equality.py).
Departures: the means in float64; the
permutation from fedloom's derived generator, not a global one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from fedloom.aggregate.base import CohortInfo, check_cohort
from fedloom.aggregate.distances import check_rows
from fedloom.registry import register
from fedloom.rng import Purpose, torch_gen

__all__ = ["Bucketing", "bucket_means"]


def bucket_means(rows: torch.Tensor, perm: torch.Tensor, s: int) -> torch.Tensor:
    """The means of ``rows[perm]`` in consecutive buckets of ``s`` (float64 sums, the
    rows' dtype; the last bucket holds what is left)."""
    n = rows.shape[0]
    b = -(-n // s)
    M = torch.zeros(b, n, dtype=torch.float64, device=rows.device)
    for j in range(b):
        members = perm[j * s : (j + 1) * s].to(rows.device)
        M[j, members] = 1.0 / len(members)
    return (M @ rows.to(torch.float64)).to(rows.dtype)


class Bucketing:
    """Bucketing (Karimireddy, He & Jaggi 2022), a pre-aggregation step.

    Args:
        s: the bucket size (``s ≥ 1``; 1 shuffles only).
        seed: the run's seed (fedloom passes it).

    Reference:
        paper: Karimireddy, He & Jaggi, "Byzantine-Robust Learning on Heterogeneous Datasets
            via Bucketing", ICLR 2022, Algorithm 1.
        code: ByzFL 0.0.11 ``Bucketing``.
        departures: float64 means; the permutation from (seed, round, "bucketing").
        measured: 2.7e-16 (relative) against ByzFL 0.0.11 (tests/test_byzfl_equality.py).
    """

    per_client = False  # a row stands for a bucket of clients

    def __init__(self, s: int = 2, seed: int = 0) -> None:
        if not isinstance(s, int) or isinstance(s, bool) or s < 1:
            raise ValueError(f"pre_aggregation.options.s: must be an integer >= 1, got {s!r}")
        self.s, self.seed = s, seed

    def __call__(self, rows: torch.Tensor, weights: torch.Tensor, info: CohortInfo
                 ) -> tuple[torch.Tensor, torch.Tensor, CohortInfo, Mapping[str, float]]:
        check_cohort("bucketing", rows, weights)
        check_rows("bucketing", rows)
        n = rows.shape[0]
        gen = torch_gen(self.seed, info.round, -1, Purpose.BUCKETING)
        perm = torch.randperm(n, generator=gen)
        out = bucket_means(rows, perm, self.s)
        first = perm[:: self.s]
        w = torch.stack([weights[perm[j : j + self.s].to(weights.device)].sum()
                         for j in range(0, n, self.s)])
        ids = info.clients[first.to(info.clients.device)]
        return out, w, dataclasses.replace(info, clients=ids, losses=None, steps=None,
                                           start_losses=None), {
            "bucketing_buckets": float(out.shape[0])}


# The class is its own factory: its constructor arguments are the options.
register("preaggregator", "bucketing")(Bucketing)
