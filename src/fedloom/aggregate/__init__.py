"""Aggregation rules (one file per rule) and server optimizers."""

from fedloom.aggregate.base import Aggregator, CohortInfo, make_aggregator
from fedloom.aggregate.mean import FedAvg
from fedloom.aggregate.server_opt import ServerOptimizer, make_server_optimizer

__all__ = [
    "Aggregator",
    "CohortInfo",
    "FedAvg",
    "ServerOptimizer",
    "make_aggregator",
    "make_server_optimizer",
]
