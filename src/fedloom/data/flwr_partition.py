"""``flwr:NAME``: any flwr-datasets partitioner, by its class name, on fedloom's data.

``data.partition.name=flwr:DirichletPartitioner`` with ``data.partition.options``
(``{alpha: 0.3, self_balancing: true}``) builds
``flwr_datasets.partitioner.DirichletPartitioner`` with those options and hands it
fedloom's in-memory labels as a Hugging Face ``datasets.Dataset`` of two columns,
``label`` and the sample's index; client ``k``'s samples are the indices of
``load_partition(k)``. fedloom sets three of the partitioner's arguments, where its
signature has them: ``num_partitions = data.num_clients``, ``partition_by = "label"``,
and ``seed``, drawn from fedloom's partition generator (so the split is a function of
``(seed, "partition")`` like every other one). The rows are shuffled by the same
generator first, as ``FederatedDataset`` shuffles them before partitioning. An
option the class does not take, or one of those three, is refused naming
``data.partition.options.KEY``.

The split is flwr-datasets' own: fedloom checks that it is disjoint and has one part
per client; samples a partitioner leaves out (``ShardPartitioner`` without
``keep_incomplete_shard``, for instance) stay out, with a warning — the one departure
from fedloom's covering contract, made so the library's partitioners run as published.

Needs the optional extra ``pip install 'fedloom[partition]'`` (flwr-datasets).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import numpy as np

from fedloom.data.partition import PartitionError
from fedloom.registry import register_family

__all__ = ["flwr_partitioner"]

log = logging.getLogger("fedloom")

_SET_BY_FEDLOOM = ("num_partitions", "partition_by", "seed")
_INDEX = "_fedloom_index"
_CACHE: dict[str, Any] = {}


@register_family("partitioner", "flwr")
def flwr_partitioner(name: str) -> Any:
    """The fedloom partitioner that runs flwr-datasets' ``name`` (``KeyError`` if none)."""
    if name in _CACHE:
        return _CACHE[name]
    try:
        import flwr_datasets.partitioner as fp
    except ImportError:
        raise KeyError(f"flwr:{name} needs flwr-datasets "
                       "(pip install 'fedloom[partition]')") from None
    cls = getattr(fp, name, None)
    names = sorted(n for n in dir(fp) if n.endswith("Partitioner") and n != "Partitioner")
    if not (isinstance(cls, type) and issubclass(cls, fp.Partitioner)) or name == "Partitioner":
        raise KeyError(f"flwr-datasets has no partitioner {name!r} (available: "
                       f"{', '.join(names)})")

    def factory(labels: np.ndarray, num_clients: int, *, rng: np.random.Generator,
                **options: Any) -> list[np.ndarray]:
        return _run(cls, labels, num_clients, rng, options)

    factory.__name__ = f"flwr:{name}"
    factory.__doc__ = (f"flwr-datasets' {name} (flwr_datasets.partitioner), its options "
                       "in data.partition.options.\n\n    Reference:\n        paper: see "
                       f"flwr-datasets' {name}.\n        code: flwrlabs/flower, datasets/"
                       "flwr_datasets/partitioner.\n        departures: samples it leaves "
                       "out stay out (a warning).\n")
    _CACHE[name] = factory
    return factory


def _run(cls: type, labels: np.ndarray, num_clients: int, rng: np.random.Generator,
         options: dict[str, Any]) -> list[np.ndarray]:
    import datasets

    params = inspect.signature(cls).parameters  # the constructor's, without self
    for key in options:
        if key in _SET_BY_FEDLOOM:
            raise PartitionError(f"data.partition.options.{key}: set by fedloom (data.num_clients"
                                 ", the label column, the run's seed)")
        if key not in params or key == "self":
            known = [p for p in params if p not in ("self", *_SET_BY_FEDLOOM)]
            raise PartitionError(f"data.partition.options.{key}: unknown option of "
                                 f"{cls.__name__} (expected one of: {', '.join(known)})")
    kw = dict(options)
    if "num_partitions" in params:
        kw["num_partitions"] = num_clients
    if "partition_by" in params:
        kw["partition_by"] = "label"
    if "seed" in params:
        kw["seed"] = int(rng.integers(0, 2**32 - 1))
    try:
        part = cls(**kw)
    except (TypeError, ValueError) as e:
        raise PartitionError(f"data.partition.options: {cls.__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    # Shuffled first, as flwr-datasets' FederatedDataset does (shuffle=True) before it
    # partitions: IidPartitioner, for one, cuts the rows in the order given.
    order = rng.permutation(len(labels))
    ds = datasets.Dataset.from_dict({"label": np.asarray(labels).astype(np.int64)[order],
                                     _INDEX: order.astype(np.int64)})
    part.dataset = ds
    try:
        if part.num_partitions != num_clients:
            raise PartitionError(f"data.num_clients: {cls.__name__} makes "
                                 f"{part.num_partitions} partitions, not {num_clients}")
        out = [np.sort(np.asarray(part.load_partition(k)[_INDEX], dtype=np.int64))
               for k in range(num_clients)]
    except PartitionError:
        raise
    except (ValueError, KeyError, IndexError) as e:  # flwr-datasets' own refusals
        raise PartitionError(f"data.partition.name: {cls.__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    taken = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    if len(np.unique(taken)) != len(taken):
        raise PartitionError(f"data.partition.name: {cls.__name__} gave a sample to two clients")
    empty = [k for k, p in enumerate(out) if len(p) == 0]
    if empty:
        raise PartitionError(f"data.partition.name: {cls.__name__} left client {empty[0]} "
                             "without a sample")
    if len(taken) < len(labels):
        log.warning("%s left %d of %d samples out of every client", cls.__name__,
                    len(labels) - len(taken), len(labels))
    return out
