"""The rule that stops a run whose first rounds all skip the step, written once for
the engine's run loop (:mod:`fedloom.engine.runs.loop`) and Flower's strategy
(:class:`fedloom.integrations.flower.FedloomStrategy`, which drives its own rounds).

A skipped round is the guard against one ill-posed cohort (1e30 rows, a singular
system): one or two in a row are what a hostile or unlucky cohort gives, each round
drawing a new one, while a rule that fails on each of ``NEVER_STEPPED_ROUNDS`` fresh
cohorts from the start is broken in a way the checks at the door
(:mod:`fedloom.engine.binding`) cannot see, and the run would return its starting
model as a normal result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fedloom.config import Config, ConfigError

__all__ = ["NEVER_STEPPED_ROUNDS", "stop_if_never_stepped"]

# The first rounds whose steps may all be skipped before the run stops.
NEVER_STEPPED_ROUNDS = 3


def stop_if_never_stepped(history: Sequence[dict[str, Any]], cfg: Config) -> None:
    """A ConfigError, one line naming the aggregator and the first skip's reason,
    once the first ``NEVER_STEPPED_ROUNDS`` rounds (all rounds, if fewer) each skipped
    the step (``history``: the rounds' metrics, ``round`` from 1); a run that stepped
    in any of them goes on."""
    k = min(NEVER_STEPPED_ROUNDS, cfg.rounds)
    if not history or history[-1]["round"] != k:
        return
    first = [m for m in history if m["round"] <= k]
    if len(first) < k or not all(m.get("rejected_rounds") for m in first):
        return
    reason = first[0].get("rejected_round_reason", "no reason recorded")
    raise ConfigError(f"aggregator: {cfg.aggregator.name}: the step was skipped in each of "
                      f"the first {k} round{'s' if k > 1 else ''} (round 1: {reason}); "
                      "stopped rather than return the starting model")
