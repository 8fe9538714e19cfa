"""FLARE: sparse training with an accumulator-regularised local loss.

Paper: "Sparse Training for Federated Learning with Regularized Error
Correction" (FLARE); public TensorFlow-Federated code:
github.com/RanGreidi/FLARE-Federated-Learning-with-Accumulated-Regularized-Embeddings.
Written in the pseudo-gradient sign. Client k in round r with
accumulator ``A_k`` (zero at start):

1. Local training from ``w``; for the first ``p`` steps the loss is
   ``f + τ_r Σ_j m_j |w_k,j − (w_j − A_k,j)|`` (L1 summed over every weight and
   bias; ``penalty="l2"`` squares it). ``w − A_k`` is where the client would
   be had it sent everything.
2. ``m_j = 1[|A_k,j| > median |A_k| within its tensor]``.
3. ``τ_r = TAU / c^(r+1)``, the same for every client.
4. ``u_k = g_k + A_k``; the compressor (per-tensor Top-k with
   ``k_l = max(1, round(n_l R))``, ``compression.options.scope=tensor``) sends
   ``TopK(u_k)``; ``A_k ← u_k − TopK(u_k)``.
5. Server: ``w ← w − mean_k TopK(u_k)`` (``aggregator.options.weighted=false``).

``A_k`` is stored as the EF residual field (it is the same quantity: FLARE's
error correction without the penalty — "EC" — is exactly EF). ``ec_prox``
is EF with ``τ_r ‖w_k − w‖²`` on all local steps (the paper's EC+prox).

Departure: the mask and the penalty target are computed once per round from
the accumulator the client starts with (as the public code, which freezes them
when building the local loss).
"""

from __future__ import annotations

from typing import Literal

import torch

from fedloom.compress.feedback import ErrorFeedback
from fedloom.job import Penalty
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["FLARE", "ECProx", "flare_mask"]


def flare_mask(acc: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``1[|A_j| > median |A| of its tensor]``, tensor by tensor."""
    mask = torch.zeros_like(acc)
    a = acc.abs()
    for t in layout.tensors:
        seg = a[t.slice]
        mask[t.slice] = (seg > seg.median()).to(acc.dtype)
    return mask


class FLARE(ErrorFeedback):
    def __init__(self, layout: Layout, tau: float = 0.05, decay: float = 1.1,
                 steps: int = 1, penalty: Literal["l1", "l2"] = "l1") -> None:
        super().__init__(0.0, "constant", "flare")
        if tau < 0 or decay <= 0 or steps < 0:
            raise ValueError("compression: flare needs tau >= 0, tau_decay > 0, penalty_steps >= 0")
        if penalty not in ("l1", "l2"):
            raise ValueError(f"compression.penalty: must be l1 or l2, got {penalty!r}")
        self.layout, self.tau, self.decay, self.steps, self.kind = (
            layout, tau, decay, steps, penalty)

    def tau_at(self, round: int) -> float:
        """``τ_r = TAU / c^(r+1)`` (r counted from 0)."""
        return self.tau / self.decay ** (round + 1)

    def penalty(self, w: torch.Tensor, state: dict[str, torch.Tensor],
                round: int) -> Penalty | None:
        tau = self.tau_at(round)
        if tau == 0 or self.steps == 0:
            return None
        acc = state["residual"]
        return Penalty(w - acc, tau, self.steps, self.kind, flare_mask(acc, self.layout))


class ECProx(ErrorFeedback):
    """EF ("error correction") plus ``τ_r ‖w_k − w‖²`` on every local step."""

    def __init__(self, tau: float = 0.05, decay: float = 1.1) -> None:
        super().__init__(0.0, "constant", "ec_prox")
        self.tau, self.decay = tau, decay

    def penalty(self, w: torch.Tensor, state: dict[str, torch.Tensor],
                round: int) -> Penalty | None:
        tau = self.tau / self.decay ** (round + 1)
        return Penalty(w, tau, 2**62, "l2") if tau > 0 else None


@register("feedback", "flare")
def flare(layout: Layout, tau: float = 0.05, tau_decay: float = 1.1, penalty_steps: int = 1,
          penalty: Literal["l1", "l2"] = "l1") -> FLARE:
    """FLARE: EF whose first ``penalty_steps`` local steps are pulled towards
    ``w − A_k`` on the coordinates with a large accumulator (module docstring).

    Reference:
        paper: "Sparse Training for Federated Learning with Regularized Error
            Correction" (FLARE).
        code: RanGreidi/FLARE (TensorFlow Federated).
        departures: the mask and the penalty target are computed once per round
            from the accumulator the client starts with (as the public code).
    """
    return FLARE(layout, tau, tau_decay, penalty_steps, penalty)


@register("feedback", "ec_prox")
def ec_prox(tau: float = 0.05, tau_decay: float = 1.1) -> ECProx:
    """EC+prox: EF plus ``τ_r ‖w_k − w‖²`` on every local step, ``τ_r = tau/tau_decay^(r+1)``.

    Reference:
        paper: FLARE (as ``flare``), its EC+prox baseline.
        code: RanGreidi/FLARE.
        departures: none known.
    """
    return ECProx(tau, tau_decay)
