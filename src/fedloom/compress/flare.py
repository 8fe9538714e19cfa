"""FLARE: sparse training with an accumulator-regularised local loss.

Paper: "Sparse Training for Federated Learning with Regularized Error
Correction" (FLARE); public TensorFlow-Federated code:
github.com/RanGreidi/FLARE-Federated-Learning-with-Accumulated-Regularized-Embeddings.
Client k in round r with accumulator ``A_k`` (zero at start; the pseudo-gradient sign)
trains from ``w`` with ``f + τ_r Σ_j m_j |w_k,j − (w_j − A_k,j)|`` for the first ``p``
steps, ``m_j = 1[|A_k,j| > t_l]`` (``t_l`` the public median of ``|A_k|`` in tensor
``l``, :func:`public_median`), ``τ_r = TAU / c^(r+1)``; it sends ``TopK(g_k + A_k)``
(per-tensor Top-k, :mod:`fedloom.compress.sparse`) and keeps the rest in ``A_k``, the
EF residual field; the server takes the unweighted mean. ``ec_prox`` is EF with
``τ_r ‖w_k − w‖²`` on all local steps (the paper's EC+prox).

Checked against the public code (RanGreidi/FLARE: src/FLARE_regulerizer.py for the
mask, src/FLARE_utils.py ``sparsify_layer`` for the count), its two rules written out
independently in tests/test_flare.py: on random float64 accumulators with tensors of 1 to
20 entries (sizes divisible by 4, ≡ 2 mod 4 and odd), ties, zeros and a NaN, the mask is
identical (max difference 0); the per-tensor counts on tensors of 3 to 700 entries at
R = 1e-5 to 0.25 are equal.

Departures: the mask and the penalty target are computed once per round from the
accumulator the client starts with (as the public code). The count's departures are
listed in :mod:`fedloom.compress.sparse`. The round step by step, the public median,
the rule before the check and its measured drift: docs/explanation/methods.md (FLARE
in detail).
"""

from __future__ import annotations

from typing import Annotated, Literal

import torch

from fedloom.compress.feedback import ErrorFeedback
from fedloom.job import Penalty
from fedloom.params import Layout
from fedloom.registry import Range, register

__all__ = ["FLARE", "ECProx", "flare_mask", "public_median"]


def public_median(seg: torch.Tensor) -> torch.Tensor:
    """The threshold of FLARE's mask for one tensor, as the public code computes it.

    RanGreidi/FLARE, src/FLARE_regulerizer.py, takes ``tfp.stats.percentile(|A|, q=50)``
    with its default ``"nearest"`` interpolation: the ascending sort of ``|A|`` at position
    ``tf.round((n − 1)/2)``, and ``tf.round`` rounds half to even. For odd ``n`` that is the
    middle entry; for even ``n`` it is the even one of the two middle positions ``n/2 − 1``
    and ``n/2``: the lower middle when ``n ≡ 2 (mod 4)``, the upper middle when
    ``n ≡ 0 (mod 4)`` (``torch.median`` always takes the lower one). A NaN anywhere makes
    the percentile NaN, so nothing is above it. Python's ``round`` also rounds half to even,
    and ``(n − 1)/2`` is exact in float64.
    """
    n = seg.numel()
    if n == 0 or bool(seg.isnan().any()):
        return seg.new_tensor(float("nan"))
    return seg.reshape(-1).kthvalue(round((n - 1) / 2) + 1).values


def flare_mask(acc: torch.Tensor, layout: Layout) -> torch.Tensor:
    """``1[|A_j| > t_l]``, ``t_l`` the public code's median of ``|A|`` within tensor ``l``
    (:func:`public_median`: the upper middle value when the size is divisible by 4)."""
    mask = torch.zeros_like(acc)
    a = acc.abs()
    for t in layout.tensors:
        seg = a[t.slice]
        mask[t.slice] = (seg > public_median(seg)).to(acc.dtype)
    return mask


class FLARE(ErrorFeedback):
    def __init__(self, layout: Layout, tau: float = 0.05, decay: float = 1.1,
                 steps: int = 1, penalty: Literal["l1", "l2"] = "l1") -> None:
        super().__init__(0.0, "constant", "flare")
        if tau < 0 or decay <= 0 or steps < 0:
            raise ValueError("compression: flare needs tau >= 0, tau_decay > 0, penalty_steps >= 0")
        if penalty not in ("l1", "l2"):
            raise ValueError(f"compression.feedback.options.penalty: must be l1 or l2, "
                             f"got {penalty!r}")
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
def flare(layout: Layout, tau: Annotated[float, Range(ge=0)] = 0.05,
          tau_decay: Annotated[float, Range(gt=0)] = 1.1,
          penalty_steps: Annotated[int, Range(ge=0)] = 1,
          penalty: Literal["l1", "l2"] = "l1") -> FLARE:
    """FLARE: EF whose first ``penalty_steps`` local steps are pulled towards
    ``w − A_k`` on the coordinates with a large accumulator (module docstring).

    Reference:
        paper: "Sparse Training for Federated Learning with Regularized Error
            Correction" (FLARE).
        code: RanGreidi/FLARE (TensorFlow Federated).
        departures: the mask and the penalty target are computed once per round
            from the accumulator the client starts with (as the public code); the mask's
            median is the public one (upper middle value for sizes divisible by 4), checked
            against that rule written out (module docstring: masks identical).
    """
    return FLARE(layout, tau, tau_decay, penalty_steps, penalty)


@register("feedback", "ec_prox")
def ec_prox(tau: Annotated[float, Range(ge=0)] = 0.05,
            tau_decay: Annotated[float, Range(gt=0)] = 1.1) -> ECProx:
    """EC+prox: EF plus ``τ_r ‖w_k − w‖²`` on every local step, ``τ_r = tau/tau_decay^(r+1)``.

    Reference:
        paper: FLARE (as ``flare``), its EC+prox baseline.
        code: RanGreidi/FLARE.
        departures: none known.
    """
    return ECProx(tau, tau_decay)
