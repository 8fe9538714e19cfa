"""The three values an experiment is made of: what runs, on whom, and how.

:class:`Algorithm` (the local update's settings and the round's components),
:class:`Federation` (the samples, their split among clients, who trains in a
round, the simulated system, Byzantine clients) and :class:`Runtime` (backend,
device, threads, dtype, seed) are frozen values, built in Python or of a config
by :func:`fedloom.engine.build.build`; :class:`~fedloom.engine.experiment.Experiment`
binds them to a model. A component left ``None`` is the config schema's default,
built on the model's layout when the experiment binds it, so ``Algorithm()`` is
FedAvg over plain local SGD. Settings with no component object of their own (a
privacy mechanism, the system model, the data split) are their config section,
a typed value with the schema's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from fedloom.aggregate.base import Aggregator
from fedloom.client.methods import LocalMethod
from fedloom.compress.base import Compressor
from fedloom.compress.feedback.base import NoFeedback
from fedloom.config import (
    AttackConfig,
    BackendConfig,
    DataConfig,
    PrivacyConfig,
    ScheduleConfig,
    StateConfig,
    SystemConfig,
)
from fedloom.data.sources import Dataset
from fedloom.engine.inputs import ScreenRules
from fedloom.hooks import RoundPlanner
from fedloom.selection import Selector

__all__ = ["Algorithm", "Federation", "LocalUpdate", "Runtime", "ServerStep"]


class ServerStep(Protocol):
    """The server's step on the aggregate (a :class:`~fedloom.server_opt.optimizers.
    ServerOptimizer`, a :func:`fedloom.transforms.chain` of server transforms)."""

    # Any: each step keeps its own state's shape (a tuple of a chain's parts, a
    # mapping); the engine only hands it back and saves it.
    def init(self, w: torch.Tensor) -> Any: ...

    def step(self, w: torch.Tensor, agg: torch.Tensor, state: Any
             ) -> tuple[torch.Tensor, Any]: ...


@dataclass(frozen=True)
class LocalUpdate:
    """Local SGD's settings (the ``client`` section's numbers); the experiment
    builds :class:`~fedloom.client.sgd.LocalSGD` of them on its model.
    ``transforms``: more terms of the step (:mod:`fedloom.client.transforms`; typed
    ``object``: they have no protocol but the step's, which LocalSGD reads)."""

    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    batch_size: int = 32
    epochs: int = 1
    steps: int | None = None
    prox_mu: float = 0.0
    amp: Literal["none", "bf16", "fp16"] = "none"
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    transforms: tuple[object, ...] = ()


@dataclass(frozen=True)
class Algorithm:
    """What a round applies: local update, local method, uplink (compressor,
    error-feedback policy, round planner), aggregator and server step, with the
    server's screening, privacy and the global buffers' policy (``model.buffers``).
    ``None``: the default component (plain SGD, identity, no feedback, no planner,
    FedAvg, server SGD at step 1)."""

    local: LocalUpdate = field(default_factory=LocalUpdate)
    method: LocalMethod | None = None
    compressor: Compressor | None = None
    feedback: NoFeedback | None = None
    planner: RoundPlanner | None = None
    aggregator: Aggregator | None = None
    server: ServerStep | None = None
    screening: ScreenRules = field(default_factory=lambda: ScreenRules(None, 1e4, None))
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)
    secure_aggregation: bool = False
    buffers: Literal["average", "local", "keep_global"] = "average"
    checksum: bool = True  # the broadcast's integrity trailer (the uplink's is its codec's)


@dataclass(frozen=True)
class Federation:
    """The clients: ``data`` split by ``split`` (the data section's split settings:
    ``num_clients``, ``partition``, ``test_fraction``, ``standardize``, ``feature``,
    ``augment``; its source fields are not read), ``cohort`` of them a round chosen
    by ``selector`` (``None``: uniformly), the simulated ``system`` (``None``: off)
    and Byzantine clients (``attack``; fraction 0: none)."""

    data: Dataset
    split: DataConfig = field(default_factory=DataConfig)
    cohort: int = 10
    selector: Selector | None = None
    system: SystemConfig | None = None
    attack: AttackConfig = field(default_factory=AttackConfig)

    @property
    def system_settings(self) -> SystemConfig:
        """The system section in force (the schema's, all off, for ``None``)."""
        return self.system if self.system is not None else SystemConfig()


@dataclass(frozen=True)
class Runtime:
    """Where and how the rounds run: ``backend`` (a registered name) and its factory's
    ``options`` (``backend.options``: ``workers``, ``chunk``, …), ``device``, torch
    ``threads`` (1 as in a config; 0: the process's count), ``dtype``, ``seed`` (every
    draw derives from it), the client state storage and ``keep_heap``
    (``backend.keep_heap``)."""

    backend: str = "sequential"
    device: str = "cpu"
    threads: int = 1
    dtype: Literal["float32", "float64"] = "float32"
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)
    state: StateConfig = field(default_factory=StateConfig)
    keep_heap: bool = True

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "float64": torch.float64}[self.dtype]

    @property
    def backend_settings(self) -> BackendConfig:
        """The backend section of these settings."""
        return BackendConfig(name=self.backend, options=dict(self.options),
                             threads=self.threads, keep_heap=self.keep_heap)
