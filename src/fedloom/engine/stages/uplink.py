"""Uplink: what each client sends, from its trained update.

In order, for the clients whose training came back: the client-side
postprocessors (:func:`client_postprocessors`: the attack stage, then
local DP's clip and noise; a chain in the way pfl-research chains
postprocessors), the screening of the dense update (non-finite, out of bound:
:func:`fedloom.engine.stages.screen.screen_updates`, so a client never sends what
the server would refuse), then the feedback policy and the compressor. The
server sees ``decode(payload)``, as bytes.
"""

from __future__ import annotations

import logging
import math
import struct
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedloom.capabilities import compressor_caps
from fedloom.compress.feedback import UplinkContext, UplinkResult
from fedloom.compress.identity import Identity, InPlacePayload
from fedloom.device import to_device
from fedloom.engine.algorithm import Algorithm
from fedloom.engine.inputs import Schedule, ScreenRules
from fedloom.engine.runstate import RoundOutcome, RoundPlan, RunState
from fedloom.engine.stages.screen import first_line, non_finite_reason, row_norms, screen_updates
from fedloom.job import ClientResult
from fedloom.rng import Purpose, torch_gen

__all__ = ["AttackStage", "ClientSide", "EarlyUplink", "LocalPrivacyStage", "Postprocessor",
           "Sent", "client_postprocessors", "uplink_round"]

log = logging.getLogger("fedloom")


class Postprocessor(Protocol):
    """A client-side transform of the round's trained updates (the kept clients', in
    cohort order), before they are screened and sent."""

    def __call__(self, results: Sequence[ClientResult], round: int) -> None: ...


class AttackStage:
    """The Byzantine clients of the round send the attack's rows (``attack.*``): it sees
    the round's updates as trained, before anyone's feedback policy and codec
    (:meth:`fedloom.attack.Attack.round`)."""

    def __init__(self, attack: Any) -> None:
        self.attack = attack

    def __call__(self, results: Sequence[ClientResult], round: int) -> None:
        self.attack.round(results, round)


class LocalPrivacyStage:
    """``privacy.mode=local``: each client clips and adds its noise first, so
    everything it sends, and whether it sends, depends on its data only through
    the noisy update (a non-finite update is sent as zero plus noise, not
    withheld). Counts the updates it clipped."""

    def __init__(self, privacy: Any) -> None:
        self.privacy = privacy
        self.clipped = 0

    def __call__(self, results: Sequence[ClientResult], round: int) -> None:
        for res in results:
            u = res.update
            if not bool(torch.isfinite(u).all()):
                u = torch.zeros_like(u)
            res.update, was = self.privacy.privatize(u, round, res.client)
            self.clipped += int(was)


def client_postprocessors(attack: Any, privacy: Any) -> list[Postprocessor]:
    """The run's client-side chain, in the order it applies: the Byzantine
    clients' transform (``None``: none), then local differential privacy."""
    chain: list[Postprocessor] = []
    if attack is not None:
        chain.append(AttackStage(attack))
    if privacy.local:
        chain.append(LocalPrivacyStage(privacy))
    return chain


@dataclass
class Sent:
    """What a worker did of its client's uplink (:class:`ClientSide`): the update's
    norm (a float, as :func:`~fedloom.engine.stages.screen.row_norms` gives it) and its
    payload (``None``: not encoded there — a non-finite update, an encode that
    failed, or a float32 identity vector, which the server reads in place where the
    worker wrote it into the server's row and encodes itself otherwise)."""

    norm: float
    payload: bytes | None = None


@dataclass(frozen=True)
class ClientSide:
    """The client's own part of the uplink, done by a ``process`` worker or a Ray
    task right after training, where the update is (and is still in the cache): the norm the
    screening reads and, with a pure compressor
    (:attr:`~fedloom.capabilities.CompressorCaps.pure`), the encode, with the
    client's own generator ``(seed, round, client, compress)`` — the bytes the
    parent would have made. The parent then only decodes. An update that is not
    finite is not encoded (the server refuses it, naming why)."""

    comp: Any
    seed: int
    round: int

    def __call__(self, update: torch.Tensor, client: int) -> Sent:
        # a float, not a tensor: a tensor in a message is shared through a file
        # descriptor of its own (a socket connect a client, 0.4 ms)
        norm = float(row_norms([update])[0])
        if not math.isfinite(norm):
            return Sent(norm)
        if (type(self.comp) is Identity and update.dtype == torch.float32
                and sys.byteorder == "little"):
            return Sent(norm)  # read in place by the server (InPlacePayload)
        try:
            payload = self.comp.encode(update, gen=torch_gen(self.seed, self.round, client,
                                                             Purpose.COMPRESS))
        except (ValueError, ArithmeticError, struct.error):
            return Sent(norm)  # encoded again by the parent, which refuses the client
        return Sent(norm, payload)


