"""Error-feedback policies for compressed uplinks (ALGORITHMS.md §2).

A policy holds settings; each client's state (residual ``e_k``, EF21's
``h_k``) is rows of the per-client store, gathered for the cohort and
scattered back for the accepted clients only — a client that is not sampled
keeps its state untouched. All formulas use the pseudo-gradient sign
``g_k = w − w_k``.

- ``none``: send ``C(g_k)``.
- ``ef`` (Seide et al. 2014; Stich & Karimireddy 2019): ``u = e + g``, send
  ``C(u)``, ``e ← u − C(u)``.
- ``sapef`` — SA-PEF (arXiv 2601.20738): step ahead ``x_0 = w − α e``, train,
  ``g = w − x_T`` (from the **received** w, so it includes the shift),
  ``u = (1 − α) e + g``, send ``C(u)``, ``e ← u − C(u)``. α = 0 is EF,
  α = 1 is SAEF. ``alpha_schedule``: ``constant`` (public default 0.85) or
  ``theory``: ``α* = 1/(1 + 12 s_r²)``, ``s_r = η_r L̂ T``, minimising the
  paper's residual contraction ``(1 − 1/δ)[2(1 − α)² + 24 α² s_r²]``.
- ``ef21`` (Richtárik et al. 2021, delta form): ``c = C(g − h_k)``,
  ``h_k ← h_k + c``; the server aggregates the cohort's ``h_k``.

Every policy keeps the identity ``u == decode(payload) + e_new`` exactly (the
residual is computed from the decoded payload, so float16 values or
quantisation error stay in the residual, not lost).

The online smoothness estimate ``L̂`` for ``theory``: each round, for every
sampled client, ``‖∇f(w) − ∇f(x)‖ / ‖w − x‖`` is measured on one batch at the
received model ``w`` and the client's model after its first local step ``x``
(the secant estimate along the local trajectory); ``L̂`` is the running
maximum over rounds of the cohort median, so a single noisy batch does not
drive α* to 0. The first round (no estimate yet) uses ``alpha``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from fedloom.compress.base import Compressor
from fedloom.state import FieldSpec

__all__ = ["EF21", "ErrorFeedback", "Feedback", "NoFeedback", "UplinkResult", "make_feedback"]


@dataclass
class UplinkResult:
    payload: bytes
    sent: torch.Tensor                 # decode(payload), the vector the server sees
    state: dict[str, torch.Tensor]     # the client's new state rows
    residual_norm: float = 0.0


class Feedback(Protocol):
    name: str

    def fields(self, d: int) -> dict[str, FieldSpec]: ...

    def alpha(self, lr: float, steps: int) -> float: ...

    def start_point(self, w: torch.Tensor, state: dict[str, torch.Tensor],
                    alpha: float) -> torch.Tensor | None: ...

    def uplink(self, g: torch.Tensor, state: dict[str, torch.Tensor], comp: Compressor,
               gen: torch.Generator, alpha: float) -> UplinkResult: ...

    def server_row(self, res: UplinkResult, state: dict[str, torch.Tensor]) -> torch.Tensor: ...


class NoFeedback:
    name = "none"

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {}

    def alpha(self, lr: float, steps: int) -> float:
        return 0.0

    def start_point(self, w: torch.Tensor, state: dict[str, torch.Tensor],
                    alpha: float) -> torch.Tensor | None:
        return None

    def uplink(self, g: torch.Tensor, state: dict[str, torch.Tensor], comp: Compressor,
               gen: torch.Generator, alpha: float) -> UplinkResult:
        p = comp.encode(g, gen=gen)
        return UplinkResult(p, comp.decode(p, g.numel()).to(g.dtype), {})

    def server_row(self, res: UplinkResult, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return res.sent


class ErrorFeedback(NoFeedback):
    """EF (α = 0) and SA-PEF (α ∈ (0, 1], SAEF at α = 1)."""

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
        self.lipschitz: float | None = None  # L̂, updated by the engine (theory schedule)

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {"residual": FieldSpec(d)}

    def alpha(self, lr: float, steps: int) -> float:
        """α_r: constant, or α* = 1/(1 + 12 s²) with s = η_r L̂ T."""
        if self.schedule == "constant" or self.lipschitz is None:
            return self.base_alpha
        s = lr * self.lipschitz * steps
        return 1.0 / (1.0 + 12.0 * s * s)

    def start_point(self, w: torch.Tensor, state: dict[str, torch.Tensor],
                    alpha: float) -> torch.Tensor | None:
        if alpha == 0:
            return None
        return w - alpha * state["residual"]

    def uplink(self, g: torch.Tensor, state: dict[str, torch.Tensor], comp: Compressor,
               gen: torch.Generator, alpha: float) -> UplinkResult:
        e = state["residual"]
        u = g + (1.0 - alpha) * e if alpha != 1 else g.clone()
        p = comp.encode(u, gen=gen)
        sent = comp.decode(p, g.numel()).to(u.dtype)
        e_new = u - sent
        return UplinkResult(p, sent, {"residual": e_new},
                            float(torch.linalg.vector_norm(e_new)))


class EF21(NoFeedback):
    """EF21 in delta form: ``c = C(g − h_k)``, ``h_k ← h_k + c``; rows = new ``h_k``."""

    name = "ef21"

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {"h": FieldSpec(d)}

    def uplink(self, g: torch.Tensor, state: dict[str, torch.Tensor], comp: Compressor,
               gen: torch.Generator, alpha: float) -> UplinkResult:
        h = state["h"]
        p = comp.encode(g - h, gen=gen)
        sent = comp.decode(p, g.numel()).to(g.dtype)
        h_new = h + sent
        return UplinkResult(p, sent, {"h": h_new}, float(torch.linalg.vector_norm(g - h_new)))

    def server_row(self, res: UplinkResult, state: dict[str, torch.Tensor]) -> torch.Tensor:
        # The server mirrors h_k (it has received every c_k): it aggregates h_k + c_k.
        return res.state["h"]


def make_feedback(name: str, alpha: float = 0.85,
                  schedule: Literal["constant", "theory"] = "constant") -> Feedback:
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
    raise ValueError(f"compression.feedback: unknown policy {name!r} "
                     "(expected none, ef, saef, sapef, ef21)")
