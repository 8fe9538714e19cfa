"""Uplink: what each client sends, from its trained update.

In order, for the clients whose training came back: the client-side
postprocessors (:func:`client_postprocessors`: an attacker's transform, then
local DP's clip and noise; a chain in the way pfl-research chains
postprocessors), the screening of the dense update (non-finite, out of bound:
:func:`fedloom.engine.screen.screen_updates`, so a client never sends what
the server would refuse), then the feedback policy and the compressor. The
server sees ``decode(payload)``, as bytes.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from fedloom.compress.feedback import UplinkContext, UplinkResult
from fedloom.device import to_device
from fedloom.engine.algorithm import Algorithm
from fedloom.engine.parts import Schedule, ScreenRules
from fedloom.engine.runstate import RoundPlan, RunState
from fedloom.engine.screen import first_line, non_finite_reason, row_norms, screen_updates
from fedloom.job import ClientResult
from fedloom.rng import Purpose, torch_gen

__all__ = ["AttackStage", "LocalPrivacyStage", "Postprocessor", "client_postprocessors",
           "uplink_round"]

log = logging.getLogger("fedloom")


class Postprocessor(Protocol):
    """A client-side transform of the trained update, before it is screened and sent."""

    def __call__(self, res: ClientResult, round: int) -> None: ...


class AttackStage:
    """A Byzantine client sends its transform of the update (``attack.*``)."""

    def __init__(self, attack: Any) -> None:
        self.attack = attack

    def __call__(self, res: ClientResult, round: int) -> None:
        res.update = self.attack(res.update, res.client, round)


class LocalPrivacyStage:
    """``privacy.mode=local``: each client clips and adds its noise first, so
    everything it sends, and whether it sends, depends on its data only through
    the noisy update (a non-finite update is sent as zero plus noise, not
    withheld). Counts the updates it clipped."""

    def __init__(self, privacy: Any) -> None:
        self.privacy = privacy
        self.clipped = 0

    def __call__(self, res: ClientResult, round: int) -> None:
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


def uplink_round(algo: Algorithm, post: Sequence[Postprocessor], rules: ScreenRules,
                 schedule: Schedule, device: torch.device, st: RunState, plan: RoundPlan,
                 raw: Sequence[ClientResult | None]
                 ) -> tuple[list[ClientResult], list[UplinkResult]]:
    """Drop the clients whose training failed (``None``), run the client-side
    chain, screen the kept clients' dense updates, then run each accepted
    client's feedback policy and compressor: what it sends and its new state. A
    client refused here, or whose encode or decode fails, gets an empty
    placeholder result and is named in ``plan.refused`` (rejected and counted
    by the server's half of the round; the run goes on)."""
    r = plan.round
    # A client whose worker died (backend.on_failure=drop) is dropped for the
    # round: nothing of it is aggregated and its state rows stay as they were.
    plan.keep([i for i, res in enumerate(raw) if res is not None])
    # Results of workers elsewhere (process, ray: host tensors) onto the run's device
    # (on a CPU run they are there already: no walk through every result).
    raw = list(raw) if device.type == "cpu" else to_device(list(raw), device)
    failed = [k for k in plan.dropped if k not in plan.withheld]
    if failed:
        log.warning("round %d: dropped clients %s (their worker failed)", r + 1, failed)
    results = [res for res in raw if res is not None]
    for stage in post:
        for res in results:
            stage(res, r)
        if isinstance(stage, LocalPrivacyStage):
            plan.dp_clipped = stage.clipped
    refused = _screen_dense(rules, results)
    ups = [_send(algo, schedule, st, plan, res, i, len(results), refused)
           for i, res in enumerate(results)]
    plan.refused = refused
    return results, ups


def _screen_dense(rules: ScreenRules, results: Sequence[ClientResult]) -> dict[int, str]:
    """Client side, before encoding: the rules the server applies to what it
    receives, on the dense update (a huge value in a coordinate that a sparsifier
    leaves out is seen here, and nothing non-finite is encoded). One pass a
    client: its norm, which is finite exactly when the update is (and its float64
    norm does not overflow: an absurd update all the same)."""
    refused: dict[int, str] = {}
    norms = row_norms([res.update for res in results])
    finite = torch.isfinite(norms)
    for i in (~finite).nonzero().flatten().tolist():
        refused[i] = non_finite_reason(results[i].update)
    ratio = rules.ratio
    if rules.max_update_norm is not None or ratio is not None:
        refused.update(screen_updates(norms, finite, max_norm=rules.max_update_norm,
                                      max_ratio=ratio))
    return refused


def _send(algo: Algorithm, schedule: Schedule, st: RunState, plan: RoundPlan,
          res: ClientResult, i: int, m: int, refused: dict[int, str]) -> UplinkResult:
    """Client ``i``'s (of ``m`` reporting) feedback policy and compressor (nothing
    for a refused one)."""
    r = plan.round
    up = None
    if i not in refused:
        ctx = UplinkContext(r, plan.lr, res.steps, plan.alphas[i],
                            torch_gen(schedule.seed, r, res.client, Purpose.COMPRESS),
                            algo.momentum, m, schedule.num_clients)
        try:
            up = algo.feedback.uplink(res.update, plan.fb_rows[i], plan.comp, ctx,
                                     st.feedback_state)
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
