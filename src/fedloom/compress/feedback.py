"""Error-feedback policies for compressed uplinks (ALGORITHMS.md §2).

A policy holds settings. Each client's state (residual ``e_k``, EF21's
``h_k``, SCAFCOM's ``c_k`` and ``v_k``) is rows of the per-client store,
gathered for the cohort and scattered back for the **accepted** clients only —
a client that is not sampled keeps its state untouched. Server-side state
(SA-PEF's ``L̂``, SCAFCOM's ``c``) goes in and comes back. All formulas use
the pseudo-gradient sign ``g_k = w − w_k``.

- ``none``: send ``C(g_k)``.
- ``ef`` (Seide et al. 2014; Stich & Karimireddy 2019): ``u = e + g``, send
  ``C(u)``, ``e ← u − C(u)``.
- ``sapef`` — SA-PEF (arXiv 2601.20738): step ahead ``x_0 = w − α e``, train,
  ``g = w − x_T`` (from the **received** w, so it includes the shift),
  ``u = (1 − α) e + g``, send ``C(u)``, ``e ← u − C(u)``. α = 0 is EF,
  α = 1 is SAEF (``saef``). ``alpha_schedule``: ``constant`` (public default
  0.85) or ``theory``: ``α* = 1/(1 + 12 s_r²)``, ``s_r = η_r L̂ T``, the
  minimiser of the paper's residual contraction
  ``(1 − 1/δ)[2(1 − α)² + 24 α² s_r²]``.
- ``ef21`` (Richtárik et al. 2021, delta form): ``c = C(g − h_k)``,
  ``h_k ← h_k + c``; the server aggregates the cohort's ``h_k`` (it mirrors
  them: it has received every ``c``).
- ``cser`` (Xie et al. 2020, simplified as in SA-PEF's code): EF, and every
  ``H`` rounds each client also sends the top ``reset_ratio`` of its residual;
  the server subtracts their mean ``ē`` from the model (pseudo-gradient sign)
  and broadcasts it; each client's residual becomes ``e − ē``.
- ``flare`` and ``ec_prox``: see :mod:`fedloom.compress.flare`.
- ``scafcom`` (Huang et al. 2023): SCAFFOLD local steps with ``c − c_k``;
  ``v_k ← (1−β)v_k + β(g_k/(η_l K) + c_k − c)``, ``δ_k = v_k − c_k``, send
  ``C(δ_k)``, ``c_k ← c_k + C(δ_k)``, and ``c ← c + (m/N) mean C(δ_k)``. The
  server step is ``w ← w − γ η_l K (mean C(δ_k) + c)``: the aggregator sees
  ``η_l K (C(δ_k) + c)``. Departure: the ``η_l K`` factor puts the rows in
  pseudo-gradient units (``v_k`` estimates a gradient), so ``server.lr = γ``
  composes with every aggregator and server optimizer like the other
  policies; γ = 1 is then FedAvg's step length.

Every policy keeps ``u == decode(payload) + e_new`` (the residual is computed
from the decoded payload, so float16 values or quantisation error stay in the
residual), exactly for sparsifiers and casts.

Online smoothness ``L̂`` for ``theory``: each sampled client measures
``‖∇f(x_1) − ∇f(x_0)‖ / ‖x_1 − x_0‖`` on its first batch across its first
local step (a secant estimate along the local trajectory); ``L̂`` is the
running maximum over rounds of the cohort median, so one noisy batch does not
drive α* to 0. Until a first estimate exists, ``alpha`` is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from fedloom.compress.base import Compressor
from fedloom.compress.sparse import TopK
from fedloom.state import FieldSpec

__all__ = ["CSER", "EF21", "SCAFCOM", "ErrorFeedback", "NoFeedback", "UplinkContext",
           "UplinkResult", "make_feedback"]

ServerState = dict[str, Any]


@dataclass(frozen=True)
class UplinkContext:
    round: int
    lr: float
    steps: int
    alpha: float
    gen: torch.Generator


@dataclass
class UplinkResult:
    payload: bytes
    sent: torch.Tensor                 # decode(payload), the vector the server sees
    state: dict[str, torch.Tensor]     # the client's new state rows
    residual_norm: float = 0.0
    extra_payloads: list[bytes] = field(default_factory=list)  # sent besides (CSER resets)
    extra_sent: torch.Tensor | None = None
    row_scale: float = 1.0             # SCAFCOM: gradient units → pseudo-gradient units


@dataclass
class RoundEnd:
    w_shift: torch.Tensor | None       # subtracted from the model after the server step
    server: ServerState
    downlink_bytes: int = 0


class NoFeedback:
    """Send ``C(g)``; no state."""

    name = "none"
    schedule = "constant"

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {}

    def init_server(self, w: torch.Tensor) -> ServerState:
        return {}

    def alpha(self, lr: float, steps: int, server: ServerState) -> float:
        return 0.0

    def start_point(self, w: torch.Tensor, state: dict[str, torch.Tensor],
                    alpha: float) -> torch.Tensor | None:
        return None

    def grad_shift(self, state: dict[str, torch.Tensor],
                   server: ServerState) -> torch.Tensor | None:
        return None

    def penalty(self, w: torch.Tensor, state: dict[str, torch.Tensor], round: int) -> Any:
        """A :class:`~fedloom.client.sgd.Penalty` for the first local steps (FLARE)."""
        return None

    def uplink(self, g: torch.Tensor, state: dict[str, torch.Tensor], comp: Compressor,
               ctx: UplinkContext, server: ServerState) -> UplinkResult:
        p = comp.encode(g, gen=ctx.gen)
        return UplinkResult(p, comp.decode(p, g.numel()).to(g.dtype), {})

    def server_row(self, up: UplinkResult, state: dict[str, torch.Tensor],
                   server: ServerState) -> torch.Tensor:
        return up.sent

    def end_round(self, ups: Sequence[UplinkResult], server: ServerState, num_clients: int,
                  probes: Sequence[float]) -> RoundEnd:
        """After aggregation; ``ups`` are the accepted clients' results (mutable)."""
        return RoundEnd(None, server)


