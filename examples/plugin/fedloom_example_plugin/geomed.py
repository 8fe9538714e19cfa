"""The geometric median of the updates (RFA), as a fedloom aggregator plug-in.

``z = argmin_z Σ_k p_k ‖g_k − z‖``, by the smoothed Weiszfeld iteration

    β_k = p_k / max(ν, ‖g_k − z‖),   z ← Σ_k β_k g_k / Σ_k β_k,

from the weighted mean, for at most ``iters`` iterations or until ``z`` moves
less than ``tol`` (relative). An update far from the others gets a weight
``∝ 1/distance``: a minority of arbitrary updates moves ``z`` a bounded amount.

Reference:
    paper: Pillutla, Kakade & Harchaoui, "Robust Aggregation for Federated
        Learning", IEEE Transactions on Signal Processing 2022 (RFA).
    code: krishnap25/RFA (the smoothed Weiszfeld step above; its server runs at
        most 4 iterations, as ``iters`` here).
    departures: the smoothing ``ν`` default and the stopping test (``z``'s
        relative move below ``tol``) are this example's own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class GeometricMedian:
    """Weighted geometric median of the rows (smoothed Weiszfeld; see the module)."""

    def __init__(self, iters: int = 4, nu: float = 1e-6, tol: float = 1e-8) -> None:
        if not isinstance(iters, int) or isinstance(iters, bool) or iters < 1:
            raise ValueError(f"aggregator.options.iters: must be an integer >= 1, got {iters!r}")
        if not nu > 0:
            raise ValueError(f"aggregator.options.nu: must be > 0, got {nu!r}")
        self.iters, self.nu, self.tol = iters, float(nu), float(tol)

    def init(self, layout: Any) -> None:
        return None

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor, state: None, *,
                 info: Any = None) -> tuple[torch.Tensor, None, Mapping[str, float]]:
        if updates.ndim != 2 or weights.shape != (updates.shape[0],):
            raise ValueError(f"geomed: updates {tuple(updates.shape)} and weights "
                             f"{tuple(weights.shape)} do not align")
        p = weights.to(torch.float64)
        p = p / p.sum()
        u = updates.to(torch.float64)
        z = p @ u
        done = 0
        while done < self.iters:
            done += 1
            dist = torch.linalg.vector_norm(u - z, dim=1).clamp_min(self.nu)
            beta = p / dist
            z_new = (beta @ u) / beta.sum()
            moved = float(torch.linalg.vector_norm(z_new - z))
            z = z_new
            if moved <= self.tol * max(1.0, float(torch.linalg.vector_norm(z))):
                break
        return z.to(updates.dtype), state, {"geomed_iters": float(done)}
