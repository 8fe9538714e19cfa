"""The selector protocol and what a selector is told after a round.

A selector (``cohort.selection: {name, options}``, registry kind ``selector``)
chooses round ``r``'s cohort from the clients available in it. It sees only what
a server sees:

- at :meth:`Selector.select`: the round, the ids of the available clients (all
  of them without ``system.availability``), the cohort size, its own state and
  the round's generator ``(seed, r, -1, "cohort")``, its only randomness;
- at :meth:`Selector.observe`: a :class:`Feedback`, the round's reports as the
  server received them (the accepted clients' training losses, sample and step
  counts, their round durations under a time model, who did not report).

It never reads a client's data, model or update. Its state is a dict of plain
data (NumPy arrays, numbers, strings, lists): the run keeps it in
``RunState.selection_state`` and in every checkpoint, so a resumed run chooses
the cohorts an uninterrupted one chooses. A selector returns new state and
never changes the state it is given in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

__all__ = ["Feedback", "Selector", "fill_uniform", "no_feedback"]

_NONE = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Feedback:
    """What the server knows after round ``round`` (0-based), for a selector.

    ``clients`` are the accepted clients (reported in time and passed the update
    screening); ``losses``, ``samples``, ``steps`` and ``durations`` are theirs,
    in that order. A rejected client's numbers are not passed on: they may be
    anything (a non-finite loss is a reason for rejection)."""

    round: int
    clients: np.ndarray            # int64 [a]
    losses: np.ndarray             # float64 [a]: the mean training loss each reported
    samples: np.ndarray            # int64 [a]: the sample count n_k each reported
    steps: np.ndarray              # int64 [a]: its local steps this round
    batch_size: int                # client.batch_size (the server sets it)
    # float64 [a]: each one's round time t_k of the time model (system.profile);
    # None when the run is not timed
    durations: np.ndarray | None = None
    dropped: np.ndarray = field(default_factory=lambda: _NONE)   # sampled, no report used
    late: np.ndarray = field(default_factory=lambda: _NONE)      # of those, past the deadline
    rejected: np.ndarray = field(default_factory=lambda: _NONE)  # reported, refused
    deadline_s: float | None = None                     # system.deadline_s


def no_feedback(r: int, batch_size: int = 1) -> Feedback:
    """A round in which no report reached the server."""
    empty = np.zeros(0, dtype=np.int64)
    return Feedback(r, empty, np.zeros(0), empty, empty, batch_size)


class Selector(Protocol):
    """Chooses each round's cohort; see the module docstring for what it sees."""

    def init(self, num_clients: int) -> dict[str, Any]:
        """The state before round 0."""
        ...

    def select(self, r: int, candidates: np.ndarray, size: int, state: dict[str, Any],
               gen: np.random.Generator) -> tuple[np.ndarray, dict[str, Any]]:
        """``min(size, len(candidates))`` distinct ids of ``candidates`` (sorted int64
        ids of the clients available in round ``r``), and the new state."""
        ...

    def observe(self, state: dict[str, Any], feedback: Feedback) -> dict[str, Any]:
        """The state after the server received round ``feedback.round``'s reports."""
        ...


def fill_uniform(chosen: np.ndarray, candidates: np.ndarray, size: int,
                 gen: np.random.Generator) -> np.ndarray:
    """``chosen`` topped up to ``min(size, len(candidates))`` ids with candidates drawn
    uniformly from those not chosen yet."""
    want = min(size, len(candidates)) - len(chosen)
    if want <= 0:
        return chosen
    rest = np.setdiff1d(candidates, chosen)
    more = gen.choice(rest, want, replace=False)
    return np.concatenate([chosen, more.astype(np.int64)])
