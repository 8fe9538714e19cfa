"""q-FedAvg: fair resource allocation (q-FFL).

Li, Sanjabi, Beirami, Smith, "Fair Resource Allocation in Federated Learning"
(ICLR 2020), Algorithm 2. With ``F_k`` the loss of the received model on
client k's training data (before local training) and ``L = 1/η_l``::

    Δ_k = L g_k,   D_k = F_k^q Δ_k,   h_k = q F_k^(q−1) ‖Δ_k‖² + L F_k^q,
    w ← w − Σ D_k / Σ h_k

The returned direction is ``Σ D_k / Σ h_k`` (apply it with ``server.lr = 1``).
q = 0 is FedAvg with uniform weights and a step of ``1/m``·Σ g_k; larger q
puts more weight on clients with high loss.

``F_k`` is ``F_k + 1e-10``, as in the public code (WwZzz/easyFL,
``algorithm/qfedavg.py``: ``np.float_power(li + 1e-10, q)`` in both ``Δ`` and
``h``; Flower's ``QFedAvg`` strategy the same); it keeps ``F^(q−1)`` finite at a
zero loss. tests/test_aggregate_numerics.py checks the rule against the public
formula in exact rational arithmetic (q = 1, 2, losses 0 … 1e-2) to 1e-13.
Departure (range only): ``‖g_k‖²`` is taken of the rows divided by an exact power
of two, both sums divided by ``F_max^q`` and the direction formed in float64, so it
is finite for any finite rows and any finite start losses ≥ 0 (a negative loss
skips the round with a ValueError: ``F^q`` has no real value at fractional q).

The former offset and the range in detail: docs/explanation/methods.md
(q-FedAvg in detail).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from fedloom.aggregate.base import CohortInfo, Stateless
from fedloom.aggregate.gram import row_scales
from fedloom.capabilities import AggregatorCaps
from fedloom.registry import register

__all__ = ["QFedAvg"]

_LOSS_OFFSET = 1e-10


class QFedAvg(Stateless):
    """q-FedAvg: ``w ← w − Σ_k F_k^q Δ_k / Σ_k h_k`` with ``Δ_k = g_k/η_l`` (q-FFL).

    Reference:
        paper: Li, Sanjabi, Beirami & Smith, "Fair Resource Allocation in Federated Learning",
            ICLR 2020, Algorithm 2.
        code: WwZzz/easyFL (``algorithm/qfedavg.py``): ``F_k + 1e-10`` as there.
        departures: ``L = 1/η_l`` of the round unless ``lipschitz`` is given; apply with
            ``server.lr = 1``.
        measured: equal to the public formula in exact rational arithmetic to 1e-13
            (tests/test_aggregate_numerics.py).
    """
    # server.lr=auto: Algorithm 2 applies Σ Δ_k / Σ h_k as is.
    default_server_lr = 1.0
    capabilities = AggregatorCaps(requires=frozenset({"start_losses", "lr"}))

    def __init__(self, q: float = 1.0, lipschitz: float | None = None) -> None:
        if q < 0:
            raise ValueError(f"aggregator.options.q: must be >= 0, got {q}")
        self.q = q
        self.lipschitz = lipschitz


    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: None, *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, None, Mapping[str, float]]:
        """``Σ_k D_k / Σ_k h_k`` with ``D_k = F_k^q L g_k``, ``h_k = q F_k^(q−1) L²‖g_k‖² + L
        F_k^q`` and ``F_k`` the start loss + 1e-10, computed as ``Σ_k f_k L g_k / Σ_k (q f_k
        L²‖g_k‖²/F_k + L f_k)`` with ``f_k = (F_k/F_max)^q`` (``F_max^q`` cancels).

        Finite for every finite ``g`` and every start loss ≥ 0 and equal to the formula at
        256 bits to 3e-16 relative (tests/test_loss_range.py: losses 0 and 1e-300 …
        1.7e308, spreads of 600 decades, q = 0.5 … 50); equal to the former ``F_k^q`` form
        to 4e-16 relative on ordinary losses (0 … 3, q = 0 … 5). A negative or
        non-finite loss raises ValueError (``_check_losses``). ``qfedavg_h_sum`` is ``Σ_k
        h_k``, inf where it exceeds float64.
        """
        need = "qfedavg: needs the start losses and the client lr (info)"
        if info is None or info.start_losses is None:
            raise ValueError(need)
        if self.lipschitz:
            L = self.lipschitz
        elif info.lr is not None:
            L = 1.0 / float(info.lr)
        else:
            raise ValueError(need)
        # F_k + 1e-10, as the public code (np.float_power(loss + 1e-10, q)): keeps F^(q−1)
        # finite at a zero loss
        loss = info.start_losses.to(torch.float64)
        _check_losses(loss)
        F = loss + _LOSS_OFFSET
        q = self.q
        # Both sums divided by P = F_max^q, which cancels in the direction: F^q/P =
        # (F/F_max)^q ∈ [0, 1] and F^(q−1)/P = (F/F_max)^q / F ≤ 1e10, so no power over- or
        # underflows at any finite loss (before, 1e160 at q = 2 made Σh infinite and the
        # direction NaN, and P itself may not fit a float64).
        Fq = (F / F.max()) ** q if F.numel() else F
        # ‖g_k‖² of the rows divided by one power of two a (exact) so that no square
        # overflows or underflows: ‖g_k‖² = a² ‖g_k/a‖², and with H1 = Σ q F^(q−1) L²‖g_k/a‖²,
        # H0 = Σ L F^q: Σ_k F^q L g_k / Σ h = Σ_k F^q L (g_k/a) / (a H1 + H0/a)
        s = row_scales(updates, common=True)                       # 1/a
        rows = updates.to(torch.float64) * s[:, None]
        sq = (rows * rows).sum(1) * (L * L)
        a_inv = float(s[0]) if s.numel() else 1.0
        H1 = float((q * (Fq / F) * sq).sum())                      # H1/P
        H0 = float((L * Fq).sum())                                 # H0/P
        denom = H1 / a_inv + H0 * a_inv                             # Σ h / (a P)
        coef = Fq * L / denom
        out = (coef @ rows).to(updates.dtype)
        try:  # Σh = P (a² H1/P + H0/P): inf where it exceeds float64 (the step is finite)
            h_sum = (float(F.max()) ** q if F.numel() else 0.0) * (H1 / a_inv / a_inv + H0)
        except OverflowError:
            h_sum = math.inf
        return out, state, {"qfedavg_h_sum": h_sum}


def _check_losses(loss: torch.Tensor) -> None:
    """Refuse a round whose losses q-FFL has no weights for: a NaN or infinite loss, or a
    negative one (``F^q`` is not real for a fractional ``q``, and the rule weighs clients
    by their loss, which is ≥ 0 in the paper). The engine has already rejected the clients
    with non-finite losses; a negative loss skips the round with this reason, as CRAFT's
    ``targets=loss`` does."""
    bad = ~(loss >= 0) | ~torch.isfinite(loss)
    if bool(bad.any()):
        raise ValueError(f"qfedavg: the start losses must be finite and >= 0 (q-FFL weighs "
                         f"client k by F_k^q), got {float(loss[bad][0])}")


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "qfedavg")(QFedAvg)
