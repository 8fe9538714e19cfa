"""FedLF: layer-wise fair federated learning.

Pan et al., "FedLF: Layer-Wise Fair Federated Learning" (AAAI 2024); public
code github.com/zibinpan/FedLF. Per layer group ``q``:

1. Rescale each client's update to the cohort's mean norm ``μ_q``:
   ``Q_i = μ_q g_i^q / ‖g_i^q‖``.
2. A fairness direction from the loss vector ``l`` and the preference
   ``p = 1/√m``: ``h = ((l·p) l/‖l‖ − p ‖l‖)/‖l‖²``, ``f = μ_q (hQ)/‖hQ‖``,
   appended as one more row.
3. Solve ``min_{λ∈Δ} ‖λᵀ Q'‖²`` (min-norm point of the rows' hull) and take
   ``d_q = λᵀ Q'``.

The groups' directions are concatenated and rescaled to ``‖mean_k g_k‖``.
Departure: the public code also appends recently seen clients' historical
gradients when clients drop out; that history is not kept here.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedloom.aggregate.base import CohortInfo
from fedloom.aggregate.gram import gram, min_norm_simplex
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["FedLF"]


class FedLF:
    requires = frozenset({"start_losses"})

    def init(self, layout: Layout) -> tuple[tuple[int, int], ...]:
        return tuple((g.start, g.stop) for g in layout.groups)

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: tuple[tuple[int, int], ...],
        *, info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, tuple[tuple[int, int], ...], Mapping[str, float]]:
        if info is None or info.start_losses is None:
            raise ValueError("fedlf: needs the clients' losses (info.start_losses)")
        m = updates.shape[0]
        loss = info.start_losses.to(torch.float64)
        p = torch.full((m,), m**-0.5, dtype=torch.float64)
        ln = torch.linalg.vector_norm(loss)
        h = torch.zeros(m, dtype=torch.float64)
        if ln > 0:
            h = ((loss @ p) * loss / ln - p * ln) / ln**2
            if float(torch.linalg.vector_norm(h) * ln) < 1e-12:
                h.zero_()  # equal losses: no fairness direction (not rounding noise)
        out = torch.zeros(updates.shape[1], dtype=updates.dtype)
        for start, stop in state:
            R = updates[:, start:stop]
            G_raw, _ = gram(R)
            norms = G_raw.diagonal().clamp_min(0).sqrt()
            if not bool((norms > 0).all()):
                continue  # a client with a zero layer: leave this layer's direction at zero
            mu = float(norms.mean())
            D = mu / norms                               # Q = diag(D) R
            GQ = G_raw * D[:, None] * D[None, :]         # Q Qᵀ
            hD = h * D                                   # f ∝ (hD) R
            f_norm = float(torch.sqrt((hD @ G_raw @ hD).clamp_min(0)))
            if f_norm > 0:
                s = mu / f_norm                          # f = s (hD) R
                cross = s * (GQ @ h)                     # ⟨Q_i, f⟩ = s Σ_j GQ_ij h_j
                Gp = torch.zeros(m + 1, m + 1, dtype=torch.float64)
                Gp[:m, :m] = GQ
                Gp[:m, m] = Gp[m, :m] = cross
                Gp[m, m] = mu * mu
                lam = min_norm_simplex(Gp)
                coef = lam[:m] * D + lam[m] * s * hD
            else:
                coef = min_norm_simplex(GQ) * D
            out[start:stop] = coef.to(R.dtype) @ R
        target = torch.linalg.vector_norm(updates.mean(0).double())
        norm = torch.linalg.vector_norm(out.double())
        if norm > 0:
            out = out * (target / norm).to(out.dtype)
        return out, state, {}


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "fedlf")(FedLF)