class EarlyUplink:
    """Each client's own part of the uplink, done as its result arrives from a
    worker while the others still train (the ``process`` backend streams them):
    the dense update's norm, the encode and the server's decode into its row of
    ``rows``. :func:`uplink_round` and :func:`~fedloom.engine.stages.receive.receive`
    then use what was done instead of doing it again; everything that reads the
    cohort (the screening by the norms' median, which clients are refused) still
    happens there, in the same order. Only where none of this depends on the
    cohort or on the order of the clients (:meth:`applies`): no client-side
    postprocessor, the plain feedback policy (encode, keep nothing) and a pure
    compressor (:attr:`~fedloom.capabilities.CompressorCaps.pure`), on the host.
    The workers take the norm and encode where the update was made
    (:attr:`client_side`); a float32 identity update is read in place. A result
    passed again (its worker died and the group ran again) is redone."""

    def __init__(self, algo: Algorithm, schedule: Schedule, st: RunState, plan: RoundPlan,
                 rows: torch.Tensor) -> None:
        self.algo, self.schedule, self.st, self.plan, self.rows = algo, schedule, st, plan, rows
        self.m = len(plan.jobs)
        self.norms: dict[int, torch.Tensor] = {}
        self.ups: dict[int, UplinkResult] = {}
        self.decoded: set[int] = set()
        self.inplace: set[int] = set()  # rows that are the client's update itself

    @staticmethod
    def applies(algo: Algorithm, post: Sequence[Postprocessor], device: torch.device,
                plan: RoundPlan) -> bool:
        from fedloom.compress.feedback.base import NoFeedback

        # the exact type: a subclass may keep state
        return (not post and device.type == "cpu" and compressor_caps(plan.comp).pure
                and type(algo.feedback) is NoFeedback
                and plan.row_shifts is None and plan.row_scales is None)

    @property
    def client_side(self) -> ClientSide:
        """What a worker may do of each client's uplink (the process backend)."""
        return ClientSide(self.plan.comp, self.schedule.seed, self.plan.round)

    def __call__(self, i: int, res: ClientResult, sent: Sent | None = None) -> None:
        self.ups.pop(i, None)
        self.decoded.discard(i)
        self.inplace.discard(i)
        norm = self.norms[i] = (torch.tensor([sent.norm], dtype=torch.float64)
                                if sent is not None else row_norms([res.update]))
        if not bool(torch.isfinite(norm).all()):
            return  # refused by the screening; uplink_round names why
        row = self.rows[i]
        if (type(self.plan.comp) is Identity and res.update.data_ptr() == row.data_ptr()
                and row.dtype == torch.float32
                and res.update.shape == row.shape and sys.byteorder == "little"):
            # The worker wrote the update into this very row (shared memory): the
            # identity payload's body is these float32 bytes, and the server's decode of
            # it is the row as it is. Nothing is copied or serialised; the payload's
            # length is what is counted (InPlacePayload).
            self.ups[i] = UplinkResult(InPlacePayload(row, self.plan.comp.checksum), row, {})
            self.decoded.add(i)
            self.inplace.add(i)
            return
        try:
            up = (UplinkResult(sent.payload, None, {}) if sent is not None
                  and sent.payload is not None  # NoFeedback's result of that payload
                  else _uplink(self.algo, self.schedule, self.st, self.plan, res, i, self.m))
        except (ValueError, ArithmeticError, struct.error):
            return  # uplink_round encodes it again and refuses the client there
        self.ups[i] = up
        comp = self.plan.comp
        try:
            # into the server's row, as receive would (decode_into, or decode then copy)
            up.sent = (comp.decode_into(up.payload, row) if compressor_caps(comp).decode_into
                       else row.copy_(comp.decode(up.payload, row.shape[0])))
        except (ValueError, ArithmeticError, struct.error):
            up.sent = None  # receive decodes it again and rejects the client there
            return
        self.decoded.add(i)

    def complete(self, results: Sequence[ClientResult]) -> bool:
        """Whether every kept client's result came through here: no client was
        dropped (the positions and ``m`` are the round's) and none is missing."""
        return len(results) == self.m and len(self.norms) == self.m


