"""fedloom: federated learning on heterogeneous clients over slow links.

The public API::

    import fedloom
    from fedloom.aggregate.craft import CRAFT
    from fedloom.data import from_arrays
    result = fedloom.run("configs/quickstart.yaml", ["rounds=5"])
    result = fedloom.run("configs/quickstart.yaml", aggregator=CRAFT(step="rprop"))
    algorithm = fedloom.Algorithm(local=fedloom.LocalUpdate(lr=0.05), aggregator=CRAFT())
    federation = fedloom.Federation(data=from_arrays(X, y), cohort=5)
    runtime = fedloom.Runtime(backend="sequential", device="cpu", seed=0)
    exp = fedloom.Experiment(algorithm, federation, runtime, model)
    state = exp.init()
    for _ in range(5):
        state, metrics = exp.round(state)   # state in, state out
    exp = fedloom.Experiment.from_config(fedloom.load_config("configs/quickstart.yaml"))
    agg = fedloom.make_aggregator("fedavg")
    comp = fedloom.make_compressor("topk", ratio=0.01)
    layout = fedloom.Layout.flat(10)

The names are imported on first use (PEP 562), so ``import fedloom.config`` or
the Flower relay (:mod:`fedloom.integrations.warm`) does not import torch: a
deployed ClientApp process that only forwards its message starts in a fraction
of the time (docs/deploy.md, "Round time").
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fedloom._version import __version__

# public name -> the module that defines it
_LAZY = {
    "Aggregator": "fedloom.aggregate.base",
    "CohortInfo": "fedloom.aggregate.base",
    "make_aggregator": "fedloom.aggregate.base",
    "make_compressor": "fedloom.compress",
    "Algorithm": "fedloom.engine.values",
    "Federation": "fedloom.engine.values",
    "LocalUpdate": "fedloom.engine.values",
    "Runtime": "fedloom.engine.values",
    "Components": "fedloom.engine.objects",
    "Config": "fedloom.config",
    "ConfigError": "fedloom.config",
    "load_config": "fedloom.config",
    "DatasetUnavailable": "fedloom.data.sources",
    "Experiment": "fedloom.engine.experiment",
    "Result": "fedloom.engine.runstate",
    "model_sha256": "fedloom.engine.runstate",
    "run": "fedloom.engine.runs.loop",
    "Layout": "fedloom.params",
    "functional_forward": "fedloom.params",
    "ClientStateStore": "fedloom.state",
    "FieldSpec": "fedloom.state",
}

__all__ = [
    "Aggregator",
    "Algorithm",
    "ClientStateStore",
    "CohortInfo",
    "Components",
    "Config",
    "ConfigError",
    "DatasetUnavailable",
    "Experiment",
    "Federation",
    "FieldSpec",
    "Layout",
    "LocalUpdate",
    "Result",
    "Runtime",
    "__version__",
    "functional_forward",
    "load_config",
    "make_aggregator",
    "make_compressor",
    "model_sha256",
    "run",
]

if TYPE_CHECKING:  # what static checkers and IDEs see
    from fedloom.aggregate.base import Aggregator, CohortInfo, make_aggregator
    from fedloom.compress import make_compressor
    from fedloom.config import Config, ConfigError, load_config
    from fedloom.data.sources import DatasetUnavailable
    from fedloom.engine.experiment import Experiment
    from fedloom.engine.objects import Components
    from fedloom.engine.runs.loop import run
    from fedloom.engine.runstate import Result, model_sha256
    from fedloom.engine.values import Algorithm, Federation, LocalUpdate, Runtime
    from fedloom.params import Layout, functional_forward
    from fedloom.state import ClientStateStore, FieldSpec


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fedloom' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
