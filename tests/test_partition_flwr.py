"""``flwr:NAME`` runs flwr-datasets' partitioners on fedloom's data, and fedloom's own
``dirichlet`` and ``classes`` give the same distribution of per-client class counts as
flwr-datasets' ``DirichletPartitioner`` and ``PathologicalPartitioner``: two-sample
Kolmogorov–Smirnov tests on per-client statistics pooled over seeds (not equal bits —
the two draw in different orders)."""

import numpy as np
import pytest

from fedloom.config import ConfigError, load_config
from fedloom.data.heterogeneity import class_counts
from fedloom.data.partition import PartitionError, classes, dirichlet
from fedloom.registry import get
from fedloom.rng import numpy_gen

pytest.importorskip("flwr_datasets", reason="flwr:NAME needs flwr-datasets "
                    "(pip install 'fedloom[partition]')")
stats = pytest.importorskip("scipy.stats", reason="the two-sample tests need scipy")

# flwr-datasets warns when a random assignment leaves a class unused (its samples are
# then left out: its departure from covering, which fedloom's `classes` redraws instead)
# and when it redraws a Dirichlet split below min_partition_size (as fedloom's does)
pytestmark = [pytest.mark.filterwarnings("ignore:Classes.*will NOT be used:UserWarning"),
              pytest.mark.filterwarnings("ignore:The specified min_partition_size:UserWarning")]

N, C, SEEDS = 20, 10, 6
LABELS = np.arange(2000) % C


def _stat(parts, labels=LABELS):
    """Per client: its size and the share of its largest class."""
    counts = class_counts(labels, parts, C)
    n = counts.sum(axis=1)
    return n, counts.max(axis=1) / n


def _pooled(fn):
    sizes, top = zip(*(_stat(fn(numpy_gen(s, -1, -1, "partition"))) for s in range(SEEDS)),
                     strict=True)
    return np.concatenate(sizes), np.concatenate(top)


def _flwr(name, **options):
    f = get("partitioner", f"flwr:{name}")
    return lambda rng: f(LABELS, N, rng=rng, **options)


def _same_distribution(a, b, alpha=0.01):
    return all(stats.ks_2samp(x, y).pvalue > alpha for x, y in zip(a, b, strict=True))


def test_dirichlet_matches_flwr_dirichlet_partitioner():
    ours = _pooled(lambda rng: dirichlet(LABELS, N, rng=rng, alpha=0.3, min_samples=10))
    theirs = _pooled(_flwr("DirichletPartitioner", alpha=0.3, self_balancing=True,
                           min_partition_size=10))
    assert _same_distribution(ours, theirs)
    # the test has power: a different α is told apart
    other = _pooled(_flwr("DirichletPartitioner", alpha=3.0, self_balancing=True,
                          min_partition_size=10))
    assert stats.ks_2samp(ours[1], other[1]).pvalue < 1e-6


def test_classes_matches_flwr_pathological_partitioner():
    ours = _pooled(lambda rng: classes(LABELS, N, rng=rng, k=2, assign="random",
                                       min_samples=1))
    theirs = _pooled(_flwr("PathologicalPartitioner", num_classes_per_partition=2,
                           class_assignment_mode="random"))
    assert _same_distribution(ours, theirs)
    assert np.all(ours[1] >= 0.0) and np.allclose(
        [len(np.unique(LABELS[p])) for p in classes(LABELS, N, rng=numpy_gen(0), k=2)], 2)
    other = _pooled(_flwr("PathologicalPartitioner", num_classes_per_partition=3,
                          class_assignment_mode="random"))
    assert stats.ks_2samp(ours[1], other[1]).pvalue < 1e-6


def test_flwr_partitioner_is_disjoint_seeded_and_checked():
    f = get("partitioner", "flwr:IidPartitioner")
    a = f(LABELS, N, rng=numpy_gen(1))
    b = f(LABELS, N, rng=numpy_gen(1))
    allidx = np.concatenate(a)
    assert len(allidx) == len(np.unique(allidx)) == len(LABELS)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    # shuffled first, as FederatedDataset does: every IID client sees every class
    assert all(len(np.unique(LABELS[p])) == C for p in a)
    with pytest.raises(PartitionError, match=r"data.partition.options.seed: set by fedloom"):
        f(LABELS, N, rng=numpy_gen(1), seed=3)
    with pytest.raises(PartitionError, match=r"data.partition.options.bogus: unknown option"):
        f(LABELS, N, rng=numpy_gen(1), bogus=3)


def test_flwr_names_in_the_config():
    cfg = load_config("configs/quickstart.yaml", [
        "data.partition=flwr:DirichletPartitioner", "data.partition.options.alpha=0.5",
        "data.partition.options.min_samples=10", "data.partition.options={alpha: 0.3}"])
    assert cfg.data.partition.options == {"alpha": 0.3}
    with pytest.raises(ConfigError, match=r"data.partition.name: flwr-datasets has no "
                                          r"partitioner 'Nope'"):
        load_config("configs/quickstart.yaml", ["data.partition=flwr:Nope"])
