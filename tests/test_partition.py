import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedloom.data.partition import PartitionError, dirichlet, iid, natural, shards


def _labels(n, classes, seed):
    return np.random.default_rng(seed).integers(0, classes, n)


def _check_partition(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n, "covering: every sample is assigned"
    assert len(np.unique(allidx)) == n, "disjoint: no sample is assigned twice"
    assert all(np.all(np.diff(p) > 0) for p in parts)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(200, 2000),
    classes=st.integers(2, 10),
    clients=st.integers(2, 15),
    alpha=st.floats(0.05, 10.0),
    seed=st.integers(0, 2**31),
)
def test_dirichlet_disjoint_covering_min_and_seed_stable(n, classes, clients, alpha, seed):
    labels = _labels(n, classes, seed)
    min_samples = 5
    try:
        parts = dirichlet(labels, clients, rng=np.random.default_rng(seed), alpha=alpha,
                          min_samples=min_samples, max_tries=200)
    except PartitionError as e:
        assert "min_samples" in str(e)  # a clear error, never a hang
        return
    _check_partition(parts, n)
    assert min(len(p) for p in parts) >= min_samples
    again = dirichlet(labels, clients, rng=np.random.default_rng(seed), alpha=alpha,
                      min_samples=min_samples, max_tries=200)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(50, 1000), clients=st.integers(1, 20), seed=st.integers(0, 2**31))
def test_iid_and_shards_properties(n, clients, seed):
    labels = _labels(n, 10, seed)
    for fn, kw in ((iid, {}), (shards, {"shards_per_client": 2})):
        parts = fn(labels, clients, rng=np.random.default_rng(seed), **kw)
        _check_partition(parts, n)
        assert len(parts) == clients
        again = fn(labels, clients, rng=np.random.default_rng(seed), **kw)
        assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_different_seed_gives_different_split():
    labels = _labels(1000, 10, 0)
    for fn, kw in ((iid, {}), (shards, {}), (dirichlet, {"alpha": 0.5})):
        a = fn(labels, 10, rng=np.random.default_rng(1), **kw)
        b = fn(labels, 10, rng=np.random.default_rng(2), **kw)
        assert any(not np.array_equal(x, y) for x, y in zip(a, b, strict=True)), fn.__name__


def test_shards_give_few_labels_per_client():
    labels = np.repeat(np.arange(10), 100)
    parts = shards(labels, 50, rng=np.random.default_rng(0), shards_per_client=2)
    assert max(len(np.unique(labels[p])) for p in parts) <= 2


def test_dirichlet_small_alpha_is_skewed():
    labels = _labels(5000, 10, 0)
    parts = dirichlet(labels, 20, rng=np.random.default_rng(0), alpha=0.1, min_samples=10)
    # With alpha = 0.1 a typical client holds most of its data in one or two classes.
    top = [np.bincount(labels[p], minlength=10).max() / len(p) for p in parts]
    assert np.median(top) > 0.5


def test_infeasible_partitions_raise_clear_errors():
    labels = _labels(100, 10, 0)
    with pytest.raises(PartitionError, match="exceeds the 100 samples"):
        dirichlet(labels, 20, rng=np.random.default_rng(0), min_samples=10)
    with pytest.raises(PartitionError, match="no split in 5 tries"):
        # feasible in count, but alpha = 0.01 almost never gives everyone 9 samples
        dirichlet(labels, 10, rng=np.random.default_rng(0), alpha=0.01, min_samples=9,
                  max_tries=5)
    with pytest.raises(PartitionError, match="exceed"):
        shards(labels, 60, rng=np.random.default_rng(0), shards_per_client=2)
    with pytest.raises(PartitionError, match="natural clients"):
        natural(labels, 3, rng=np.random.default_rng(0), groups=np.arange(100) % 4)


def test_natural_keeps_groups_together():
    groups = np.array([2, 0, 2, 1, 0, 1, 1])
    parts = natural(np.zeros(7), 3, rng=np.random.default_rng(0), groups=groups)
    assert [p.tolist() for p in parts] == [[1, 4], [3, 5, 6], [0, 2]]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(500, 3000), clients=st.integers(5, 60), seed=st.integers(0, 2**31),
       balance=st.booleans())
def test_dirichlet_move_policy_always_meets_minimum(n, clients, seed, balance):
    """CRAFT's code: keep the best draw, move samples from the largest clients, balance."""
    labels = _labels(n, 10, seed)
    min_samples = max(1, min(20, n // clients // 2))
    parts = dirichlet(labels, clients, rng=np.random.default_rng(seed), alpha=0.05,
                      min_samples=min_samples, max_tries=3, min_policy="move", balance=balance)
    _check_partition(parts, n)
    sizes = [len(p) for p in parts]
    assert min(sizes) >= min_samples
    if balance:  # every client ends with ⌊n/N⌋ or ⌊n/N⌋ + 1 samples
        assert set(sizes) <= {n // clients, n // clients + 1}
