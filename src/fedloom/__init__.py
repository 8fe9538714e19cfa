"""fedloom: federated learning on heterogeneous clients over slow links.

The public API::

    import fedloom
    result = fedloom.run("configs/quickstart.yaml", ["rounds=5"])
    agg = fedloom.make_aggregator("fedavg")
    comp = fedloom.make_compressor("topk", ratio=0.01)
    layout = fedloom.Layout.flat(10)
"""

from fedloom.aggregate.base import Aggregator, CohortInfo, make_aggregator
from fedloom.compress import make_compressor
from fedloom.config import Config, ConfigError, load_config
from fedloom.data.sources import DatasetUnavailable
from fedloom.engine.loop import Result, model_sha256, run
from fedloom.params import Layout, functional_forward
from fedloom.state import ClientStateStore, FieldSpec

__version__ = "0.1.0"

__all__ = [
    "Aggregator",
    "ClientStateStore",
    "CohortInfo",
    "Config",
    "ConfigError",
    "DatasetUnavailable",
    "FieldSpec",
    "Layout",
    "Result",
    "__version__",
    "functional_forward",
    "load_config",
    "make_aggregator",
    "make_compressor",
    "model_sha256",
    "run",
]
