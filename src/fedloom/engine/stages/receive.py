"""Receive: what the server makes of the kept clients' payloads.

Decode each payload into the row the aggregator would receive (the feedback
policy's ``server_row``); reject a client whose reported numbers are not ones a
client has (a sample or step count that is not a finite whole number in
``[0, 2**53]`` — samples ``> 0`` —, a start loss that is not finite where the rule
needs it: one such number would fail the round's step for everyone); then screen
the rows as the clients screened their dense updates (non-finite,
:func:`~fedloom.engine.stages.screen.screen_updates`: the server's own check, the one
that holds for deployed clients too), reject a client whose new state rows are
not finite, and clip (``server.clip_norm``). Nothing is aggregated here;
:class:`Received` says what may be, and holds the accepted clients' numbers as
tensors (a rejected client's are placeholders, never read).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedloom.capabilities import compressor_caps
from fedloom.compress import coordinates_sent
from fedloom.compress.feedback import UplinkResult
from fedloom.engine.algorithm import Algorithm
from fedloom.engine.inputs import ModelSpace, ScreenRules
from fedloom.engine.runstate import RoundOutcome, RoundPlan, RunState
from fedloom.engine.stages.screen import (
    clip_rows,
    count_reason,
    finite_rows,
    first_line,
    loss_reason,
    non_finite_reason,
    row_norms,
    screen_updates,
)
from fedloom.job import ClientResult

__all__ = ["Received", "RowBuffer", "receive"]

log = logging.getLogger("fedloom")


@dataclass
class Received:
    """The cohort's rows as the server has them, and which of them may be aggregated."""

    rows: torch.Tensor             # [m, d], the decoded rows (clipped where ok)
    ok: torch.Tensor               # [m] bool, on the host: accepted rows
    reasons: dict[int, str]        # cohort position → why it was rejected
    rejected: list[int]            # the rejected clients' ids, by position
    clipped: int                   # rows scaled down to server.clip_norm
    weights: torch.Tensor          # [m] the clients' sample counts (run dtype, device)
    losses: torch.Tensor           # [m] the clients' training losses (float64, host)
    up_bytes: int                  # every byte the cohort sent
    down_bytes: int                # the broadcast to every planned client
    density: float                 # mean fraction of coordinates sent (NaN: none sent)
    steps: torch.Tensor | None = None         # [m] local step counts (int64, host)
    start_losses: torch.Tensor | None = None  # [m] F_k(w) where the rule needs it (float64)


def receive(algo: Algorithm, space: ModelSpace, rules: ScreenRules, downlink_size: int,
            st: RunState, plan: RoundPlan, outcome: RoundOutcome,
            buffer: RowBuffer | None = None) -> Received:
    """Decode, screen and clip the kept clients' payloads (``plan``: the kept
    clients'; ``downlink_size``: the bytes of one broadcast, counted for every
    planned client; ``buffer``: where the rows are written, reused across rounds,
    :class:`RowBuffer`)."""
    results, ups, refused = outcome.results, outcome.ups, outcome.refused
    sent = [u for i, u in enumerate(ups) if i not in refused]
    density = (float(np.mean([coordinates_sent(u.payload) for u in sent])) / space.layout.size
               if sent else float("nan"))
    rows, undecodable = _decode(algo.feedback, space, st, plan, outcome, buffer)
    reasons = {**refused, **undecodable}
    # With a size rule on, one norm pass also tells the non-finite rows.
    norms = ((outcome.prenorms.clone() if outcome.prenorms is not None else row_norms(rows))
             if rules.sized else None)
    finite = torch.isfinite(norms) if norms is not None else finite_rows(rows)
    # Masks and ids stay on the host (m entries): a host index works on a device
    # tensor, not the other way round.
    finite = finite.cpu()
    for i in reasons:
        finite[i] = False
    needs_start = "start_losses" in algo.requires
    _reject_absurd_numbers(results, finite, reasons, needs_start)
    _reject_non_finite(rows, finite, reasons, results, ups)
    clipped = 0
    if norms is not None and bool(finite.any()):
        big = screen_updates(norms, finite, max_norm=rules.max_update_norm,
                             max_ratio=rules.ratio)
        for i, why in big.items():
            finite[i] = False
            reasons[i] = why
        if rules.clip_norm is not None:
            # a payload's decoded vector is what it sent, before the server clips
            for u in ups:
                if u.sent is not None and u.sent.numel() and _shares(u.sent, rows):
                    u.sent = u.sent.clone()
            clipped = clip_rows(rows, norms, finite, rules.clip_norm)
    cohort = plan.cohort
    rejected = [int(cohort[i]) for i in sorted(reasons)]
    if rejected:
        log.warning("round %d: rejected updates from clients %s: %s", plan.round + 1, rejected,
                    "; ".join(f"{int(cohort[i])}: {reasons[i]}" for i in sorted(reasons)))
    # A rejected client's numbers may not even fit a tensor (1e39 samples): a
    # placeholder stands in for them; only accepted positions are ever read.
    bad = set(reasons)
    weights = torch.tensor([1.0 if i in bad else float(res.num_samples)
                            for i, res in enumerate(results)], dtype=space.dtype,
                           device=space.device).reshape(-1)
    losses = torch.tensor([_loss(res.loss) for res in results], dtype=torch.float64)
    steps = torch.tensor([1 if i in bad else int(res.steps) for i, res in enumerate(results)],
                         dtype=torch.int64)
    start = (torch.tensor([1.0 if i in bad else float(res.start_loss)  # type: ignore[arg-type]
                           for i, res in enumerate(results)], dtype=torch.float64)
             if needs_start else None)
    up_bytes = sum(len(u.payload) + sum(len(x) for x in u.extra_payloads) for u in ups)
    return Received(rows, finite, reasons, rejected, clipped, weights, losses, up_bytes,
                    downlink_size * len(plan.jobs), density, steps, start)


