"""An FL algorithm as a value: the parts a round applies, bound to one model.

An :class:`Algorithm` holds the local update (:class:`~fedloom.client.sgd.LocalSGD`:
the step's chain of transforms, :mod:`fedloom.client.transforms`), the local
method (its job and state rows), the uplink (compressor, error-feedback policy,
round planner), the aggregator and the server optimizer. :meth:`Algorithm.init`
gives the server states of a new run; the round's stages
(:mod:`fedloom.engine.stages.plan` … :mod:`fedloom.engine.stages.scatter`) read its parts
and name none of them. It is the optax / fedjax shape (settings in the object,
state in and out) over the engine's stages: ``init`` here, a round in
:meth:`fedloom.engine.experiment.Experiment.round`.

The experiment binds it of the user-facing :class:`fedloom.engine.values.Algorithm`
(:mod:`fedloom.engine.binding`: LocalSGD built on the model, each component left
``None`` the schema's default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fedloom.aggregate.base import Aggregator
from fedloom.capabilities import aggregator_caps
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import LocalSGD
from fedloom.compress.base import Compressor
from fedloom.compress.feedback.base import NoFeedback
from fedloom.hooks import RoundPlanner
from fedloom.params import Layout

if TYPE_CHECKING:  # a protocol only
    from fedloom.engine.values import ServerStep

__all__ = ["Algorithm", "ServerStates"]


@dataclass(frozen=True)
class ServerStates:
    """The server-side states an algorithm starts a run with."""

    opt: dict[str, torch.Tensor]   # the server optimizer's
    agg: Any                       # the aggregator's
    method: dict[str, torch.Tensor]  # the local method's server state (FedDyn's h)
    feedback: dict[str, Any]       # the feedback policy's (SA-PEF's L̂, SCAFCOM's c)


@dataclass(frozen=True)
class Algorithm:
    """The parts of an FL algorithm, bound to one model's layout."""

    local: LocalSGD           # local training: SGD over the chain of step transforms
    method: LocalMethod       # the local method: the client's job and state rows
    compressor: Compressor    # the uplink codec
    feedback: NoFeedback      # the error-feedback policy around it
    planner: RoundPlanner     # the round planner (a per-round compressor and epochs)
    aggregator: Aggregator
    server: ServerStep        # the server optimizer

    @property
    def requires(self) -> frozenset[str]:
        """What the aggregator needs of the cohort beyond the rows (start losses, …)."""
        return aggregator_caps(self.aggregator).requires

    @property
    def momentum(self) -> float:
        """The local step's momentum (some rules and policies correct for it)."""
        return float(self.local.momentum)

    def init(self, w: torch.Tensor, layout: Layout) -> ServerStates:
        """The server states of a new run from the initial model ``w``."""
        return ServerStates(self.server.init(w), self.aggregator.init(layout),
                            self.method.init_server(w), self.feedback.init_server(w))
