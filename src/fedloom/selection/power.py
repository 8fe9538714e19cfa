"""``power_of_choice``: the highest-loss clients of ``d`` random candidates.

Cho, Wang & Joshi, "Towards Understanding Biased Client Selection in Federated
Learning" (AISTATS 2022; arXiv 2010.01243, "Client Selection in Federated
Learning: Convergence Analysis and Power-of-Choice Selection Strategies"): draw a
candidate set ``A`` of ``d ≥ m`` clients without replacement, then take the ``m``
of ``A`` with the highest local loss ``F_k``.

This is their **rpow-d** variant: ``F_k`` is the mean training loss client ``k``
reported the last time it trained (the ``loss`` of its :class:`~fedloom.job.ClientResult`),
which the server already holds: no extra broadcast, forward pass or message. A client
that never reported has loss ``+∞``; ties keep the order of the candidate draw.

Departures: the paper (and FLGo) draw the candidates with probability ``p_k ∝
n_k``; a fedloom server learns ``n_k`` only from a client's report, so the draw
is uniform. ``d`` below ``cohort.size`` is raised to it (the paper needs
``d ≥ m``); ``d = 0`` (the default, as FLGo's ``d = N``) takes every available
client as a candidate.

Checked against FLGo's ``flgo/algorithm/powerofchoice.py`` (github.com/WwZzz/easyFL,
commit 19de9fb): on fixed candidate sets and losses its rule gives the same ids as
this one for ``d = N``, its default (``tests/test_selection.py``); for ``d < N`` FLGo
indexes the available clients with the candidates' positions (the test shows it).
rpow-d against pow-d and FLGo's indexing in full: docs/howto/systems.md
(Power-of-choice in detail).
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np

from fedloom.registry import Range, register
from fedloom.selection.base import Feedback

__all__ = ["PowerOfChoice", "power_of_choice"]


class PowerOfChoice:
    """rpow-d: the ``size`` highest last-reported losses among ``d`` uniform candidates.

    State: ``loss`` (float64 per client, ``+∞`` until it reports)."""

    def __init__(self, d: int = 0) -> None:
        self.d = int(d)

    def init(self, num_clients: int) -> dict[str, Any]:
        return {"loss": np.full(num_clients, np.inf)}

    def candidates(self, available: np.ndarray, size: int,
                   gen: np.random.Generator) -> np.ndarray:
        """The candidate set ``A``, in the order drawn."""
        d = len(available) if self.d == 0 else min(max(self.d, size), len(available))
        return gen.choice(available, d, replace=False).astype(np.int64)

    def select(self, r: int, candidates: np.ndarray, size: int, state: dict[str, Any],
               gen: np.random.Generator) -> tuple[np.ndarray, dict[str, Any]]:
        if len(candidates) <= size:
            return np.sort(candidates).astype(np.int64), state
        cand = self.candidates(candidates, size, gen)
        return top_losses(cand, state["loss"][cand], size), state

    def observe(self, state: dict[str, Any], feedback: Feedback) -> dict[str, Any]:
        if not len(feedback.clients):
            return state
        loss = state["loss"].copy()
        ok = np.isfinite(feedback.losses)
        loss[feedback.clients[ok]] = feedback.losses[ok]
        return {**state, "loss": loss}


def top_losses(cand: np.ndarray, losses: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` candidates of highest loss (ties in the candidates' order), sorted."""
    order = np.argsort(-losses, kind="stable")
    return np.sort(cand[order[:size]]).astype(np.int64)


@register("selector", "power_of_choice")
def power_of_choice(d: Annotated[int, Range(ge=0)] = 0) -> PowerOfChoice:
    """Power-of-choice (rpow-d: the last reported losses; Cho, Wang & Joshi 2022):
    ``d`` candidates (0: every available client), the ``cohort.size`` of highest loss.

    Reference:
        paper: Cho, Wang & Joshi, "Towards Understanding Biased Client Selection in
            Federated Learning", AISTATS 2022 (rpow-d).
        code: WwZzz/easyFL ``flgo/algorithm/powerofchoice.py`` (the same ids on fixed
            inputs, d = N; tests/test_selection.py).
        departures: the last reported training loss (rpow-d), not a fresh
            evaluation of the candidates (pow-d); candidates drawn uniformly, not
            ∝ n_k; a client that never reported ranks first.
    """
    return PowerOfChoice(d)
