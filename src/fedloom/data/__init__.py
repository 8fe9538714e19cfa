"""Datasets, partitioners and the federated view of a dataset."""

from fedloom.data.federated import FederatedData, build_federated
from fedloom.data.partition import PartitionError, dirichlet, iid, natural, shards
from fedloom.data.sources import Dataset, DatasetUnavailable, list_sources, load_dataset
from fedloom.data.user import DataError, from_arrays

__all__ = [
    "DataError",
    "Dataset",
    "DatasetUnavailable",
    "FederatedData",
    "PartitionError",
    "build_federated",
    "dirichlet",
    "from_arrays",
    "iid",
    "list_sources",
    "load_dataset",
    "natural",
    "shards",
]
