"""Error feedback with a residual: EF, SAEF and SA-PEF (:class:`ErrorFeedback`, its α
schedules and :func:`residual_alpha`) and CSER, EF with a periodic error reset
(:mod:`fedloom.compress.feedback`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch

from fedloom.capabilities import FeedbackCaps
from fedloom.compress.base import Compressor
from fedloom.compress.feedback.base import (
    NoFeedback,
    RoundEnd,
    ServerState,
    UplinkContext,
    UplinkResult,
)
from fedloom.compress.sparse import TopK
from fedloom.state import FieldSpec

Schedule = Literal["constant", "theory", "residual"]
SCHEDULES: tuple[str, ...] = ("constant", "theory", "residual")


def residual_alpha(progress: Sequence[float], residual: Sequence[float], alpha_max: float,
                   kappa: float) -> float | None:
    """SA-PEF's ``residual`` schedule: ``α = min(α_max, κ · median_k ‖Δ_k‖/‖e_k‖)``.

    ``Δ_k = x_0 − x_T`` is client k's own local displacement this round and ``e_k`` the
    residual it keeps (the next step-ahead starts at ``w − α e_k``); both norms the
    client has already. The rule is a trust region on the step-ahead jump,
    ``α‖e_k‖ ≤ κ‖Δ_k‖`` for the median client: by L-smoothness the gradient mismatch
    the jump introduces, ``‖∇f(w − αe) − ∇f(w)‖ ≤ Lα‖e‖``, is then at most ``κ L‖Δ‖``,
    the bound on the gradient change along the client's own local trajectory that
    local SGD's drift term already pays — the paper's ``24α²s²`` term kept at the
    order of the drift, without knowing ``L`` (``theory`` needs a probe for it).
    Where the residual is small against the local progress, ``α = α_max`` (the
    configured ``alpha``, public 0.85); as the residual grows against it, α falls
    towards EF (α = 0).

    ``κ`` (``compression.feedback.options.alpha_kappa``) defaults to 10, the one choice
    made on data: on digits-top1 (configs/adaptive/suite.yaml's setting, Top-1 %) the median
    ratio ‖Δ‖/‖e‖ sat at 0.03–0.4, so κ = 1 (the bound taken literally) held α at
    0.07–0.4 and ended at 0.84 test accuracy (seed 1; constant α = 0.85: 0.93), κ = 3
    at 0.74 and κ = 10 at 0.88 (seed 100, the tuning seed; one run each). The
    smoothness bound is loose along ``e``: a residual of top-k leftovers moves the
    gradient far less than ``L‖e‖``.

    Bounds: the result is in ``[0, α_max] ⊂ [0, 1]``. A client with ``‖e_k‖ = 0`` has
    ratio ``+∞`` (nothing to step ahead along); pairs with a non-finite or negative
    norm, or ``0/0``, are skipped; ``None`` (keep the previous α) when none is left.
    """
    ratios = []
    for a, b in zip(progress, residual, strict=True):
        a, b = float(a), float(b)
        if not (a >= 0 and b >= 0 and math.isfinite(a) and math.isfinite(b)):
            continue
        if b == 0:
            if a == 0:
                continue
            ratios.append(math.inf)
        else:
            ratios.append(a / b)
    if not ratios:
        return None
    med = float(np.median(ratios))
    top = min(1.0, max(0.0, float(alpha_max)))
    if not med == med:  # NaN median (inf − inf between the middle two)
        return top
    return min(top, max(0.0, kappa * med)) if med < math.inf else top


class ErrorFeedback(NoFeedback):
    """EF (α = 0) and SA-PEF (α ∈ (0, 1]; SAEF at α = 1)."""

    def __init__(self, alpha: float = 0.0, schedule: Schedule = "constant",
                 name: str = "ef", kappa: float = 10.0) -> None:
        if not 0 <= alpha <= 1:
            raise ValueError(f"compression.feedback.options.alpha: must be in [0, 1], "
                             f"got {alpha}")
        if schedule not in SCHEDULES:
            raise ValueError(f"compression.feedback.options.alpha_schedule: must be one of "
                             f"{', '.join(SCHEDULES)}, got {schedule!r}")
        if isinstance(kappa, bool) or not isinstance(kappa, int | float) or not (
                0 < kappa < math.inf):
            raise ValueError(f"compression.feedback.options.alpha_kappa: must be > 0 and "
                             f"finite, got {kappa!r}")
        self.base_alpha = alpha
        self.schedule = schedule
        self.name = name
        self.kappa = float(kappa)

    def constructor_arguments(self) -> dict[str, Any]:
        """The constructor's arguments (``alpha`` is kept as ``base_alpha``: ``alpha()``
        is the round's α), so a run given this object can be rerun from its record."""
        return {"alpha": self.base_alpha, "schedule": self.schedule, "name": self.name,
                "kappa": self.kappa}

    @property
    def capabilities(self) -> FeedbackCaps:
        """Row-only; the α schedule is the option (privacy refuses theory and residual)."""
        return FeedbackCaps(schedule=self.schedule, row_only=True)

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {"residual": FieldSpec(d)}

    def alpha(self, lr: float, steps: int, server: ServerState) -> float:
        """α_r: constant, α* = 1/(1 + 12 s²) with s = η_r L̂ T (``theory``), or the
        last round's :func:`residual_alpha` (``residual``; ``alpha`` until then)."""
        if self.schedule == "residual":
            return float(server.get("alpha_residual", self.base_alpha))
        L: float | None = server.get("lipschitz")
        if self.schedule == "constant" or L is None:
            return self.base_alpha
        s = lr * L * steps
        return 1.0 / (1.0 + 12.0 * s * s)

    def start_point(self, w: torch.Tensor, state: dict[str, torch.Tensor],
                    alpha: float) -> torch.Tensor | None:
        if alpha == 0:
            return None
        return w - alpha * state["residual"]

    def uplink(self, g: torch.Tensor, state: dict[str, torch.Tensor], comp: Compressor,
               ctx: UplinkContext, server: ServerState) -> UplinkResult:
        u = g + (1.0 - ctx.alpha) * state["residual"]
        p = comp.encode(u, gen=ctx.gen)
        sent = comp.decode(p, u.numel()).to(u.device, u.dtype)
        e_new = u - sent
        progress = float("nan")
        if self.schedule == "residual":  # Δ = x_0 − x_T = g − α e (g is from the received w)
            progress = float(torch.linalg.vector_norm(g - ctx.alpha * state["residual"]))
        return UplinkResult(p, sent, {"residual": e_new}, float(torch.linalg.vector_norm(e_new)),
                            progress_norm=progress)

    def round_metrics(self, server: ServerState) -> dict[str, float]:
        if "alpha_residual" in server:  # the residual schedule's α for the next round
            return {"alpha_next": float(server["alpha_residual"])}
        return super().round_metrics(server)

    def end_round(self, ups: Sequence[UplinkResult], server: ServerState, num_clients: int,
                  probes: Sequence[float]) -> RoundEnd:
        if self.schedule == "residual":
            a = residual_alpha([u.progress_norm for u in ups], [u.residual_norm for u in ups],
                               self.base_alpha, self.kappa)
            if a is not None:
                server = {**server, "alpha_residual": a}
        if self.schedule == "theory" and probes:
            server = {**server, "lipschitz": max(server.get("lipschitz", 0.0),
                                                 float(np.median(probes)))}
        return RoundEnd(None, server)


class CSER(ErrorFeedback):
    """EF with a periodic error reset every ``period`` rounds (see the module docstring)."""

    # the reset ē is broadcast, built from the clients' residuals
    capabilities = FeedbackCaps(row_only=False)

    def __init__(self, period: int = 5, reset_ratio: float = 0.1) -> None:
        super().__init__(0.0, "constant", "cser")
        if period < 1:
            raise ValueError(f"compression.feedback.options.period: must be >= 1, got {period}")
        self.period = period
        self.reset = TopK(ratio=reset_ratio)

    def constructor_arguments(self) -> dict[str, Any]:
        """The constructor's arguments (the reset's ratio is its top-k's)."""
        return {"period": self.period, "reset_ratio": self.reset.ratio}

    def uplink(self, g: torch.Tensor, state: dict[str, torch.Tensor], comp: Compressor,
               ctx: UplinkContext, server: ServerState) -> UplinkResult:
        up = super().uplink(g, state, comp, ctx, server)
        if (ctx.round + 1) % self.period == 0:
            e = up.state["residual"]
            # The reset payload carries the CRC-32C trailer exactly when the uplink's does.
            reset = TopK(ratio=self.reset.ratio, checksum=getattr(comp, "checksum", True))
            p = reset.encode(e)
            up.extra_payloads.append(p)
            up.extra_sent = reset.decode(p, e.numel()).to(e.device, e.dtype)
        return up

    def end_round(self, ups: Sequence[UplinkResult], server: ServerState, num_clients: int,
                  probes: Sequence[float]) -> RoundEnd:
        resets = [u.extra_sent for u in ups if u.extra_sent is not None]
        if not resets:
            return RoundEnd(None, server)
        e_bar = torch.stack(resets).mean(0)
        for u in ups:
            u.state["residual"] = u.state["residual"] - e_bar
            u.residual_norm = float(torch.linalg.vector_norm(u.state["residual"]))
        # ē is broadcast densely to the cohort (4 bytes a coordinate plus the header).
        return RoundEnd(e_bar, server, len(ups) * (8 + 4 * e_bar.numel()))
