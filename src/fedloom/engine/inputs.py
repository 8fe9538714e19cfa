"""The values a round's stages read: each stage takes the ones it needs, never the
whole experiment.

- :class:`ModelSpace`: the model, its :class:`~fedloom.params.Layout`, its buffers'
  template and policy, the run's dtype and device.
- :class:`ClientData`: the federated split, the samples on the run's device and the
  fields of the per-client state rows, with how a store of them is made (the rows
  are the run state's: :class:`~fedloom.engine.runstate.RunState`).
- :class:`Schedule`: who is sampled in round ``r`` and with which local step size.
- :class:`ScreenRules`: the update screening of the ``server`` section, as the
  clients and the server apply it.
- :class:`HookView`: what a round planner or client-metric plug-in may read
  (:mod:`fedloom.hooks`).

:class:`~fedloom.engine.experiment.Experiment` binds them of its values
(:mod:`fedloom.engine.binding`); :class:`~fedloom.engine.algorithm.Algorithm`
holds the algorithm's own parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from fedloom.client.sgd import lr_at_round
from fedloom.config import Config, ScheduleConfig
from fedloom.data.federated import FederatedData
from fedloom.engine.clientfields import ClientFields
from fedloom.params import Layout
from fedloom.rng import Purpose, numpy_gen
from fedloom.selection import Feedback, Uniform
from fedloom.selection.uniform import poisson_cohort, uniform_cohort
from fedloom.state import ClientStateStore

__all__ = ["ClientData", "HookView", "ModelSpace", "Schedule", "ScreenRules", "StepSizes"]


class StepSizes(Protocol):
    """The local step size and its schedule over rounds (the ``client`` section, or
    :class:`~fedloom.engine.values.LocalUpdate`)."""

    @property
    def lr(self) -> float: ...

    @property
    def schedule(self) -> ScheduleConfig: ...


@dataclass(frozen=True)
class ModelSpace:
    """The model a run trains, as the stages see it."""

    module: torch.nn.Module               # eval mode; holds the global buffers
    layout: Layout
    buffer_template: dict[str, torch.Tensor]
    buffer_policy: str                    # model.buffers: average | local | keep_global
    dtype: torch.dtype
    device: torch.device


@dataclass(frozen=True)
class ClientData:
    """The clients: their samples (on the run's device) and the fields of their state
    rows; ``new_store()`` makes a store of them, every row zero (a new run state's)."""

    fed: FederatedData
    x: torch.Tensor
    y: torch.Tensor
    new_store: Callable[[], ClientStateStore]
    fields: ClientFields

    @property
    def num_clients(self) -> int:
        return self.fed.num_clients


@dataclass(frozen=True)
class Schedule:
    """Round ``r``'s cohort (chosen by the run's client selector, :mod:`fedloom.selection`,
    or with ``rate`` by Poisson sampling) and local step size."""

    seed: int
    rounds: int
    cohort_size: int
    num_clients: int
    client: StepSizes
    system: Any = None  # fedloom.system.SystemModel, or None when off
    selector: Any = None  # a fedloom.selection.Selector; None: uniform
    # cohort.sampling poisson: each client with probability `rate`; None: fixed-size
    rate: float | None = None
    # privacy.ftrl.groups: round r draws from the clients k with k = r (mod groups)
    groups: int = 1

    @property
    def chooser(self) -> Any:
        """The selector (uniform where none was given)."""
        return self.selector if self.selector is not None else Uniform()

    def initial_selection(self) -> dict[str, Any]:
        """The selector's state before round 0."""
        return self.chooser.init(self.num_clients)  # type: ignore[no-any-return]

    def candidates(self, r: int) -> np.ndarray:
        """The clients available in round ``r`` (all of them without availability), of
        round r's participation group (``groups``)."""
        if self.system is not None and self.system.has_availability:
            ids: np.ndarray = self.system.available_ids(r)
        else:
            ids = np.arange(self.num_clients, dtype=np.int64)
        return ids if self.groups == 1 else ids[ids % self.groups == r % self.groups]

    def select(self, r: int, state: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        """Round ``r``'s cohort (sorted ids) and the selector's new state, from its
        state ``state`` and the round's own generator ``(seed, r, -1, "cohort")``."""
        gen = numpy_gen(self.seed, r, -1, Purpose.COHORT)
        # {}: a state from before selectors (an older checkpoint, a caller's RunState)
        state = state or self.initial_selection()
        # privacy.ftrl.groups: a round draws from its group only (candidates)
        everyone = (self.system is None or not self.system.has_availability) and self.groups == 1
        if self.rate is not None:  # Poisson sampling: the uniform selector's state is {}
            ids = poisson_cohort(None if everyone else self.candidates(r), self.num_clients,
                                 self.rate, gen)
            new = state
        elif everyone and type(self.chooser) is Uniform:
            # the uniform selector's draw over every client, without an array of N ids
            ids, new = uniform_cohort(self.num_clients, self.cohort_size, gen), state
        else:
            ids, new = self.chooser.select(r, self.candidates(r), self.cohort_size, state, gen)
        return torch.from_numpy(np.sort(np.asarray(ids, dtype=np.int64))).long(), new

    def observe(self, state: dict[str, Any], feedback: Feedback) -> dict[str, Any]:
        """The selector's state after the server received a round's reports."""
        return self.chooser.observe(state, feedback)  # type: ignore[no-any-return]

    def sample_cohort(self, r: int, state: dict[str, Any] | None = None) -> torch.Tensor:
        """Round ``r``'s cohort from the selector's state ``state`` (default: its state
        before round 0, which is every state of the stateless ``uniform``: ``cohort_size``
        distinct available clients, uniformly, from the round's own generator)."""
        return self.select(r, state if state is not None else self.initial_selection())[0]

    def lr(self, r: int) -> float:
        return lr_at_round(self.client.lr, self.client.schedule, r, self.rounds)


@dataclass(frozen=True)
class ScreenRules:
    """The ``server`` section's update screening (:mod:`fedloom.engine.stages.screen`): a
    norm bound, a ratio to the cohort's median (off under differential privacy,
    whose clipping bounds every update), and clipping before any aggregator."""

    max_update_norm: float | None
    max_norm_ratio: float | None
    clip_norm: float | None
    private: bool = False  # differential privacy is on

    @property
    def ratio(self) -> float | None:
        """The ratio bound in force: none under privacy, where it would make one
        client's acceptance depend on the others' norms (the clip bounds every
        contribution instead)."""
        return None if self.private else self.max_norm_ratio

    @property
    def sized(self) -> bool:
        """Whether any rule needs the rows' norms."""
        return (self.max_update_norm is not None or self.max_norm_ratio is not None
                or self.clip_norm is not None)


@dataclass(frozen=True)
class HookView:
    """What a plug-in of :mod:`fedloom.hooks` reads; it changes nothing in it."""

    cfg: Config
    layout: Layout
    fed: FederatedData
    x: torch.Tensor
    y: torch.Tensor
    trainer: Any
    global_eval: Callable[[torch.Tensor], tuple[float, float]]
    make_uplink: Callable[..., Any]
