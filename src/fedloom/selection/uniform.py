"""``uniform``: ``cohort.size`` distinct clients, uniformly, from the available ones.

The cohort is ``gen.choice(candidates, size, replace=False)`` (sorted) from the
round's generator ``(seed, r, -1, "cohort")``, or every available client when no
more than ``size`` are: the draw fedloom has always made (``tests/test_selection.py``
holds it to the earlier code's cohorts). It keeps no state and learns nothing from
the rounds, so it is the sampling the privacy accountant assumes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedloom.capabilities import SelectorCaps
from fedloom.registry import register
from fedloom.selection.base import Feedback

__all__ = ["Uniform", "uniform"]


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
