"""FedAvg: the sample-weighted mean of the client updates.

``agg = Σ_k p_k g_k`` with ``p_k = n_k / Σ_{j∈S_t} n_j`` (McMahan et al.,
"Communication-Efficient Learning of Deep Networks from Decentralized Data",
AISTATS 2017). With the server optimizer ``sgd`` and ``η_g = 1`` this is
exactly ``w ← Σ p_k w_k``. ``weighted=False`` gives the plain mean.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedloom.aggregate.base import CohortInfo, Stateless, normalise_weights
from fedloom.capabilities import AggregatorCaps
from fedloom.registry import register

__all__ = ["FedAvg"]


class FedAvg(Stateless):
    """FedAvg: ``Σ_k p_k g_k`` with ``p_k = n_k / Σ_S n_j`` (``weighted=False``: the plain mean).

    Reference:
        paper: McMahan et al., "Communication-Efficient Learning of Deep Networks from
            Decentralized Data", AISTATS 2017.
        code: none needed (one weighted mean).
        departures: none.
    """
    # Σ_k p_k g_k with p_k from the sample counts: a sum-only (secure aggregation)
    # server computes it from Σ n_k g_k and Σ n_k, and under unit weights it is the
    # plain mean, DP-FedAvg's estimator (fedloom.privacy).
    # server.lr=auto: McMahan et al.: w ← Σ p_k w_k, i.e. η_g = 1.
    default_server_lr = 1.0
    def __init__(self, weighted: bool = True) -> None:
        self.weighted = weighted

    @property
    def capabilities(self) -> AggregatorCaps:
        """Linear and the mean under unit weights; ``weighted`` is the option."""
        return AggregatorCaps(linear=True, dp_mean=True, weighted=bool(self.weighted))


    def __call__(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        state: None,
        *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, None, Mapping[str, float]]:
        if updates.ndim != 2 or updates.shape[0] != weights.shape[0]:
            raise ValueError(
                f"fedavg: updates {tuple(updates.shape)} and weights {tuple(weights.shape)} "
                "do not align"
            )
        w = weights if self.weighted else torch.ones_like(weights)
        p = normalise_weights(w, updates.dtype)
        return p @ updates, state, {}


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "fedavg")(FedAvg)
