"""``uniform``: ``cohort.size`` distinct clients, uniformly, from the available ones.

The cohort is ``gen.choice(candidates, size, replace=False)`` (sorted) from the
round's generator ``(seed, r, -1, "cohort")``, or every available client when no
more than ``size`` are: the draw fedloom has always made (``tests/test_selection.py``
holds it to the earlier code's cohorts). It keeps no state and learns nothing from
the rounds, so it is the sampling the privacy accountant assumes.

:func:`poisson_cohort` (``cohort.sampling: poisson``): each client independently with
probability ``q``, one uniform draw per client of the population from the same
generator, so a client's inclusion does not depend on who else is available
(Poisson subsampling, as DP-FedAvg's accounting assumes: McMahan et al., ICLR 2018).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedloom.capabilities import SelectorCaps
from fedloom.registry import register
from fedloom.selection.base import Feedback

__all__ = ["Uniform", "poisson_cohort", "uniform"]


class Uniform:
    """Uniform sampling without replacement (no state)."""

    capabilities = SelectorCaps(uniform=True)

    def init(self, num_clients: int) -> dict[str, Any]:
        return {}

    def select(self, r: int, candidates: np.ndarray, size: int, state: dict[str, Any],
               gen: np.random.Generator) -> tuple[np.ndarray, dict[str, Any]]:
        chosen = candidates if len(candidates) <= size else gen.choice(candidates, size,
                                                                       replace=False)
        return np.sort(chosen).astype(np.int64), state

    def observe(self, state: dict[str, Any], feedback: Feedback) -> dict[str, Any]:
        return state


def poisson_cohort(candidates: np.ndarray, num_clients: int, rate: float,
                   gen: np.random.Generator) -> np.ndarray:
    """The ``candidates`` (ids among ``num_clients``) whose draw ``u_k ~ U[0, 1)`` is
    below ``rate``: ``u`` is drawn for all ``num_clients`` clients, in id order."""
    u = gen.random(num_clients)
    return np.sort(candidates[u[candidates] < rate]).astype(np.int64)


@register("selector", "uniform")
def uniform() -> Uniform:
    """Uniform sampling of the cohort (the default).

    Reference:
        paper: McMahan et al., "Communication-Efficient Learning of Deep Networks
            from Decentralized Data", AISTATS 2017 (a random fraction of the clients).
        code: none needed (one ``Generator.choice`` without replacement).
        departures: none; the same cohorts as fedloom's sampling before selectors.
    """
    return Uniform()
