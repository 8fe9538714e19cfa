"""EF21 in delta form with its partial-participation rules (:class:`EF21`;
:mod:`fedloom.compress.feedback`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

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
from fedloom.state import FieldSpec


class EF21(NoFeedback):
    """EF21 in delta form, with the partial-participation rule ``mean``.

    Client k, when sampled: ``c_k = C(g_k − h_k)`` is sent and
    ``h_k ← h_k + c_k`` (the server can mirror ``h_k``: it has received every
    ``c_k``). A client that is not sampled keeps its ``h_k``.

    ``mean="all"`` (default) — EF21-PP (Fatkhullin et al. 2021, arXiv
    2110.03294, Algorithm EF21-PP): the server keeps ``ḡ = (1/N) Σ_{k=1..N} h_k``
    over **all** N clients, updated by the sampled clients' compressed deltas,

        ḡ ← ḡ + (1/N) Σ_{k∈S} c_k,

    and steps along ``ḡ`` (``ḡ`` starts at 0 with every ``h_k``). The aggregator
    sees the row ``ḡ_old + (m/N) c_k`` for client k (m = clients that trained
    this round), so the plain mean of the cohort's rows (``fedavg`` with
    ``weighted: false``) is exactly the new ``ḡ``; the ``n_k``-weighted mean
    gives ``ḡ_old + (m/N) Σ_S p_k c_k`` (this round's deltas reweighted by
    ``p_k = n_k/Σ_S n_j``; the stored ``ḡ`` stays the uniform mean of all
    ``h_k``). Non-sampled clients keep pulling the step through their stale
    ``h_k``; early in a run ``ḡ`` holds only the clients seen so far, so the
    first steps are short (``m/N`` of the sampled variant's in round 1).

    ``mean="sampled"``: the rows are the sampled clients' new ``h_k`` and the
    step is their aggregate (their mean with ``fedavg``): stale clients do not
    count. Not a published EF21 rule under partial participation; it was
    fedloom's only rule before ``ef21_mean`` existed.

    With every client in every round (m = N) both rules give ``(1/N) Σ_k h_k``
    (the original EF21, whose analysis and experiments are full participation).

    Public code checked: neither public implementation behind the results
    pages has EF21 — SA-PEF's repository (Dawitkiros/SA-PEF: FedAvg, EF, SAEF,
    SA-PEF, CSER, SCAFFOLD, SCALLION, SCAFCOM) nor FLARE's (RanGreidi/FLARE:
    FLARE and error correction, every client every round) — so the default is
    the published partial-participation rule, EF21-PP.

    Departures: ``g_k`` is the local-training pseudo-gradient ``w − w_k``
    instead of ``∇f_k(w)`` (the federated form used for every policy here);
    the cohort is m clients drawn uniformly without replacement (EF21-PP's
    analysis samples clients independently); the step goes through the
    configured aggregator and server optimizer (``server.lr`` is EF21's γ).
    ``ḡ`` is accumulated in the model's dtype; with ``state.dtype=float16``
    the stored ``h_k`` are rounded and ``ḡ`` differs from their mean by that
    rounding.

    Measured (tests/test_feedback_public.py): the golden two-round example
    (N = 4, Top-1) gives the hand-derived steps exactly under both rules; on
    the digits run (10 clients, 4 a round, Top-5 %, float64 model, float32
    store, 6 rounds) ``ḡ`` equals the mean of all 10 stored ``h_k`` to
    2.9e-9 max abs (``max |h| ≈ 0.3``: the store's float32 rounding), and the
    two rules give different models.
    """

    name = "ef21"

    @property
    def capabilities(self) -> FeedbackCaps:
        """Row-only with ``mean="sampled"``; EF21-PP's ḡ is server state built from the c_k."""
        return FeedbackCaps(row_only=self.mean == "sampled")

    def __init__(self, mean: Literal["all", "sampled"] = "all") -> None:
        if mean not in ("all", "sampled"):
            raise ValueError(f"compression.feedback.options.ef21_mean: must be all or sampled, "
                             f"got {mean!r}")
        self.mean = mean

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {"h": FieldSpec(d)}

    def init_server(self, w: torch.Tensor) -> ServerState:
        return {"g": torch.zeros_like(w)} if self.mean == "all" else {}

    def uplink(self, g: torch.Tensor, state: dict[str, torch.Tensor], comp: Compressor,
               ctx: UplinkContext, server: ServerState) -> UplinkResult:
        h = state["h"]
        p = comp.encode(g - h, gen=ctx.gen)
        sent = comp.decode(p, g.numel()).to(g.device, g.dtype)
        h_new = h + sent
        scale = 1.0
        if self.mean == "all":
            if not 1 <= ctx.cohort <= ctx.num_clients:
                raise ValueError(f"ef21: cohort of {ctx.cohort} out of {ctx.num_clients} "
                                 "clients")
            scale = ctx.cohort / ctx.num_clients
        return UplinkResult(p, sent, {"h": h_new}, float(torch.linalg.vector_norm(g - h_new)),
                            row_scale=scale)

    def server_row(self, up: UplinkResult, state: dict[str, torch.Tensor],
                   server: ServerState) -> torch.Tensor:
        if self.mean == "sampled":  # h_k + c_k, from the server's copy of h_k
            return state["h"] + up.decoded
        g: torch.Tensor = server["g"]  # ServerState holds Any: name the tensor's type
        return g.to(up.decoded.dtype) + up.row_scale * up.decoded

    def end_round(self, ups: Sequence[UplinkResult], server: ServerState, num_clients: int,
                  probes: Sequence[float]) -> RoundEnd:
        if self.mean == "sampled" or not ups:
            return RoundEnd(None, server)
        total = torch.stack([u.decoded for u in ups]).sum(0).to(server["g"].dtype)
        return RoundEnd(None, {**server, "g": server["g"] + total / num_clients})
