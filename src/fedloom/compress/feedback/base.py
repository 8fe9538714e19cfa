"""The feedback protocol: what an uplink knows and returns (:class:`UplinkContext`,
:class:`UplinkResult`, :class:`RoundEnd`) and :class:`NoFeedback`, the base policy
(send ``C(g)``; no state) every policy derives from (:mod:`fedloom.compress.feedback`).

A policy has two halves, each called on its own side:

- **client half**: ``fields``, ``alpha``, ``start_point``, ``grad_shift``,
  ``penalty``, ``probes_smoothness`` (its part of local training) and
  ``uplink(g, rows, comp, ctx, server) -> UplinkResult``: the payload bytes and the
  client's new rows. It decodes its own payload only where its rows need it (EF's
  residual ``e = u − C(u)``); the plain uplink does not.
- **server half**: ``init_server``, ``server_row(up, rows, server)`` (the row the
  aggregator receives, from :attr:`UplinkResult.decoded`), ``end_round`` and
  ``round_metrics``. The engine's receive stage decodes every payload itself
  with the round's compressor and sets :attr:`UplinkResult.sent` to that before
  ``server_row``: the server reads the bytes it received, as a deployed one does,
  never the client's own decode. Departure: CSER's reset payload
  (``extra_payloads``) is decoded by the policy on the client side
  (``extra_sent``), its codec being the policy's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedloom.capabilities import FeedbackCaps, feedback_caps
from fedloom.compress.base import Compressor
from fedloom.compress.identity import InPlacePayload
from fedloom.state import FieldSpec

ServerState = dict[str, Any]


@dataclass(frozen=True)
class UplinkContext:
    """What a client's uplink knows of its round besides its update and state."""

    round: int
    lr: float                # the local learning rate η of the round
    steps: int               # the local steps K the client ran
    alpha: float
    gen: torch.Generator
    momentum: float = 0.0    # heavy-ball coefficient of the local steps (0: plain SGD)
    cohort: int = 1          # m: clients that trained this round
    num_clients: int = 1     # N: clients in the federation


@dataclass
class UplinkResult:
    # the bytes sent; a float32 identity vector read where it is (InPlacePayload)
    payload: bytes | InPlacePayload
    # decode(payload): the client's own where its rows need it (None: it did not
    # decode), replaced by the server's decode of the bytes before server_row
    sent: torch.Tensor | None
    state: dict[str, torch.Tensor]     # the client's new state rows
    residual_norm: float = 0.0
    extra_payloads: list[bytes] = field(default_factory=list)  # sent besides (CSER resets)
    extra_sent: torch.Tensor | None = None
    row_scale: float = 1.0             # the scale of `sent` in the server row (EF21, SCAFCOM)
    # SA-PEF's residual schedule: ‖Δ‖ = ‖x_0 − x_T‖, the local steps' own displacement
    progress_norm: float = float("nan")

    @property
    def decoded(self) -> torch.Tensor:
        """``decode(payload)``, what the server half reads (the server sets it)."""
        if self.sent is None:
            raise ValueError("uplink: the payload has not been decoded")
        return self.sent


@dataclass
class RoundEnd:
    w_shift: torch.Tensor | None       # subtracted from the model after the server step
    server: ServerState
    downlink_bytes: int = 0


_ROW_ONLY = FeedbackCaps(row_only=True)


class NoFeedback:
    """Send ``C(g)``; no state.

    ``capabilities`` (:class:`~fedloom.capabilities.FeedbackCaps`, what privacy
    reads): ``schedule``, the α schedule's kind, and ``row_only``, whether the server
    uses each client's row only; a subclass declares its own where they differ.
    """

    name = "none"
    # The server uses each client's row only: no server state, model shift or extra
    # payload built from the clients' messages (privacy.mode=central needs it).
    # A read-only property, as the subclasses whose capabilities follow their options.
    @property
    def capabilities(self) -> FeedbackCaps:
        return _ROW_ONLY

    @property
    def probes_smoothness(self) -> bool:
        """Whether clients measure the local smoothness on their first step (the
        ``probes`` :meth:`end_round` gets); SA-PEF's ``theory`` schedule does."""
        # through the reader: a plug-in subclass may still set a loose `schedule`
        return feedback_caps(self).schedule == "theory"

    def round_metrics(self, server: ServerState) -> dict[str, float]:
        """Metrics of the round from the new server state (logged after ``alpha``)."""
        if "lipschitz" in server:  # the online L̂ of the ``theory`` schedule
            return {"lipschitz_estimate": server["lipschitz"]}
        return {}

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
        # the client keeps nothing: no need to decode its own payload
        return UplinkResult(comp.encode(g, gen=ctx.gen), None, {})

    def server_row(self, up: UplinkResult, state: dict[str, torch.Tensor],
                   server: ServerState) -> torch.Tensor:
        return up.decoded

    def end_round(self, ups: Sequence[UplinkResult], server: ServerState, num_clients: int,
                  probes: Sequence[float]) -> RoundEnd:
        """After aggregation; ``ups`` are the accepted clients' results (mutable)."""
        return RoundEnd(None, server)
