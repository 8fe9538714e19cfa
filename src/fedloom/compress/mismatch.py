"""SA-PEF's gradient-mismatch diagnostic, a client metric
(:class:`fedloom.hooks.ClientMetric`; ``metrics.mismatch: true`` or
``metrics.hooks: [mismatch]``, option ``metrics.mismatch_alpha``).

For each sampled client k holding an EF residual ``e_k``, on the first
``client.batch_size`` samples of its validation split (its training split
when it has none), before it trains:

    grad_mismatch = ‖∇f(w) − ∇f(w − α_p e_k)‖²,  residual_sq = ‖e_k‖²,
    grad_sq = ‖∇f(w)‖²,

each averaged over the cohort with weights ``n_k``. Costs two gradients a client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedloom.registry import register

__all__ = ["GradientMismatch"]


class GradientMismatch:
    """``‖∇f(w) − ∇f(w − α_p e_k)‖²`` (with ``‖e_k‖²`` and ``‖∇f(w)‖²``), n_k-weighted.

    Reference:
        paper: SA-PEF, arXiv 2601.20738 (the gradient mismatch its analysis bounds).
        code: Dawitkiros/SA-PEF.
        departures: measured on one batch of the client's validation split, before
            local training.
    """

    def __init__(self, alpha: float = 1.0) -> None:
        if not 0 <= alpha <= 1:
            raise ValueError(f"metrics.mismatch_alpha: must be in [0, 1], got {alpha}")
        self.alpha = alpha

    def measure(self, exp: Any, w: torch.Tensor, client: int,
                rows: Mapping[str, torch.Tensor], n: int) -> tuple[float, float, float, int] | None:
        e = rows.get("residual")
        if e is None:
            return None
        val = exp.fed.test[client] if len(exp.fed.test[client]) else exp.fed.train[client]
        idx = torch.from_numpy(val[: exp.cfg.client.batch_size])
        xb, yb = exp.x[idx], exp.y[idx]
        g0 = exp.trainer.grad(w, xb, yb)
        g1 = exp.trainer.grad(w - self.alpha * e, xb, yb)
        return (float(((g0 - g1) ** 2).sum()), float((e * e).sum()), float((g0 * g0).sum()), n)

    def summarize(self, values: Sequence[tuple[float, float, float, int]]) -> dict[str, float]:
        nk = np.array([m[3] for m in values], dtype=float)
        return {key: float(np.average([m[j] for m in values], weights=nk))
                for j, key in enumerate(("grad_mismatch", "residual_sq", "grad_sq"))}


register("metric", "mismatch")(GradientMismatch)
