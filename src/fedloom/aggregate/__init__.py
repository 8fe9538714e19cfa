"""Aggregation rules (one file per rule) and server optimizers."""

from fedloom.aggregate.base import Aggregator, CohortInfo, make_aggregator
from fedloom.aggregate.krum import Krum
from fedloom.aggregate.mean import FedAvg
from fedloom.aggregate.median import CoordinateMedian
from fedloom.aggregate.server_opt import ServerOptimizer, make_server_optimizer
from fedloom.aggregate.trimmed_mean import TrimmedMean

__all__ = [
    "Aggregator",
    "CohortInfo",
    "CoordinateMedian",
    "FedAvg",
    "Krum",
    "ServerOptimizer",
    "TrimmedMean",
    "make_aggregator",
    "make_server_optimizer",
]
