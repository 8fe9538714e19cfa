"""Populations generated on demand (fedloom.data.population), the cohort draws that
need no N-sized arrays (fedloom.selection.uniform) and the lazy client-state store
(fedloom.state): a million users cost what the cohort costs."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import fedloom
from conftest import stop_and_resume
from fedloom.config import ConfigError, DataConfig, PartitionConfig
from fedloom.data.federated import build_federated
from fedloom.data.partition import PartitionError
from fedloom.data.population import (
    ClientParts,
    ImagePopulation,
    LeafSynthetic,
    synthetic_population,
)
from fedloom.rng import derive_seed
from fedloom.selection import uniform as uni
from fedloom.state import LAZY_ABOVE, ClientStateStore, FieldSpec

MILLION = 1_000_000


def _leaf(n: int, seed: int = 3, max_size: int = 0) -> LeafSynthetic:
    return LeafSynthetic(n, seed, alpha=1.0, beta=1.0, dim=6, classes=4, max_size=max_size,
                         test_users=3)


def test_user_is_the_same_whatever_the_population_and_order():
    """User k's samples depend on (seed, k) only: not on N, on who was drawn before
    or on a fresh object; users and seeds differ."""
    big, small = _leaf(MILLION), _leaf(5000)
    for k in (4999, 0, 5, 4096):
        xb, yb = big.client(k)
        xs, ys = small.client(k)
        assert np.array_equal(xb, xs) and np.array_equal(yb, ys)
        assert len(xb) == big.size(k) == _leaf(MILLION).size(k)
    assert not np.array_equal(big.client(1)[0][0], big.client(2)[0][0])
    assert not np.array_equal(big.client(1)[0][0], _leaf(MILLION, seed=4).client(1)[0][0])
    x, y = big.client(MILLION - 1)  # the last user exists, the one after does not
    assert x.dtype == np.float32 and y.dtype == np.int64 and x.shape == (len(y), 6)
    with pytest.raises(IndexError, match="user 1000000"):
        big.client(MILLION)


def test_sizes_follow_leaf_and_the_cap():
    """n_k = ⌊lognormal(4, 2)⌋ + 50 by the inverse CDF of one uniform a user: ≥ 50, and
    its quartiles those of NumPy's lognormal(4, 2) draws (e^(4 ± 2·0.674) + 50 ≈ 64.1,
    104.6, 260.3; 20,000 users each, within 8 %); capped by max_size; ``sizes()``
    agrees with ``size(k)``."""
    pop = _leaf(20_000)
    s = np.array(pop.sizes())
    assert len(s) == 20_000 and s.min() >= 50
    assert [pop.size(k) for k in (0, 77, 19_999)] == s[[0, 77, 19_999]].tolist()
    ref = np.random.default_rng(0).lognormal(4, 2, 20_000).astype(np.int64) + 50
    for q, want in ((25, 64.1), (50, 104.6), (75, 260.3)):
        assert abs(np.percentile(s, q) / want - 1) < 0.08
        assert abs(np.percentile(ref, q) / want - 1) < 0.08
    assert max(_leaf(2000, max_size=60).sizes()) == 60


def test_labels_follow_the_user_model():
    """FedProx's generator replayed from the user's stream: u ~ N(0, α), B ~ N(0, β),
    W, b ~ N(u, 1), v ~ N(B, 1), x = v + N(0, diag(j^-1.2)), y = argmax(W x + b); and
    users' label mixes differ (α = 1)."""
    pop = _leaf(100)
    mixes = []
    for k in range(6):
        x, y = pop.client(k)
        g = np.random.default_rng(derive_seed(3, -1, k, "population"))
        u, shift = g.normal(0, 1.0), g.normal(0, 1.0)
        w, b, v = g.normal(u, 1, (4, 6)), g.normal(u, 1, 4), g.normal(shift, 1, 6)
        std = np.sqrt(np.arange(1, 7, dtype=np.float64) ** -1.2)
        want = v + g.standard_normal((len(y), 6)) * std
        assert np.array_equal(x, want.astype(np.float32))
        assert np.array_equal(y, np.argmax(want @ w.T + b, axis=1))
        mixes.append(np.bincount(y, minlength=4) / len(y))
    assert np.ptp(np.array(mixes), axis=0).max() > 0.2