def uplink_round(algo: Algorithm, post: Sequence[Postprocessor], rules: ScreenRules,
                 schedule: Schedule, device: torch.device, st: RunState, plan: RoundPlan,
                 raw: Sequence[ClientResult | None], early: EarlyUplink | None = None,
                 withheld: Collection[int] = ()) -> tuple[RoundPlan, RoundOutcome]:
    """Drop the clients whose training failed (``None``), run the client-side
    chain, screen the kept clients' dense updates, then run each accepted
    client's feedback policy and compressor: what it sends and its new state. A
    client refused here, or whose encode or decode fails, gets an empty
    placeholder result and is named in the outcome's ``refused`` (rejected and
    counted by the server's half of the round; the run goes on). ``early``: what
    was done for each client as its result arrived (:class:`EarlyUplink`), used
    where it covers the whole round; ``withheld``: the clients the system model
    kept out (dropped, not failed). Returns the kept clients' plan and what came
    of them."""
    r = plan.round
    # A client whose worker died (backend.options.on_failure=drop) is dropped for the
    # round: nothing of it is aggregated and its state rows stay as they were.
    plan, dropped = plan.keep([i for i, res in enumerate(raw) if res is not None])
    # Results of workers elsewhere (process, ray: host tensors) onto the run's device
    # (on a CPU run they are there already: no walk through every result).
    raw = list(raw) if device.type == "cpu" else to_device(list(raw), device)
    failed = [k for k in dropped if k not in withheld]
    if failed:
        log.warning("round %d: dropped clients %s (their worker failed)", r + 1, failed)
    results = [res for res in raw if res is not None]
    dp_clipped = None
    for stage in post:
        stage(results, r)
        if isinstance(stage, LocalPrivacyStage):
            dp_clipped = stage.clipped
    if early is not None and (not results or not early.complete(results)):
        early = None
    refused = _screen_dense(rules, results, early)
    ups = [_send(algo, schedule, st, plan, res, i, len(results), refused, early)
           for i, res in enumerate(results)]
    predecoded: frozenset[int] = frozenset()
    prenorms = None
    if early is not None:
        # rows a refused client's decode wrote are zeroed by receive, as any refused row
        predecoded = frozenset(i for i in early.decoded if i not in refused)
        if all(i in early.inplace or i in refused for i in range(len(results))):
            # Every accepted row is its client's dense update, bit for bit (the
            # identity, read in place): its norm is the one taken where the update was
            # made, the same function of the same bits, so receive's size rules need
            # no second pass over the [m, d] rows. A refused row's entry is never read
            # (receive marks it not finite by its reason).
            prenorms = torch.cat([early.norms[i] for i in range(len(results))])
    return plan, RoundOutcome(results, ups, dropped, refused, dp_clipped, predecoded,
                              prenorms)


def _screen_dense(rules: ScreenRules, results: Sequence[ClientResult],
                  early: EarlyUplink | None = None) -> dict[int, str]:
    """Client side, before encoding: the rules the server applies to what it
    receives, on the dense update (a huge value in a coordinate that a sparsifier
    leaves out is seen here, and nothing non-finite is encoded). One pass a
    client: its norm, which is finite exactly when the update is (and its float64
    norm does not overflow: an absurd update all the same)."""
    refused: dict[int, str] = {}
    if not results:  # an empty cohort (Poisson sampling) or every client dropped
        return refused
    # a norm taken as the result arrived is the same number: row_norms takes each
    # vector's on its own
    norms = (torch.cat([early.norms[i] for i in range(len(results))]) if early is not None
             else row_norms([res.update for res in results]))
    finite = torch.isfinite(norms)
    for i in (~finite).nonzero().flatten().tolist():
        refused[i] = non_finite_reason(results[i].update)
    ratio = rules.ratio
    if rules.max_update_norm is not None or ratio is not None:
        refused.update(screen_updates(norms, finite, max_norm=rules.max_update_norm,
                                      max_ratio=ratio))
    return refused


def _uplink(algo: Algorithm, schedule: Schedule, st: RunState, plan: RoundPlan,
            res: ClientResult, i: int, m: int) -> UplinkResult:
    """Client ``i``'s (of ``m`` reporting) feedback policy and compressor."""
    r = plan.round
    ctx = UplinkContext(r, plan.lr, res.steps, plan.alphas[i],
                        torch_gen(schedule.seed, r, res.client, Purpose.COMPRESS),
                        algo.momentum, m, schedule.num_clients)
    return algo.feedback.uplink(res.update, plan.fb_rows[i], plan.comp, ctx, st.feedback_state)


def _send(algo: Algorithm, schedule: Schedule, st: RunState, plan: RoundPlan,
          res: ClientResult, i: int, m: int, refused: dict[int, str],
          early: EarlyUplink | None = None) -> UplinkResult:
    """Client ``i``'s (of ``m`` reporting) feedback policy and compressor (nothing
    for a refused one; ``early``'s result where it has one)."""
    up = None
    if i not in refused:
        try:
            up = early.ups.get(i) if early is not None else None
            if up is None:
                up = _uplink(algo, schedule, st, plan, res, i, m)
        except (ValueError, ArithmeticError, struct.error) as e:
            # PayloadError is a ValueError; a float32 header field that
            # overflows is an OverflowError or struct.error. One client's
            # payload that cannot be made or read is that client's fault.
            refused[i] = f"update could not be encoded or decoded ({first_line(e)})"
    if up is None:  # nothing was sent: no bytes, no state
        up = UplinkResult(b"", res.update.new_empty(0), {}, float("nan"))
    # The dense update is not needed past its uplink: free it now, so a
    # round holds one m × d copy less at its peak.
    res.update = res.update.new_empty(0)
    return up
