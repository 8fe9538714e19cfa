"""Record: a round's totals and its line of metrics, the privacy accounting, and what
the client selector is told of the round.

The keys, in the order ``metrics.jsonl`` has them: the round's counts and
bytes with the run's totals, the planner's and the rule's metrics, the
feedback policy's, each client metric hook's summary, who was rejected or
dropped and why, the clients' own extras (means over the accepted), then
evaluation on schedule, timings and privacy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedloom.engine.runstate import RoundOutcome, RoundPlan
from fedloom.engine.stages.receive import Received
from fedloom.engine.stages.server import ServerOutcome
from fedloom.selection import Feedback

__all__ = ["account_privacy", "add_totals", "round_metrics", "selection_feedback"]


def add_totals(totals: dict[str, int], rx: Received, out: ServerOutcome) -> dict[str, int]:
    """The run's totals after this round."""
    new = dict(totals)
    new["uplink_bytes"] += rx.up_bytes
    new["downlink_bytes"] += rx.down_bytes + out.downlink_bytes
    new["rejected_updates"] += len(rx.rejected)
    # .get: checkpoints written before these counts existed resume too
    new["rejected_rounds"] = new.get("rejected_rounds", 0) + int(out.bad_round is not None)
    new["clipped_updates"] = new.get("clipped_updates", 0) + rx.clipped
    return new


def _train_loss(rx: Received) -> float:
    """The accepted clients' training loss, weighted by their sample counts."""
    keep = rx.ok & torch.isfinite(rx.losses)
    ok_loss = rx.losses[keep]
    ok_w = rx.weights[keep].double().cpu()  # with the host losses
    return float((ok_loss * ok_w).sum() / ok_w.sum()) if ok_w.numel() else float("nan")


def round_metrics(feedback: Any, hooks: Sequence[Any], has_residuals: bool, plan: RoundPlan,
                  outcome: RoundOutcome, rx: Received, out: ServerOutcome,
                  totals: dict[str, int]) -> dict[str, Any]:
    """The round's line of metrics, before evaluation and timings (``hooks``: the
    client-metric plug-ins; ``has_residuals``: the feedback policy keeps client rows)."""
    bad, results, ups = out.bad_round, outcome.results, outcome.ups
    metrics: dict[str, Any] = {
        "round": plan.round + 1,
        "lr": plan.lr,
        "cohort_size": len(plan.jobs),
        "train_loss": _train_loss(rx),
        "uplink_bytes": rx.up_bytes,
        "downlink_bytes": rx.down_bytes + out.downlink_bytes,
        "uplink_bytes_total": totals["uplink_bytes"],
        "downlink_bytes_total": totals["downlink_bytes"],
        "rejected_updates": len(rx.rejected),
        "rejected_updates_total": totals["rejected_updates"],
        "rejected_rounds": int(bad is not None),
        "rejected_rounds_total": totals["rejected_rounds"],
        "clipped_updates": rx.clipped,
        "clipped_updates_total": totals["clipped_updates"],
        "dropped_clients": len(outcome.dropped),
        "conflict_rate": out.conflicts,
        "density": rx.density,
        **plan.adjust.metrics,
        **{k: float(v) for k, v in out.metrics.items()},
    }
    ok_list = rx.ok.tolist()
    if has_residuals:  # the feedback policy keeps rows per client
        norms = [u.residual_norm for u, ok in zip(ups, ok_list, strict=True) if ok]
        metrics["residual_norm"] = float(np.mean(norms)) if norms else float("nan")
        metrics["alpha"] = float(np.mean(plan.alphas))
        metrics.update(feedback.round_metrics(out.feedback_state))
    for hook, got in zip(hooks, plan.measured, strict=True):
        if got:
            metrics.update(hook.summarize(got))
    if rx.rejected:
        metrics["rejected_clients"] = rx.rejected
        metrics["rejected_reasons"] = [rx.reasons[i] for i in sorted(rx.reasons)]
    if bad is not None:
        metrics["rejected_round_reason"] = bad
    if outcome.dropped:
        metrics["dropped_client_ids"] = outcome.dropped
    extras = [res.extra for res, ok in zip(results, ok_list, strict=True) if ok]
    for key in sorted({k for e in extras for k in e}):
        metrics[key] = float(np.mean([e[key] for e in extras if key in e]))
    return metrics


def account_privacy(privacy: Any, plan: RoundPlan, outcome: RoundOutcome,
                    privacy_state: dict[str, Any], metrics: dict[str, Any], *,
                    evaluated: bool = True) -> dict[str, Any]:
    """Who sent a message (local DP: a rejected round's were sent too) and the ε
    spent so far, where the round is ``evaluated`` (on schedule, or the last): a PLD
    over T rounds costs seconds (0.2–1.8 s sampled at T = 2,000, more for a client's
    local noise over many rounds), and ε at a round is the same whenever computed."""
    p = privacy
    if p.local:
        sent = [i for i in range(len(outcome.results)) if i not in outcome.refused]
        privacy_state = p.participated(privacy_state, plan.cohort[sent])
        if outcome.dp_clipped is not None:
            metrics["dp_clipped"] = outcome.dp_clipped
    if p.enabled and evaluated:
        metrics["dp_epsilon"] = p.epsilon(privacy_state, plan.round + 1)
    return privacy_state


def selection_feedback(plan: RoundPlan, outcome: RoundOutcome, rx: Received,
                       batch_size: int, *, times: Mapping[int, float] | None = None,
                       late: Sequence[int] = (), deadline_s: float | None = None) -> Feedback:
    """What the server received this round, for the client selector
    (:class:`~fedloom.selection.Feedback`): the accepted clients' reported losses,
    sample and step counts and (``times``: the system model's ``t_k``, when it times
    the clients) durations; who did not report, who was late, who was rejected."""
    acc, results = [i for i, ok in enumerate(rx.ok.tolist()) if ok], outcome.results
    clients = np.asarray([int(plan.cohort[i]) for i in acc], dtype=np.int64)
    steps = ([int(rx.steps[i]) for i in acc] if rx.steps is not None
             else [int(results[i].steps) for i in acc])
    return Feedback(
        round=plan.round, clients=clients,
        losses=np.asarray([float(rx.losses[i]) for i in acc], dtype=np.float64),
        samples=np.asarray([int(results[i].num_samples) for i in acc], dtype=np.int64),
        steps=np.asarray(steps, dtype=np.int64), batch_size=int(batch_size),
        durations=(np.asarray([float(times[int(k)]) for k in clients], dtype=np.float64)
                   if times is not None else None),
        dropped=np.asarray(outcome.dropped, dtype=np.int64),
        late=np.asarray(list(late), dtype=np.int64),
        rejected=np.asarray(rx.rejected, dtype=np.int64), deadline_s=deadline_s)
