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

__all__ = ["POISSON_DIRECT_MAX", "Uniform", "poisson_cohort", "uniform", "uniform_cohort"]


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


# Above this many clients, Poisson sampling draws its count and then its members
# (:func:`poisson_cohort`) rather than a uniform per client: the same distribution
# without N draws a round. At or below it the per-client draws of every earlier
# fedloom are kept, so the runs of those populations (all ≤ 10,000 clients in the
# repository's configs, tests and results) draw the cohorts they always drew.
POISSON_DIRECT_MAX = 65_536


def uniform_cohort(num_clients: int, size: int, gen: np.random.Generator) -> np.ndarray:
    """:meth:`Uniform.select` over every client ``0 … num_clients − 1`` without their
    ids in an array: ``gen.choice(num_clients, size, replace=False)`` (sorted) makes
    the draws of ``gen.choice(arange(num_clients), …)`` and returns the positions it
    would take (NumPy's sampling depends on the population's size only), with
    Floyd's algorithm (O(size)) where ``num_clients > 10,000`` and ``size <
    num_clients / 50``. ``tests/test_population.py`` checks the two equal."""
    if num_clients <= size:
        return np.arange(num_clients, dtype=np.int64)
    return np.sort(gen.choice(num_clients, size, replace=False)).astype(np.int64)


def poisson_cohort(candidates: np.ndarray | None, num_clients: int, rate: float,
                   gen: np.random.Generator) -> np.ndarray:
    """The ``candidates`` (ids among ``num_clients``; ``None``: all) that Poisson
    sampling at ``rate`` includes, each client independently of the others.

    Up to :data:`POISSON_DIRECT_MAX` clients: a draw ``u_k ~ U[0, 1)`` for every
    client, in id order, and those below ``rate``. Above: ``M ~ Binomial(N, rate)``,
    then ``M`` distinct clients uniformly (``gen.choice``, Floyd's algorithm while
    ``M < N/50``): the same law (given the count, a Poisson sample is a uniform
    subset of that size), in O(M) time and memory instead of O(N). Candidates then
    keep those of the sample that are available."""
    if num_clients > POISSON_DIRECT_MAX:
        count = int(gen.binomial(num_clients, rate))
        ids = np.sort(gen.choice(num_clients, count, replace=False)).astype(np.int64)
        return ids if candidates is None else ids[np.isin(ids, candidates)]
    u = gen.random(num_clients)
    if candidates is None:
        return np.flatnonzero(u < rate).astype(np.int64)
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