class ErrorFeedback(NoFeedback):
    """EF (α = 0) and SA-PEF (α ∈ (0, 1]; SAEF at α = 1)."""

    def __init__(self, alpha: float = 0.0, schedule: Literal["constant", "theory"] = "constant",
                 name: str = "ef") -> None:
        if not 0 <= alpha <= 1:
            raise ValueError(f"compression.alpha: must be in [0, 1], got {alpha}")
        if schedule not in ("constant", "theory"):
            raise ValueError(f"compression.alpha_schedule: must be constant or theory, "
                             f"got {schedule!r}")
        self.base_alpha = alpha
        self.schedule = schedule
        self.name = name

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {"residual": FieldSpec(d)}

    def alpha(self, lr: float, steps: int, server: ServerState) -> float:
        """α_r: constant, or α* = 1/(1 + 12 s²) with s = η_r L̂ T."""
        L = server.get("lipschitz")
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
        sent = comp.decode(p, u.numel()).to(u.dtype)
        e_new = u - sent
        return UplinkResult(p, sent, {"residual": e_new}, float(torch.linalg.vector_norm(e_new)))

    def end_round(self, ups: Sequence[UplinkResult], server: ServerState, num_clients: int,
                  probes: Sequence[float]) -> RoundEnd:
        if self.schedule == "theory" and probes:
            server = {**server, "lipschitz": max(server.get("lipschitz", 0.0),
                                                 float(np.median(probes)))}
        return RoundEnd(None, server)


class EF21(NoFeedback):
    """EF21 in delta form: ``c = C(g − h_k)``, ``h_k ← h_k + c``; rows = new ``h_k``."""

    name = "ef21"

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {"h": FieldSpec(d)}

    def uplink(self, g: torch.Tensor, state: dict[str, torch.Tensor], comp: Compressor,
               ctx: UplinkContext, server: ServerState) -> UplinkResult:
        h = state["h"]
        p = comp.encode(g - h, gen=ctx.gen)
        sent = comp.decode(p, g.numel()).to(g.dtype)
        h_new = h + sent
        return UplinkResult(p, sent, {"h": h_new}, float(torch.linalg.vector_norm(g - h_new)))

    def server_row(self, up: UplinkResult, state: dict[str, torch.Tensor],
                   server: ServerState) -> torch.Tensor:
        return up.state["h"]


