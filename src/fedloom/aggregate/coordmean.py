"""Coordinate-wise mean over the clients that sent each coordinate (SA-PEF's server).

For sparse uplinks the plain weighted mean divides every coordinate by the
whole cohort's weight, including clients that did not send it. SA-PEF's
public code averages each coordinate only over its senders::

    agg[j] = Σ_k n_k C(u_k)[j] / Σ_{k: j ∈ supp C(u_k)} n_k     (0 where nobody sent j)

A coordinate counts as sent when its decoded value is non-zero (a sent exact
zero changes nothing in the numerator, only in the denominator).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedloom.aggregate.base import CohortInfo, Stateless
from fedloom.capabilities import AggregatorCaps
from fedloom.registry import register

__all__ = ["CoordinateMean"]


class CoordinateMean(Stateless):
    """Coordinate-wise mean over the clients that sent each coordinate (SA-PEF's server).

    Reference:
        paper: SA-PEF, arXiv 2601.20738 (the server rule of its experiments).
        code: Dawitkiros/SA-PEF (each coordinate averaged over its senders only).
        departures: a coordinate counts as sent when its decoded value is non-zero; weighted by
            ``n_k``.
    """
    # server.lr=auto: a mean of the updates: FedAvg's step.
    default_server_lr = 1.0
    # No optional CohortInfo field; not linear (which coordinates count depends on the values sent).
    capabilities = AggregatorCaps()

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: None, *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, None, Mapping[str, float]]:
        w = weights.to(updates.dtype)
        num = w @ updates
        den = w @ (updates != 0).to(updates.dtype)
        out = torch.where(den > 0, num / den.clamp_min(torch.finfo(updates.dtype).tiny),
                          torch.zeros_like(num))
        return out, state, {"coord_coverage": float((den > 0).double().mean())}


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "coordmean")(CoordinateMean)
