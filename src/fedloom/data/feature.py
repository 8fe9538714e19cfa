"""Feature skew as a per-client transform of the inputs, not a split.

After the partition, client ``k``'s rows (its training and its own test samples) are
transformed on the run's device, once, by a transform drawn from
``(seed, client k, "feature")`` (:mod:`fedloom.rng`). The labels and the split are
untouched, so it composes with every partitioner; the global test set (the source's
own) stays clean, and each client's own test split carries its client's skew.

- ``noise``: ``x̂ = x + σ_k·ε``, ``ε ~ N(0, I)``, ``σ_k = scale · k / (N − 1)`` — the
  noise-based feature imbalance of Li et al., ICDE 2022 (NIID-Bench: client ``k`` of
  ``N`` gets Gaussian noise of level ``σ·k/(N−1)``); FLGo's Gaussian feature
  perturbation is the same idea.
- ``permute``: a per-client random permutation ``π_k`` of the flattened input features,
  ``x̂_i = x_{π_k(i)}`` (permuted MNIST: Goodfellow et al. 2013, as a client skew).
  ``scale`` is the fraction of the features permuted (1: all).
- ``rotate``: images (``[c, h, w]``) rotated by an angle ``θ_k ~ U(−scale, scale)``
  degrees about their centre, bilinear, the border pixel's value outside (rotated MNIST
  as a client skew; the inputs are normalised, so "zero" would not be the background).

Departures, stated: NIID-Bench draws fresh noise every time a sample is loaded; here
one draw per sample, fixed for the run (the noise is part of the client's data, and
reruns and resumes see the same inputs). The draws are made on the CPU from the
derived generator and moved to the device, so every device sees the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from fedloom.rng import Purpose, torch_gen

__all__ = ["FEATURE_SKEWS", "apply_feature_skew"]

FEATURE_SKEWS = ("none", "noise", "permute", "rotate")


def apply_feature_skew(x: torch.Tensor, parts: Sequence[np.ndarray], name: str, scale: float,
                       seed: int) -> torch.Tensor:
    """``x`` with client ``k``'s rows ``parts[k]`` transformed (a new tensor; ``x`` is
    left as it is). ``name`` is one of :data:`FEATURE_SKEWS`."""
    if name == "none":
        return x
    if name not in FEATURE_SKEWS:
        raise ValueError(f"data.feature.name: must be one of {', '.join(FEATURE_SKEWS)}, "
                         f"got {name!r}")
    if not x.is_floating_point():
        raise ValueError(f"data.feature.name: {name} needs real-valued inputs; this data "
                         f"has {x.dtype} inputs (token ids)")
    if name == "rotate" and x.ndim != 4:
        raise ValueError(f"data.feature.name: rotate needs images [c, h, w]; the inputs "
                         f"have shape {tuple(x.shape[1:])}")
    if name == "permute" and not 0 < scale <= 1:
        raise ValueError(f"data.feature.scale: permute takes the fraction of features "
                         f"permuted, in (0, 1], got {scale:g}")
    out = x.clone()
    n_clients = len(parts)
    d = int(np.prod(x.shape[1:]))
    for k, rows in enumerate(parts):
        if len(rows) == 0:
            continue
        idx = torch.from_numpy(np.asarray(rows, dtype=np.int64)).to(x.device)
        g = torch_gen(seed, -1, k, Purpose.FEATURE)
        xk = out[idx]
        if name == "noise":
            level = scale * k / (n_clients - 1) if n_clients > 1 else scale
            eps = torch.randn(xk.shape, generator=g, dtype=torch.float64)
            xk = xk + (level * eps).to(xk.dtype).to(x.device)
        elif name == "permute":
            m = max(1, round(scale * d)) if scale < 1 else d
            which = torch.randperm(d, generator=g)[:m]
            perm = torch.arange(d)
            perm[which] = which[torch.randperm(m, generator=g)]
            flat = xk.reshape(len(idx), d)
            xk = flat[:, perm.to(x.device)].reshape(xk.shape)
        else:  # rotate
            theta = (torch.rand((), generator=g, dtype=torch.float64) * 2 - 1) * scale
            xk = _rotate(xk, math.radians(float(theta)))
        out[idx] = xk
    return out


def _rotate(x: torch.Tensor, rad: float) -> torch.Tensor:
    """Rotate a batch of images ``[b, c, h, w]`` by ``rad`` about the centre."""
    c, s = math.cos(rad), math.sin(rad)
    mat = torch.tensor([[c, -s, 0.0], [s, c, 0.0]], dtype=x.dtype, device=x.device)
    grid = torch.nn.functional.affine_grid(mat.expand(len(x), 2, 3), list(x.shape),
                                           align_corners=False)
    return torch.nn.functional.grid_sample(x, grid, mode="bilinear", padding_mode="border",
                                           align_corners=False)
