"""The running experiment: the built components and the round's stages as methods.

:class:`Experiment` is :class:`~fedloom.engine.setup.Setup` (every component
of the run) with the stages of a round as methods, for the callers that drive
a round whole (:func:`fedloom.engine.loop.run`) or in parts (Flower's
strategy: plan, then what the clients sent, then the server's half).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fedloom.compress.feedback import UplinkResult
from fedloom.engine.dispatch import plan_round
from fedloom.engine.evaluation import evaluate_global
from fedloom.engine.round import finish_round, run_round
from fedloom.engine.runstate import RoundPlan, RunState
from fedloom.engine.setup import Setup
from fedloom.engine.uplink import uplink_round
from fedloom.job import ClientResult

__all__ = ["Experiment"]


class Experiment(Setup):
    """A config turned into typed objects, and its rounds.

    Building it validates everything that needs the data or the model (e.g. an
    aggregator option), so a bad run fails before any file is written.
    """

    def round(self, st: RunState) -> tuple[RunState, dict[str, Any]]:
        """Run round ``st.next_round``; return the new state and its metrics."""
        return run_round(self, st)

    def plan_round(self, st: RunState) -> RoundPlan:
        """The round's cohort and fully specified client jobs
        (:func:`~fedloom.engine.dispatch.plan_round`)."""
        return plan_round(self, st)

    def uplink_round(self, st: RunState, plan: RoundPlan,
                     raw: Sequence[ClientResult | None]
                     ) -> tuple[list[ClientResult], list[UplinkResult]]:
        """What the kept clients send (:func:`~fedloom.engine.uplink.uplink_round`)."""
        return uplink_round(self, st, plan, raw)

    def finish_round(self, st: RunState, plan: RoundPlan, results: Sequence[ClientResult],
                     ups: Sequence[UplinkResult], *, t0: float, t_train: float,
                     client_state: bool = True, client_buffers: bool = False
                     ) -> tuple[RunState, dict[str, Any]]:
        """The server's half of a round (:func:`~fedloom.engine.round.finish_round`)."""
        return finish_round(self, st, plan, results, ups, t0=t0, t_train=t_train,
                            client_state=client_state, client_buffers=client_buffers)

    def evaluate(self, w: torch.Tensor) -> dict[str, float]:
        """Global test accuracy/loss and per-client accuracy statistics of ``w``
        (:func:`~fedloom.engine.evaluation.evaluate_global`)."""
        return evaluate_global(self, w)

    def _ffl(self, w: torch.Tensor, st: RunState) -> tuple[Any, int | None, dict[str, Any]]:
        """The round planner's answer as ``(compressor, epochs, state and metrics)``:
        the form the adaptive schedule had when the engine computed it (kept for
        callers of that private entry point)."""
        adj = self.planner.plan(st.next_round, w, st.feedback_state, self)
        return adj.compressor, adj.epochs, {**adj.state, **adj.metrics}
