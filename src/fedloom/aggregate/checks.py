"""An aggregator checked at the door: one given as an object or an import
reference runs twice before round 1 on synthetic rows of the run's shapes.

The Aggregator protocol (:class:`fedloom.aggregate.base.Aggregator`) is
``init(layout)`` → state and ``__call__(updates, weights, state, *, info)`` →
``(direction, state, metrics)``. Checked: the arity of what comes back, a finite
direction of the model's size ``d`` for finite rows, metrics a mapping of names to
numbers, and the state round-trip (the second call takes the state the first
returned). A registered built-in (fedloom's own class, tested by its suites) is not
run. Each violation is one ``ValueError`` line naming ``aggregator``, the class
and method, and what came back: a run no longer skips every step with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch

from fedloom.aggregate.base import CohortInfo
from fedloom.params import Layout
from fedloom.transforms import called, check_vector, from_fedloom, returned, what

__all__ = ["check_aggregator"]

_PROTOCOL = ("the Aggregator protocol is init(layout) -> state and "
             "__call__(updates, weights, state, *, info) -> (direction, state, metrics)")


def check_aggregator(agg: object, layout: Layout, rows: torch.Tensor, weights: torch.Tensor,
                     info: CohortInfo) -> None:
    """``agg`` on ``rows`` (``[m, d]``), ``weights`` (``[m]``) and ``info``."""
    cls = type(agg).__name__
    if not callable(getattr(agg, "init", None)) or not callable(agg):
        missing = " and ".join(n for n, ok in (("init", callable(getattr(agg, "init", None))),
                                                ("__call__", callable(agg))) if not ok)
        raise ValueError(f"aggregator: {cls} has no {missing}; {_PROTOCOL}")
    if from_fedloom(agg):
        return
    rule = cast(Any, agg)
    m, d = rows.shape
    state = called(f"aggregator: {cls}.init", f"the model's layout ({d} parameters)",
                   rule.init, layout)
    who = f"aggregator: {cls}.__call__"
    for i in range(2):
        on = (f"{m} synthetic rows of length {d}" if i == 0
              else "the state its first call returned (state round-trip)")
        out = called(who, on, rule, rows.clone(), weights.clone(), state, info=info)
        direction, state, metrics = returned(who, out, "Aggregator",
                                             ("direction", "state", "metrics"))
        check_vector(who, direction, (d,))
        _check_metrics(who, metrics)


def _check_metrics(who: str, metrics: object) -> None:
    # the round's line takes each value as float(v)
    if not isinstance(metrics, Mapping):
        raise ValueError(f"{who} returned {what(metrics)} as its metrics, expected a "
                         "mapping of names to numbers")
    for k, v in metrics.items():
        try:
            float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{who} returned metrics[{k!r}] = {what(v)}, expected a "
                             "number") from None
