"""FedNova: normalised averaging of heterogeneous local progress.

Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization" (NeurIPS 2020), eq. (6)–(7)::

    d_k = g_k / a_k,    agg = (Σ_k p_k a_k) · Σ_k p_k d_k

``a_k = ‖a_k‖₁`` of the client's local-step coefficients: ``τ_k`` for plain
SGD, and ``[τ − β(1 − β^τ)/(1 − β)] / (1 − β)`` with SGD momentum ``β``
(the paper's Appendix; the momentum is read from the cohort info). τ_k is the
number of local steps each client actually ran.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedloom.aggregate.base import CohortInfo, Stateless, normalise_weights
from fedloom.capabilities import AggregatorCaps
from fedloom.registry import register

__all__ = ["FedNova", "nova_norm"]


def nova_norm(steps: torch.Tensor, momentum: float) -> torch.Tensor:
    """``a_k`` for ``τ_k`` local steps of SGD with momentum ``β``."""
    tau = steps.to(torch.float64)
    if momentum == 0:
        return tau
    b = momentum
    return (tau - b * (1 - b**tau) / (1 - b)) / (1 - b)


class FedNova(Stateless):
    """FedNova: ``(Σ p_k a_k) · Σ p_k g_k/a_k`` with ``a_k = ‖a_k‖₁`` of the local steps.

    Reference:
        paper: Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
            Federated Optimization", NeurIPS 2020, eq. (6)–(7).
        code: none checked.
        departures: none known (``‖a_k‖₁`` with SGD momentum as in the paper's Appendix).
    """
    # Σ_k (τ_eff p_k/a_k) g_k: computable from sums (Σ n_k g_k/a_k, Σ n_k, Σ n_k a_k), so
    # secure aggregation holds; not dp_mean (fedloom.privacy).
    capabilities = AggregatorCaps(requires=frozenset({"steps"}), linear=True)
    # server.lr=auto: τ_eff Σ p_k d_k has FedAvg's scale (equal to it when every τ_k is equal).
    default_server_lr = 1.0


    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: None, *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, None, Mapping[str, float]]:
        if info is None or info.steps is None:
            raise ValueError("fednova: needs the local step counts (info.steps)")
        p = normalise_weights(weights, torch.float64)
        a = nova_norm(info.steps, info.momentum)
        if bool((a <= 0).any()):
            raise ValueError("fednova: every client must run at least one local step")
        tau_eff = float((p * a).sum())
        coef = (tau_eff * p / a).to(updates.dtype)
        return coef @ updates, state, {"fednova_tau_eff": tau_eff}


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "fednova")(FedNova)
