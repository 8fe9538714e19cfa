"""Aggregation rules (one file per rule); the server optimizers are :mod:`fedloom.server_opt`."""

from fedloom.aggregate.base import Aggregator, CohortInfo, make_aggregator
from fedloom.aggregate.krum import Krum
from fedloom.aggregate.mean import FedAvg
from fedloom.aggregate.median import CoordinateMedian
from fedloom.aggregate.trimmed_mean import TrimmedMean

__all__ = [
    "Aggregator",
    "CohortInfo",
    "CoordinateMedian",
    "FedAvg",
    "Krum",
    "TrimmedMean",
    "make_aggregator",
]