def test_image_population_sizes_and_shapes():
    """Heterogeneous sizes in [min_size, max_size] (power law: heavy tail), images of
    the configured shape, deterministic per user."""
    kw = dict(image_size=8, channels=1, classes=5, size_mu=3.0, size_sigma=1.0,
              size_exponent=1.2, min_size=5, max_size=500, label_alpha=0.3, noise=0.5,
              test_users=2)
    for kind in ("lognormal", "powerlaw"):
        pop = ImagePopulation(50_000, 1, sizes=kind, **kw)
        s = np.array(pop.sizes())
        assert s.min() >= 5 and s.max() <= 500 and s.max() > 10 * np.median(s)
        if kind == "powerlaw":  # P(n ≥ 5·t) = t^(−1.2) for 5·t ≤ 500: t = 4 → 0.189
            assert abs(np.mean(s >= 20) - 4 ** -1.2) < 0.01
        x, y = pop.client(49_999)
        assert x.shape == (pop.size(49_999), 1, 8, 8) and set(y.tolist()) <= set(range(5))
        assert np.array_equal(pop.client(3)[0], ImagePopulation(7, 1, sizes=kind,
                                                                **kw).client(3)[0])


def test_client_parts_are_made_when_asked():
    parts = ClientParts(MILLION, lambda k: k % 7)
    assert len(parts) == MILLION
    assert parts[13].tolist() == list(range(6)) and len(parts[-1]) == (MILLION - 1) % 7
    with pytest.raises(IndexError):
        parts[MILLION]
    assert [len(p) for p in parts[2:5]] == [2, 3, 4]


def test_build_federated_of_a_million_users():
    """No per-user object: the split is lazy; natural split only; the global test
    set is the held-out users'."""
    data = DataConfig(name="synthetic-population", num_clients=MILLION,
                      partition=PartitionConfig(name="natural"),
                      options={"dim": 4, "test_users": 2})
    ds = synthetic_population(data, 0, dim=4, test_users=2)
    fed = build_federated(ds, data, 0)
    assert fed.num_clients == MILLION and len(fed.test[123]) == 0
    assert len(fed.train[123]) == ds.population.size(123)
    assert fed.x_test.shape[1:] == (4,) and len(fed.x_test) == len(fed.y_test) > 0
    for key, value in (("partition", PartitionConfig(name="iid")), ("standardize", True)):
        bad = copy.deepcopy(data)
        setattr(bad, key, value)
        with pytest.raises(PartitionError, match=f"data[.]{key}"):
            build_federated(ds, bad, 0)
    with pytest.raises(ConfigError, match=r"data\.max_samples"):
        synthetic_population(DataConfig(name="synthetic-population", max_samples=5), 0)


# ------------------------------------------------------------------- cohort draws
@pytest.mark.parametrize(("n", "size"), [(5, 10), (100, 10), (10_000, 100), (10_001, 100),
                                         (10_001, 500), (MILLION, 100), (MILLION, 40_000)])
def test_uniform_cohort_is_the_uniform_selectors_draw(n, size):
    """The draw over every client without an array of ids is the uniform selector's
    over ``arange(N)``, bit for bit (both algorithms of NumPy: shuffle and Floyd's)."""
    for r in range(3):
        gen_a, gen_b = np.random.default_rng(r), np.random.default_rng(r)
        want, _ = uni.Uniform().select(r, np.arange(n, dtype=np.int64), size, {}, gen_a)
        assert np.array_equal(uni.uniform_cohort(n, size, gen_b), want)
        assert gen_a.random() == gen_b.random()  # the generators are left alike


def test_poisson_cohort_keeps_the_per_client_draw_up_to_the_threshold():
    """At or below POISSON_DIRECT_MAX the draw is the earlier one: u ~ U[0,1) per client."""
    n, q = uni.POISSON_DIRECT_MAX, 0.001
    cand = np.arange(0, n, 3, dtype=np.int64)
    u = np.random.default_rng(7).random(n)
    assert np.array_equal(uni.poisson_cohort(None, n, q, np.random.default_rng(7)),
                          np.flatnonzero(u < q))
    assert np.array_equal(uni.poisson_cohort(cand, n, q, np.random.default_rng(7)),
                          cand[u[cand] < q])


def test_poisson_cohort_above_the_threshold_has_the_poisson_law(monkeypatch):
    """Binomial count, then a uniform subset: each client included with probability
    q independently; checked over 4,000 draws of N = 50, q = 0.2 (threshold lowered):
    per-client frequency 0.2 ± 4σ (σ = 0.0063), count variance Nq(1 − q) = 8 ± 15 %,
    and the covariance of two clients' inclusions ~ 0 (|r| < 0.07)."""
    monkeypatch.setattr(uni, "POISSON_DIRECT_MAX", 10)
    gen = np.random.default_rng(0)
    inc = np.zeros((4000, 50), dtype=bool)
    for t in range(4000):
        ids = uni.poisson_cohort(None, 50, 0.2, gen)
        assert np.all(np.diff(ids) > 0)  # sorted, distinct
        inc[t, ids] = True
    freq = inc.mean(0)
    assert np.all(np.abs(freq - 0.2) < 4 * 0.0063)
    assert abs(inc.sum(1).var() / 8.0 - 1) < 0.15
    assert abs(np.corrcoef(inc[:, 0], inc[:, 1])[0, 1]) < 0.07
    cand = np.arange(0, 50, 2, dtype=np.int64)  # only the available stay
    got = uni.poisson_cohort(cand, 50, 0.9, np.random.default_rng(1))
    assert set(got.tolist()) <= set(cand.tolist()) and len(got) > 15


