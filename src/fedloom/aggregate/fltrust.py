"""FLTrust: each update trusted by its cosine with the server's own update, rescaled to it.

Cao, Fang, Liu & Gong, "FLTrust: Byzantine-robust Federated Learning via Trust
Bootstrapping" (NDSS 2021), Algorithm 1 and eq. (4)-(5). The server holds a small root
data set and trains on it each round, by the clients' local training from the round's
model, its own update ``g_0``; with ``g_1 … g_n`` the clients' updates::

    TS_i = ReLU(cos(g_i, g_0)),   direction = Σ_i TS_i (‖g_0‖/‖g_i‖) g_i / Σ_i TS_i.

The root data (``root_samples``, the paper's default 100) is the server's, declared as
``AggregatorCaps.reference_samples``; the engine draws it once from the clients'
training samples before any attacker poisons its own and trains ``g_0`` each round
(:mod:`fedloom.engine.stages.reference`). The paper assumes it clean and of roughly the
task's distribution (its root data is drawn uniformly from the training set).

Public code: zhmzm/FLAME's PyTorch ``fltrust`` (utils/defense.py, fd4cef2), run on 45
seeded cohorts (d = 500, sign-flipped and 1e4-scaled attackers, 5 with no trust): max
difference 1.3e-15 (benchmarks/fltrust_reference.py; outside make test, the code being
another repository's). ByzFL 0.0.11 has no FLTrust. Golden values by hand in
tests/test_fltrust.py (to 1e-15).
Departures: a zero update ``g_i`` (cosine undefined) gets trust 0, not NaN; when every
trust score is 0 (or ``g_0`` is zero) the rule raises, so the round applies no update
and is counted in ``rejected_rounds`` (the formula divides by zero there); unweighted,
as the paper (sample counts are ignored); computed in float64 on rows scaled by powers
of two, so huge rows neither overflow nor underflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import torch

from fedloom.aggregate.base import CohortInfo, Stateless, check_cohort
from fedloom.aggregate.distances import check_rows
from fedloom.capabilities import AggregatorCaps
from fedloom.registry import Range, register

__all__ = ["FLTrust", "trust_scores"]

_TINY = torch.finfo(torch.float64).tiny


def _units(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's unit vector (zero for a zero row) and its norm (float64), each row
    first scaled by a power of two of its own (exact) so that no square overflows."""
    x = rows.to(torch.float64)
    top = x.abs().amax(dim=1)
    _, e = torch.frexp(torch.where(top > 0, top, torch.ones_like(top)))
    s = torch.ldexp(torch.ones_like(top), -e.to(torch.float64))
    xs = x * s[:, None]
    n = torch.linalg.vector_norm(xs, dim=1)
    unit = xs / n.clamp_min(_TINY)[:, None]
    return unit, n / s


def trust_scores(updates: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``ReLU(cos(g_i, g_0))`` for each row ``g_i`` (float64; 0 for a zero row)."""
    u, _ = _units(updates)
    u0, _ = _units(reference.reshape(1, -1))
    return (u @ u0[0]).clamp(min=0.0, max=1.0)


class FLTrust(Stateless):
    """FLTrust (Cao et al. 2021).

    Args:
        root_samples: the size of the server's root data set (the paper's 100).

    Reference:
        paper: Cao, Fang, Liu & Gong, "FLTrust: Byzantine-robust Federated Learning via
            Trust Bootstrapping", NDSS 2021, Algorithm 1.
        code: zhmzm/FLAME's ``fltrust`` (PyTorch), run; ByzFL has none.
        departures: no trust at all rejects the round; a zero update has trust 0;
            unweighted.
        measured: max |difference| 1.3e-15 from zhmzm/FLAME's on 45 cohorts
            (benchmarks/fltrust_reference.py); golden values by hand to 1e-15.
    """

    # server.lr=auto: the direction is a mean of updates of the server's update's norm,
    # in the model's units (FedAvg's step; the paper's global rate applies to gradients).
    default_server_lr = 1.0

    def __init__(self, root_samples: Annotated[int, Range(ge=1)] = 100) -> None:
        if (isinstance(root_samples, bool) or not isinstance(root_samples, int)
                or root_samples < 1):
            raise ValueError("aggregator.options.root_samples: must be an integer >= 1, "
                             f"got {root_samples!r}")
        self.root_samples = root_samples

    @property
    def capabilities(self) -> AggregatorCaps:
        # not linear (the scores read each row): secure aggregation and central DP refuse it
        return AggregatorCaps(reference_samples=self.root_samples)

    def __call__(
        self, updates: torch.Tensor, weights: torch.Tensor, state: None, *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, None, Mapping[str, float]]:
        check_cohort("fltrust", updates, weights)
        check_rows("fltrust", updates)
        ref = info.reference if info is not None else None
        if ref is None or tuple(ref.shape) != (updates.shape[1],):
            raise ValueError("fltrust: needs the server's reference update of the model's "
                             "size (CohortInfo.reference)")
        if not bool(torch.isfinite(ref).all()):
            raise ValueError("fltrust: the server's reference update is not finite")
        u, _ = _units(updates)
        u0, n0 = _units(ref.reshape(1, -1).to(updates.device))
        if float(n0[0]) == 0.0:
            raise ValueError("fltrust: the server's reference update is zero; no update")
        ts = (u @ u0[0]).clamp(min=0.0, max=1.0)
        total = ts.sum()
        if float(total) == 0.0:
            raise ValueError("fltrust: every update has trust score 0 (no positive cosine "
                             "with the server's update); no update this round")
        # Σ TS_i (‖g_0‖/‖g_i‖) g_i / Σ TS_i = ‖g_0‖ Σ TS_i u_i / Σ TS_i
        out = (ts / total) @ u * n0[0]
        return out.to(updates.dtype), state, {
            "fltrust_trusted": float((ts > 0).sum()),
            "fltrust_trust_mean": float(ts.mean()),
            "fltrust_reference_norm": float(n0[0]),
        }


# The class is its own factory: its constructor arguments are the config options.
register("aggregator", "fltrust")(FLTrust)
