"""Server: the aggregate, the server optimizer's step, the guards, the feedback end.

The rule that turns accepted rows into a direction is the configured
aggregator (:class:`AggregatorRule`) or, with ``privacy.mode=central``,
DP-FedAvg's clipped, noised sum with a fixed denominator in its place
(:class:`CentralPrivacyRule`; :mod:`fedloom.privacy` refuses the aggregators
it cannot stand for), chosen once by :func:`server_rule` the way Flower wraps
a strategy: the round calls the rule and knows neither.

Guards: a rule that raises on an ill-posed cohort, a direction that is not a
finite vector of the model's size, a step, feedback shift or new server state
that is not finite — the round's step is skipped (``bad_round`` names why)
and every server state stays as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedloom.aggregate.base import CohortInfo
from fedloom.compress.feedback import UplinkResult
from fedloom.engine.algorithm import Algorithm
from fedloom.engine.inputs import ModelSpace
from fedloom.engine.runstate import RoundPlan, RunState
from fedloom.engine.stages.receive import Received
from fedloom.engine.stages.screen import all_finite, first_line
from fedloom.job import ClientResult
from fedloom.metrics import conflict_rate

__all__ = ["AggregatorRule", "CentralPrivacyRule", "ServerOutcome", "ServerRule",
           "server_round", "server_rule"]

log = logging.getLogger("fedloom")


class ServerRule(Protocol):
    """Rows → ``(direction, new aggregator state, new privacy state, metrics)``."""

    releases_empty: bool  # called even when no row was accepted

    def __call__(self, rows: torch.Tensor, ok: torch.Tensor, weights: torch.Tensor,
                 info: CohortInfo, st: RunState
                 ) -> tuple[torch.Tensor, Any, dict[str, Any], dict[str, Any]]: ...


class AggregatorRule:
    """The configured aggregator on the accepted rows and their weights."""

    releases_empty = False

    def __init__(self, aggregator: Any) -> None:
        self.aggregator = aggregator

    def __call__(self, rows: torch.Tensor, ok: torch.Tensor, weights: torch.Tensor,
                 info: CohortInfo, st: RunState
                 ) -> tuple[torch.Tensor, Any, dict[str, Any], dict[str, Any]]:
        # boolean indexing copies m × d: only when some row was rejected
        sel = ok if not bool(ok.all()) else slice(None)
        agg, agg_state, metrics = self.aggregator(rows[sel], weights[sel], st.agg_state,
                                                  info=info)
        return agg, agg_state, st.privacy_state, metrics


class CentralPrivacyRule:
    """DP-FedAvg: clip, sum, noise, fixed denominator; it releases its noised sum
    even when no update was accepted."""

    releases_empty = True

    def __init__(self, privacy: Any) -> None:
        self.privacy = privacy

    def __call__(self, rows: torch.Tensor, ok: torch.Tensor, weights: torch.Tensor,
                 info: CohortInfo, st: RunState
                 ) -> tuple[torch.Tensor, Any, dict[str, Any], dict[str, Any]]:
        agg, privacy_state, metrics = self.privacy.aggregate(rows, ok, st.privacy_state,
                                                             info.round)
        return agg, st.agg_state, privacy_state, metrics


def server_rule(privacy: Any, aggregator: Any) -> ServerRule:
    """The run's rule: central DP in the aggregator's place, or the aggregator."""
    return CentralPrivacyRule(privacy) if privacy.central else AggregatorRule(aggregator)


@dataclass
class ServerOutcome:
    """The server's half of a round: the new server states (the old ones when the
    step was skipped) and what the round measured."""

    w: torch.Tensor
    opt_state: Any
    agg_state: Any
    feedback_state: dict[str, Any]
    privacy_state: dict[str, Any]
    metrics: dict[str, Any]
    conflicts: float
    bad_round: str | None
    downlink_bytes: int  # what the feedback policy's end of round broadcasts


def server_round(algo: Algorithm, rule: ServerRule, space: ModelSpace, num_clients: int,
                 st: RunState, plan: RoundPlan, results: Sequence[ClientResult],
                 ups: Sequence[UplinkResult], rx: Received,
                 reference: torch.Tensor | None = None) -> ServerOutcome:
    """Aggregate with ``rule`` (:func:`server_rule`), step and check; the feedback
    policy's end of round. ``reference``: the server's own update where the rule
    asks for one (:mod:`fedloom.engine.stages.reference`)."""
    out = ServerOutcome(st.w, st.opt_state, st.agg_state, st.feedback_state,
                        st.privacy_state, {}, 0.0, None, 0)
    if bool(rx.ok.any()) or rule.releases_empty:
        info = _cohort_info(algo, space.device, num_clients, plan, results, rx, st, reference)
        _aggregate_and_step(algo, space, info, st, results, ups, rx, rule, out)
    else:
        # No update accepted: no step; the policy's end of round sees nobody
        # (its server state stays, e.g. SCAFCOM's c).
        end = algo.feedback.end_round([], st.feedback_state, num_clients, [])
        out.feedback_state = end.server
        out.downlink_bytes += end.downlink_bytes
    if out.bad_round is not None:
        log.warning("round %d: step skipped, model and state unchanged: %s", plan.round + 1,
                    out.bad_round)
        out.conflicts = float("nan")
    if plan.adjust.state:  # the planner's server state rides with the uplink's
        out.feedback_state = {**out.feedback_state, **plan.adjust.state}
    return out


def _cohort_info(algo: Algorithm, device: torch.device, num_clients: int, plan: RoundPlan,
                 results: Sequence[ClientResult], rx: Received, st: RunState,
                 reference: torch.Tensor | None = None) -> CohortInfo:
    """What some rules need of the accepted clients (losses, steps, start losses)."""
    ok = rx.ok if not bool(rx.ok.all()) else slice(None)
    # The screened numbers of receive (a rejected client's may not fit a tensor).
    start = None
    if "start_losses" in algo.requires:
        start = (rx.start_losses if rx.start_losses is not None else torch.tensor(
            [res.start_loss for res in results], dtype=torch.float64))[ok]
    steps = rx.steps if rx.steps is not None else torch.tensor([res.steps for res in results])
    # Client ids on the host (they index host-side state); the per-client
    # numbers on the device, where the rules combine them with the rows.
    dev = device
    return CohortInfo(
        clients=plan.cohort[ok], round=plan.round, num_clients=num_clients,
        losses=rx.losses[ok].to(dev),
        steps=steps[ok].to(dev), lr=plan.lr,
        momentum=algo.momentum,
        start_losses=start.to(dev) if start is not None else None,
        w=st.w if "w" in algo.requires else None,
        reference=reference.to(dev) if reference is not None else None,
    )


def _aggregate_and_step(algo: Algorithm, space: ModelSpace, info: CohortInfo, st: RunState,
                        results: Sequence[ClientResult], ups: Sequence[UplinkResult],
                        rx: Received, rule: ServerRule, out: ServerOutcome) -> None:
    agg: torch.Tensor | None = None
    try:
        agg, cand_agg, cand_privacy, out.metrics = rule(rx.rows, rx.ok, rx.weights, info, st)
    except (NotImplementedError, RecursionError):
        raise  # a missing feature or a bug, not a bad cohort
    except (RuntimeError, ValueError, ArithmeticError) as e:
        # torch.linalg's LinAlgError is a RuntimeError: an ill-posed
        # cohort (1e30 rows, a singular system) must not end the run.
        out.bad_round = f"the aggregator failed ({first_line(e)})"
    if agg is None:
        return
    d = space.layout.size
    if not isinstance(agg, torch.Tensor) or tuple(agg.shape) != (d,):
        shape = tuple(agg.shape) if isinstance(agg, torch.Tensor) else type(agg)
        out.bad_round = f"the aggregate has shape {shape}, expected ({d},)"
        return
    if not all_finite(agg):
        out.bad_round = "the aggregate is not finite"
        return
    cand_w, cand_opt = algo.server.step(st.w, agg, st.opt_state)
    # The feedback policy's end of round only for a step that is applied: it may
    # change the accepted clients' state (CSER).
    ok_list = rx.ok.tolist()
    accepted = [u for u, ok in zip(ups, ok_list, strict=True) if ok]
    probes = [res.extra["smoothness"] for res, ok_k in zip(results, ok_list, strict=True)
              if ok_k and "smoothness" in res.extra]
    end = algo.feedback.end_round(accepted, st.feedback_state, info.num_clients, probes)
    if end.w_shift is not None:
        cand_w = cand_w - end.w_shift.to(cand_w.dtype)
    if not (all_finite(cand_w) and all_finite(cand_opt)):
        out.bad_round = "the server optimizer's step is not finite"
    elif not (all_finite(cand_agg) and all_finite(end.server)):
        out.bad_round = "the new aggregator or feedback state is not finite"
    else:
        ok = rx.ok if not bool(rx.ok.all()) else slice(None)
        out.conflicts = conflict_rate(rx.rows[ok], agg)
        out.w, out.opt_state, out.agg_state = cand_w, cand_opt, cand_agg
        out.privacy_state = cand_privacy
        out.feedback_state = end.server
        out.downlink_bytes += end.downlink_bytes