# ---------------------------------------------------------------------- lazy store
def test_lazy_store_rows_exist_once_written():
    s = ClientStateStore(10**9, {"c": FieldSpec(3)}, storage="lazy")
    assert s.nbytes() == 0 and s.gather("c", [5, 10**9 - 1]).abs().sum() == 0
    s.scatter("c", [7, 10**9 - 1, 7], torch.tensor([[1.0, 2, 3], [4, 5, 6], [9, 9, 9]]))
    assert s.gather("c", [7, 10**9 - 1, 8]).tolist() == [[9, 9, 9], [4, 5, 6], [0, 0, 0]]
    assert 0 < s.nbytes() <= 1024 * 3 * 4  # one chunk, whatever N
    with pytest.raises(IndexError):
        s.gather("c", [10**9])
    c = s.copy()
    c.scatter("c", [7], torch.zeros(1, 3))
    assert s.gather("c", [7]).tolist() == [[9, 9, 9]]
    snap = s.state_dict()
    back = ClientStateStore(10**9, {"c": FieldSpec(3)}, storage="lazy")
    back.load_state_dict(snap)
    assert back.gather("c", [7, 10**9 - 1]).tolist() == [[9, 9, 9], [4, 5, 6]]
    for bad in ({"lazy_ids": np.array([1, 1]), "lazy_rows": np.zeros((2, 3))},
                {"lazy_ids": np.array([10**9]), "lazy_rows": np.zeros((1, 3))},
                {"lazy_ids": np.array([1]), "lazy_rows": np.zeros((1, 4))}, np.zeros(3)):
        with pytest.raises(ValueError, match="field 'c'"):
            back.load_state_dict({"c": bad})


def test_lazy_store_reads_a_dense_snapshot_and_auto_picks_it():
    dense = ClientStateStore(6, {"c": FieldSpec(2)}, storage="dense")
    dense.scatter("c", [4], torch.tensor([[1.0, -2.0]]))
    lazy = ClientStateStore(6, {"c": FieldSpec(2)}, storage="lazy")
    lazy.load_state_dict(dense.state_dict())
    assert lazy.gather("c", range(6)).tolist() == dense.gather("c", range(6)).tolist()
    assert ClientStateStore(LAZY_ABOVE, {"c": FieldSpec(2)}).kinds["c"] == "dense"
    assert ClientStateStore(LAZY_ABOVE + 1, {"c": FieldSpec(2)}).kinds["c"] == "lazy"


# ------------------------------------------------------------------------- runs
def _cfg(dim: int = 3) -> dict:
    return {"seed": 1, "rounds": 3, "dtype": "float64",
            "data": {"name": "synthetic-population", "num_clients": MILLION,
                     "partition": {"name": "natural"},
                     "options": {"dim": dim, "classes": 3, "max_size": 70, "test_users": 4}},
            "model": {"name": "mlp", "options": {"hidden": []}},
            "cohort": {"size": 4}, "eval": {"every": 3}, "checkpoint": {"every": 1},
            "client": {"lr": 0.05, "batch_size": 16, "steps": 2,
                       "method": {"name": "scaffold"}}}


@pytest.mark.parametrize("storage", ["auto", "memmap"])
def test_a_million_users_run_and_resume(tmp_path, storage):
    """SCAFFOLD over 10⁶ users: the store holds the sampled clients' rows only (lazy:
    at most rounds × cohort rows; memmap: a sparse file), and a stopped run resumed
    from its checkpoint ends with the uninterrupted run's model."""
    over = [f"state.storage={storage}"]
    ref, res = stop_and_resume(_cfg(), over, tmp_path / storage)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    assert res.metrics[-1]["test_acc"] == ref.metrics[-1]["test_acc"]


@pytest.mark.slow  # two spawned workers: ~20 s here
def test_process_backend_ships_generated_users():
    """Workers get each user's generated samples with its job: the sequential bits."""
    cfg = _cfg()
    cfg["rounds"], cfg["checkpoint"] = 2, {"every": 0}
    ref = fedloom.run(cfg)
    res = fedloom.run(cfg, ["backend=process", "backend.options.workers=2"])
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]


def test_population_refuses_per_client_transforms():
    with pytest.raises(ConfigError, match=r"data\.feature\.name"):
        fedloom.run(_cfg(), ["data.feature.name=noise", "data.feature.scale=0.1"])
