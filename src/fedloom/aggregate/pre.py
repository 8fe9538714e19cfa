"""Pre-aggregation: steps on the cohort's rows before the rule (NNM, bucketing, a plug-in).

``server.pre_aggregation`` is a chain ``[{name, options}, …]``; each entry is a
registered pre-aggregation (kind ``preaggregator``: ``nnm``, ``bucketing``), an entry
point of group ``fedloom.preaggregators`` or ``module:attr``, built with its options
(and ``seed``, the run's seed, where its factory takes it). The chain runs in order,
then the aggregator on what it left, whatever the rule: NNM followed by Krum is
Allouah et al.'s NNM∘Krum. The protocol::

    rows, weights, info, metrics = step(rows, weights, info)

``rows`` ``[m, d]`` in, ``[m', d]`` out with ``weights`` ``[m']`` and a
:class:`~fedloom.aggregate.base.CohortInfo` whose rows align with them; a step whose
rows stand for groups of clients, not one client each (bucketing), says
``per_client = False`` and leaves the per-client fields (losses, steps, start losses)
out, so a rule that needs them after it is refused when the chain is built.
:class:`PreAggregated` is the chain and the rule as one aggregator (state, server step
and capabilities the rule's; never linear: the steps read the rows' values).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from fedloom.aggregate.base import Aggregator, CohortInfo
from fedloom.capabilities import AggregatorCaps, aggregator_caps
from fedloom.params import Layout

__all__ = ["PER_CLIENT", "PreAggregated", "PreAggregation", "build_chain"]

# The CohortInfo fields that describe one client each.
PER_CLIENT = frozenset({"losses", "steps", "start_losses"})


class PreAggregation(Protocol):
    """A step on the rows before the aggregator (module docstring)."""

    per_client: bool  # each output row stands for one client (its info fields kept)

    def __call__(self, rows: torch.Tensor, weights: torch.Tensor, info: CohortInfo
                 ) -> tuple[torch.Tensor, torch.Tensor, CohortInfo, Mapping[str, float]]: ...


class PreAggregated:
    """The steps ``steps`` in order, then the aggregator ``rule``."""

    def __init__(self, rule: Aggregator, steps: Sequence[PreAggregation]) -> None:
        self.rule, self.steps = rule, tuple(steps)
        caps = aggregator_caps(rule)
        needs = sorted(caps.requires & PER_CLIENT)
        for i, step in enumerate(self.steps):
            if not step.per_client and needs:
                raise ValueError(
                    f"server.pre_aggregation[{i}]: {type(step).__name__} mixes clients into "
                    f"groups; the aggregator needs each client's {needs[0]}")
        # the rule's needs and weighting; never linear nor DP's mean (the steps read rows)
        self.capabilities = AggregatorCaps(requires=caps.requires,
                                           full_participation=caps.full_participation,
                                           weighted=caps.weighted)

    def init(self, layout: Layout) -> Any:
        return self.rule.init(layout)

    def __call__(self, updates: torch.Tensor, weights: torch.Tensor, state: Any, *,
                 info: CohortInfo | None = None
                 ) -> tuple[torch.Tensor, Any, Mapping[str, float]]:
        if info is None:
            info = CohortInfo(clients=torch.arange(updates.shape[0]), round=0,
                              num_clients=updates.shape[0])
        metrics: dict[str, float] = {}
        rows = updates
        for step in self.steps:
            rows, weights, info, m = step(rows, weights, info)
            metrics.update(m)
        out, state, m = self.rule(rows, weights, state, info=info)
        return out, state, {**metrics, **m}


def build_chain(rule: Aggregator, entries: Sequence[Mapping[str, Any]], seed: int
                ) -> Aggregator:
    """``rule`` after the steps of ``server.pre_aggregation`` (``rule`` itself when
    there are none); one ``ValueError`` line naming the entry for a bad one."""
    if not entries:
        return rule
    from fedloom.registry import accepted_options, build, get

    steps = []
    for i, e in enumerate(entries):
        where = f"server.pre_aggregation[{i}]"
        name = e.get("name") if isinstance(e, Mapping) else None
        if not isinstance(name, str):
            raise ValueError(f"{where}: must be a mapping with a name, got {e!r}")
        opts = dict(e.get("options") or {})
        extra = accepted_options(get("preaggregator", name), {"seed": seed})
        try:
            steps.append(build("preaggregator", name, {**opts, **extra}, f"{where}.options"))
        except ValueError as e:  # a step's own "pre_aggregation.options.X: ..." line
            msg = str(e).splitlines()[0]
            raise ValueError(msg.replace("pre_aggregation.", f"{where}.", 1)
                             if msg.startswith("pre_aggregation.") else msg) from None
    return PreAggregated(rule, steps)
