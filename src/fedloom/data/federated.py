"""FederatedData: a dataset partitioned over clients, each with a train/test split."""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedloom.config import DataConfig
from fedloom.data.partition import PartitionError
from fedloom.data.sources import Dataset
from fedloom.registry import get
from fedloom.rng import Purpose, numpy_gen

__all__ = ["FederatedData", "build_federated", "partition_indices", "split_train_test",
           "standardize", "uses_natural_split"]


@dataclass
class FederatedData:
    """Per-client index views into one :class:`Dataset`.

    Attributes:
        train: ``train[k]`` are client k's training sample indices (into ``dataset.x``).
        test: ``test[k]`` its own test split (possibly empty).
        x_test, y_test: the global test set (the source's, or the union of the
            clients' test splits when the source has none).

    For a population (``dataset.population``, :mod:`fedloom.data.population`),
    ``train[k]`` and ``test[k]`` are made when asked for: the positions of user
    ``k``'s generated samples (all of them) and none.
    """

    dataset: Dataset
    train: Sequence[np.ndarray]
    test: Sequence[np.ndarray]
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def population(self) -> Any:
        """The population whose users are generated on demand, or ``None``."""
        return self.dataset.population

    @property
    def num_clients(self) -> int:
        return len(self.train)

    @property
    def num_classes(self) -> int:
        return self.dataset.num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        return self.dataset.input_shape

    def num_train(self) -> np.ndarray | Sequence[int]:
        """``n_k``, the training-set size of every client (a population's: each made
        when read, :meth:`fedloom.data.population.Population.sizes`)."""
        if self.population is not None:
            return self.population.sizes()  # type: ignore[no-any-return]
        return np.array([len(t) for t in self.train], dtype=np.int64)


def partition_indices(ds: Dataset, cfg: DataConfig, seed: int) -> list[np.ndarray]:
    """Run the configured partitioner with its derived generator."""
    p = cfg.partition
    rng = numpy_gen(seed, -1, -1, Purpose.PARTITION)
    labels = ds.y.numpy()
    if labels.ndim > 1:  # a sequence of labels (data.name: text): its last one is the class
        labels = labels.reshape(len(labels), -1)[:, -1]
    if uses_natural_split(ds, cfg):
        assert ds.groups is not None
        parts = get("partitioner", "natural")(labels, len(np.unique(ds.groups)), rng=rng,
                                              groups=ds.groups)
        ids = np.unique(ds.groups)
        for k, part in enumerate(parts):
            if len(part) < cfg.min_samples:
                raise PartitionError(
                    f"data.min_samples: client {int(ids[k])} has {len(part)} samples, "
                    f"fewer than {cfg.min_samples}"
                )
        return parts
    # The feasibility checks of the partitioners, worded with the config's fields.
    if len(labels) < cfg.num_clients:
        raise PartitionError(f"data.num_clients: {cfg.num_clients} clients need a sample each; "
                             f"the data has {len(labels)} samples")
    fn = get("partitioner", p.name)
    opts = dict(p.options)
    params = inspect.signature(fn).parameters

    def option(key: str) -> Any:  # given, else the partitioner's default
        return opts.get(key, params[key].default)

    if p.name == "dirichlet" and cfg.num_clients * option("min_samples") > len(labels):
        raise PartitionError(
            f"data.partition.options.min_samples: {cfg.num_clients} clients (data.num_clients)"
            f" x {option('min_samples')} = {cfg.num_clients * option('min_samples')} exceeds "
            f"the {len(labels)} samples")
    if p.name == "shards" and cfg.num_clients * option("shards_per_client") > len(labels):
        raise PartitionError(
            f"data.partition.options.shards_per_client: {cfg.num_clients} clients "
            f"(data.num_clients) x {option('shards_per_client')} shards exceed the "
            f"{len(labels)} samples")
    if p.name == "natural":
        return fn(labels, cfg.num_clients, rng=rng, groups=ds.groups)
    # Every partitioner (built-in, flwr:NAME, plug-in) takes its options (checked against
    # its signature when the config loaded); one that names `groups` gets the source's
    # client ids (or None).
    if "groups" in params:
        opts["groups"] = ds.groups
    try:
        return fn(labels, cfg.num_clients, rng=rng, **opts)
    except PartitionError as e:  # worded with the config's section
        msg = str(e)
        raise PartitionError(msg if msg.startswith("data.") else f"data.partition: {msg}"
                             ) from None


