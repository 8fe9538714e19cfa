"""Exact pairwise distances for the rules that rank rows by them (Bulyan, NNM).

``‖g_i − g_j‖²`` is summed from the differences themselves, in float64 over column
chunks, not from the Gram identity ``‖g_i‖² + ‖g_j‖² − 2 g_i·g_j``: for rows that
nearly coincide far from the origin (near-collinear cohorts, a duplicated update
plus noise) the identity cancels away every digit of the distance, and a ranking
by it is a ranking by rounding. The rows are first scaled by one power of two
(exact) so that the largest entry lies in ``[0.5, 1)``: squares neither overflow
(``‖g‖ ≳ 1e154``) nor underflow, and the order of the distances is unchanged.
Cost ``O(n² d)`` time, ``O(n² · cols)`` memory (``cols`` columns at a time).
"""

from __future__ import annotations

import math

import torch

__all__ = ["check_rows", "common_scale", "pairwise_sq_distances"]

# elements of one chunk's n × n × cols difference tensor (32 MiB of float64)
_BLOCK = 1 << 22


def check_rows(rule: str, rows: torch.Tensor) -> None:
    """One line naming ``rule`` when ``rows`` is empty or not finite (the server's
    screening rejects such rows before any rule; a direct call is refused here)."""
    if rows.ndim != 2 or rows.shape[0] == 0:
        raise ValueError(f"{rule}: the cohort is empty")
    if not bool(torch.isfinite(rows).all()):
        raise ValueError(f"{rule}: an update is not finite")


def common_scale(rows: torch.Tensor) -> float:
    """``2^-e`` with the largest ``|entry|`` of ``rows`` in ``[2^(e-1), 2^e)``: 1 for zeros."""
    top = float(rows.abs().max()) if rows.numel() else 0.0
    if top == 0.0:
        return 1.0
    return math.ldexp(1.0, -math.frexp(top)[1])


def pairwise_sq_distances(rows: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``D[i, j] = ‖s·g_i − s·g_j‖²`` (float64, ``n × n``) with ``s`` :func:`common_scale`
    (or ``scale``); divide by ``s²`` for the updates' units where that is in range."""
    n, d = rows.shape
    s = common_scale(rows) if scale is None else scale
    out = torch.zeros(n, n, dtype=torch.float64, device=rows.device)
    cols = max(1, _BLOCK // max(1, n * n))
    for a in range(0, d, cols):
        c = rows[:, a : a + cols].to(torch.float64) * s
        out += (c[:, None, :] - c[None, :, :]).square().sum(-1)
    return out