class CSER(ErrorFeedback):
    """EF with a periodic error reset every ``period`` rounds (see the module docstring)."""

    def __init__(self, period: int = 5, reset_ratio: float = 0.1) -> None:
        super().__init__(0.0, "constant", "cser")
        if period < 1:
            raise ValueError(f"compression.period: must be >= 1, got {period}")
        self.period = period
        self.reset = TopK(ratio=reset_ratio)

    def uplink(self, g: torch.Tensor, state: dict[str, torch.Tensor], comp: Compressor,
               ctx: UplinkContext, server: ServerState) -> UplinkResult:
        up = super().uplink(g, state, comp, ctx, server)
        if (ctx.round + 1) % self.period == 0:
            e = up.state["residual"]
            p = self.reset.encode(e)
            up.extra_payloads.append(p)
            up.extra_sent = self.reset.decode(p, e.numel()).to(e.dtype)
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


class SCAFCOM(NoFeedback):
    """SCAFFOLD with compressed control-variate updates and local momentum."""

    name = "scafcom"

    def __init__(self, beta: float = 0.2) -> None:
        if not 0 < beta <= 1:
            raise ValueError(f"compression.beta: must be in (0, 1], got {beta}")
        self.beta = beta

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {"c": FieldSpec(d), "v": FieldSpec(d)}

    def init_server(self, w: torch.Tensor) -> ServerState:
        return {"c": torch.zeros_like(w)}

    def grad_shift(self, state: dict[str, torch.Tensor],
                   server: ServerState) -> torch.Tensor | None:
        return server["c"] - state["c"]

    def uplink(self, g: torch.Tensor, state: dict[str, torch.Tensor], comp: Compressor,
               ctx: UplinkContext, server: ServerState) -> UplinkResult:
        c_k, c = state["c"], server["c"].to(g.dtype)
        v = (1 - self.beta) * state["v"] + self.beta * (g / (ctx.lr * ctx.steps) + c_k - c)
        delta = v - c_k
        p = comp.encode(delta, gen=ctx.gen)
        sent = comp.decode(p, g.numel()).to(g.dtype)
        return UplinkResult(p, sent, {"c": c_k + sent, "v": v},
                            float(torch.linalg.vector_norm(delta - sent)),
                            row_scale=ctx.lr * ctx.steps)

    def server_row(self, up: UplinkResult, state: dict[str, torch.Tensor],
                   server: ServerState) -> torch.Tensor:
        return up.row_scale * (up.sent + server["c"].to(up.sent.dtype))

    def end_round(self, ups: Sequence[UplinkResult], server: ServerState, num_clients: int,
                  probes: Sequence[float]) -> RoundEnd:
        if not ups:
            return RoundEnd(None, server)
        mean = torch.stack([u.sent for u in ups]).mean(0)
        c = server["c"] + (len(ups) / num_clients) * mean.to(server["c"].dtype)
        return RoundEnd(None, {**server, "c": c})


def make_feedback(name: str, alpha: float = 0.85,
                  schedule: Literal["constant", "theory"] = "constant", period: int = 5,
                  reset_ratio: float = 0.1, beta: float = 0.2, layout: Any = None,
                  tau: float = 0.05, tau_decay: float = 1.1, penalty_steps: int = 1,
                  penalty: str = "l1") -> NoFeedback:
    if name == "none":
        return NoFeedback()
    if name == "ef":
        return ErrorFeedback(0.0, "constant", "ef")
    if name == "saef":
        return ErrorFeedback(1.0, "constant", "saef")
    if name == "sapef":
        return ErrorFeedback(alpha, schedule, "sapef")
    if name == "ef21":
        return EF21()
    if name == "cser":
        return CSER(period, reset_ratio)
    if name == "scafcom":
        return SCAFCOM(beta)
    if name in ("flare", "ec_prox"):
        from fedloom.compress.flare import FLARE, ECProx

        if name == "ec_prox":
            return ECProx(tau, tau_decay)
        return FLARE(layout, tau, tau_decay, penalty_steps, penalty)  # type: ignore[arg-type]
    raise ValueError(f"compression.feedback: unknown policy {name!r} "
                     "(expected none, ef, saef, sapef, ef21, cser, scafcom, flare, ec_prox)")
