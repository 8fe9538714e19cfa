"""q-FedAvg: fair resource allocation (q-FFL).

Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in Federated Learning"
(ICLR 2020), Algorithm 2. With ``F_k`` the loss of the received model on
client k's training data (before local training) and ``L = 1/η_l``::

    Δ_k = L g_k,   D_k = F_k^q Δ_k,   h_k = q F_k^(q−1) ‖Δ_k‖² + L F_k^q,
    w ← w − Σ D_k / Σ h_k

The returned direction is ``Σ D_k / Σ h_k`` (apply it with ``server.lr = 1``).
q = 0 is FedAvg with uniform weights and a step of ``1/m``·Σ g_k; larger q
puts more weight on clients with high loss.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedloom.aggregate.base import CohortInfo, Stateless
from fedloom.registry import register

__all__ = ["QFedAvg"]


class QFedAvg(Stateless):
    """q-FedAvg: ``w ← w − Σ_k F_k^q Δ_k / Σ_k h_k`` with ``Δ_k = g_k/η_l`` (q-FFL).

    Reference:
        paper: Li, Sanjabi, Beirami & Smith, "Fair Resource Allocation in Federated Learning",
            ICLR 2020, Algorithm 2.
        code: none checked.
        departures: ``L = 1/η_l`` of the round unless ``lipschitz`` is given; apply with
            ``server.lr = 1``.
    """
    # server.lr=auto: Algorithm 2 applies Σ Δ_k / Σ h_k as is.
    default_server_lr = 1.0
    requires = frozenset({"start_losses", "lr"})

    def __init__(self, q: float = 1.0, lipschitz: float | None = None) -> None:
        if q < 0:
            raise ValueError(f"aggregator.options.q: must be >= 0, got {q}")
        self.q = q
        self.lipschitz = lipschitz


    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: None, *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, None, Mapping[str, float]]:
        if info is None or info.start_losses is None or (info.lr is None and not self.lipschitz):
            raise ValueError("qfedavg: needs the start losses and the client lr (info)")
        L = self.lipschitz or 1.0 / float(info.lr)
        F = info.start_losses.to(torch.float64).clamp_min(1e-10)
        q = self.q
        sq = (updates.to(torch.float64) ** 2).sum(1) * (L * L)
        h = q * F ** (q - 1) * sq + L * F**q
        coef = (F**q * L / h.sum()).to(updates.dtype)
        return coef @ updates, state, {"qfedavg_h_sum": float(h.sum())}


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "qfedavg")(QFedAvg)