def uses_natural_split(ds: Dataset, cfg: DataConfig) -> bool:
    """User data with client ids is split naturally, whatever the partitioner says."""
    if ds.groups is None:
        return False
    if ds.natural:
        return True
    return ds.name in ("npz", "csv", "arrays", "shakespeare") or (cfg.partition.name == "natural"
                                                   and ds.name != "synthetic")


def split_train_test(
    idx: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle one client's indices; the last ``ceil(f·n)`` go to its test split.

    ``ceil`` matches scikit-learn's ``train_test_split`` used by CRAFT's code.
    """
    perm = rng.permutation(idx)
    n_test = math.ceil(test_fraction * len(idx)) if test_fraction > 0 else 0
    n_test = min(n_test, len(idx) - 1)  # every client keeps >= 1 training sample
    return np.sort(perm[: len(idx) - n_test]), np.sort(perm[len(idx) - n_test :])


def standardize(ds: Dataset, train_idx: np.ndarray) -> Dataset:
    """Per-feature ``(x − μ)/σ`` with μ, σ from the training samples only (σ = 0 → 1)."""
    xt = ds.x[torch.from_numpy(train_idx)].to(torch.float64)
    mu = xt.mean(0)
    sd = xt.std(0, unbiased=False)
    sd = torch.where(sd > 0, sd, torch.ones_like(sd))

    def apply(x: torch.Tensor) -> torch.Tensor:
        return ((x.to(torch.float64) - mu) / sd).to(x.dtype)

    import dataclasses

    return dataclasses.replace(
        ds, x=apply(ds.x), x_test=apply(ds.x_test) if ds.x_test is not None else None
    )


def build_federated(ds: Dataset, cfg: DataConfig, seed: int) -> FederatedData:
    """Partition ``ds`` and split each client's part into train/test."""
    if ds.population is not None:
        return _population(ds, cfg)
    # The dataset's own name, not data.name: arrays given to ``run(data=...)``
    # replace the configured source, whatever data.name still says.
    if cfg.partition.name != "natural" and ds.groups is not None and ds.name == "synthetic":
        raise PartitionError("data.partition.name: synthetic data is split by user; use 'natural'")
    parts = partition_indices(ds, cfg, seed)
    train, test = [], []
    for k, idx in enumerate(parts):
        if ds.test_mask is not None:  # the source's own split (LEAF), kept as published
            tr, te = np.sort(idx[~ds.test_mask[idx]]), np.sort(idx[ds.test_mask[idx]])
            if len(tr) == 0:
                raise PartitionError(f"data: client {k} has no training sample in the "
                                     "source's own train/test split")
            train.append(tr)
            test.append(te)
            continue
        tr, te = split_train_test(idx, cfg.test_fraction, numpy_gen(seed, -1, k, Purpose.SPLIT))
        train.append(tr)
        test.append(te)
    if cfg.standardize and ds.x.is_floating_point():
        ds = standardize(ds, np.concatenate(train))
    if ds.x_test is not None and ds.y_test is not None:
        x_test, y_test = ds.x_test, ds.y_test
    else:
        all_test = np.concatenate(test) if any(len(t) for t in test) else np.concatenate(train)
        x_test, y_test = ds.x[all_test], ds.y[all_test]
    return FederatedData(ds, train, test, x_test, y_test)


def _population(ds: Dataset, cfg: DataConfig) -> FederatedData:
    """A population's clients: one per user, made on demand; its global test set
    is its held-out users' (:mod:`fedloom.data.population`)."""
    from fedloom.data.population import ClientParts

    if cfg.partition.name != "natural":
        raise PartitionError(f"data.partition.name: a population ({ds.name}) is split by "
                             "user; use 'natural'")
    if cfg.standardize:
        raise PartitionError(f"data.standardize: a population ({ds.name}) is generated on "
                             "demand; there is no pool to standardize over")
    pop = ds.population
    assert ds.x_test is not None and ds.y_test is not None
    return FederatedData(ds, ClientParts(pop.num_clients, pop.size),
                         ClientParts(pop.num_clients, lambda k: 0), ds.x_test, ds.y_test)