def _shares(t: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether ``t`` is one of ``rows``' rows (a decode straight into the buffer)."""
    return t.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()


def _loss(v: object) -> float:
    """A training loss for the round's metrics (NaN where it is not a finite number)."""
    return float(v) if loss_reason("loss", v) is None else float("nan")  # type: ignore[arg-type]


def _reject_absurd_numbers(results: Sequence[ClientResult], finite: torch.Tensor,
                           reasons: dict[int, str], needs_start: bool) -> None:
    """Reject a client whose sample count, step count or (where the rule needs it)
    start loss no client could report; the others go on."""
    for i, res in enumerate(results):
        if i in reasons:
            continue
        why = (count_reason("num_samples", res.num_samples, low=0.0, strict=True, whole=True)
               or count_reason("steps", res.steps, low=0.0, whole=True)
               or (loss_reason("start_loss", res.start_loss) if needs_start else None))
        if why is not None:
            finite[i] = False
            reasons[i] = why


class RowBuffer:
    """The server's ``[m, d]`` rows, one allocation reused round after round.

    A fresh ``m × d`` matrix a round (``torch.stack`` of the decoded rows) cost a
    copy of every row and, being new memory each time, first-touch page faults on
    all of it (0.4 s a round at 50 clients × 1.6M parameters). The buffer grows
    when a cohort is larger than any before, and is replaced when ``d``, the dtype
    or the device change; :meth:`rows` is its first ``m`` rows. A round's rows are
    valid until the next round's :func:`receive` writes over them: nothing the
    server keeps past a round refers to them (aggregator and feedback states copy).
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def rows(self, m: int, d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        b = self._buf
        if (b is None or b.shape[0] < m or b.shape[1] != d or b.dtype != dtype
                or b.device != torch.device(device)):
            b = self._buf = torch.empty((m, d), dtype=dtype, device=device)
        return b[:m]

    def share(self) -> None:
        """Move the buffer to shared memory (in place, once), so that worker
        processes can write the rows themselves (the ``process`` backend)."""
        if self._buf is not None and self._buf.device.type == "cpu" and not self._buf.is_shared():
            self._buf.share_memory_()


def _decode(feedback: Any, space: ModelSpace, st: RunState, plan: RoundPlan,
            outcome: RoundOutcome, buffer: RowBuffer | None = None
            ) -> tuple[torch.Tensor, dict[int, str]]:
    """The server half of the uplink: each payload decoded here, with the round's
    compressor (never the client's own decode), then the feedback policy's
    ``server_row``. Returns the ``[m, d]`` rows the aggregator would receive (zeros
    for refused clients and for those whose payload does not decode) and why each
    of the latter was rejected. The rows are written into ``buffer``'s (a fresh
    matrix without one); a compressor with ``decode_into``
    (:attr:`~fedloom.capabilities.CompressorCaps.decode_into`) decodes straight into
    its row, which then is the payload's ``sent`` vector too."""
    d, ups = space.layout.size, outcome.ups
    rows = (buffer.rows(len(ups), d, space.dtype, space.device) if buffer is not None
            else torch.empty((len(ups), d), dtype=space.dtype, device=space.device))
    comp = plan.comp
    into = compressor_caps(comp).decode_into
    failed: dict[int, str] = {}
    for i, u in enumerate(ups):
        out = rows[i]
        if i in outcome.refused:
            out.zero_()
            continue
        # decoded into this row as it arrived (EarlyUplink): the same bits, not again
        done = (i in outcome.predecoded and u.sent is not None
                and u.sent.data_ptr() == out.data_ptr() and u.sent.shape == out.shape)
        try:
            if done:
                u.sent = out  # the row itself, as decode_into returns it
            elif into:
                u.sent = comp.decode_into(u.payload, out)
            else:
                u.sent = comp.decode(u.payload, d).to(space.device, space.dtype)
        except (ValueError, ArithmeticError, struct.error) as e:
            failed[i] = f"payload could not be decoded ({first_line(e)})"
            out.zero_()
            continue
        row = feedback.server_row(u, plan.fb_rows[i], st.feedback_state)
        # the event-driven modes' staleness (fedloom.engine.events): FedAsync's
        # w_t − w_τ, then s(τ)
        shift = plan.row_shifts[i] if plan.row_shifts is not None else None
        if shift is not None:
            row = row + shift
        if plan.row_scales is not None:
            row = row * plan.row_scales[i]
        if row is not out:  # the decoded row itself is already in place
            out.copy_(row)
    return rows, failed


def _reject_non_finite(rows: torch.Tensor, finite: torch.Tensor, reasons: dict[int, str],
                       results: Sequence[ClientResult], ups: Sequence[UplinkResult]) -> None:
    """Name the non-finite rows; reject a client whose new state rows (the local
    method's, the feedback policy's, its buffers) are not finite."""
    for i, res in enumerate(results):
        if i in reasons:
            continue
        states = [*res.state.values(), *ups[i].state.values(), *res.buffers.values()]
        if not bool(finite[i]):
            reasons[i] = non_finite_reason(rows[i])
        elif any(not bool(finite_rows(v.reshape(1, -1))[0]) for v in states):
            finite[i] = False
            reasons[i] = "non-finite client state"
