"""The heterogeneity partitioners (classes, sizes, mixed, per-class Dirichlet α), the
feature-skew transform, the heterogeneity measures, partition.png and `fedloom partition`."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedloom.cli import main
from fedloom.config import ConfigError, load_config
from fedloom.data.feature import apply_feature_skew
from fedloom.data.heterogeneity import class_counts, heterogeneity
from fedloom.data.partition import PartitionError, classes, dirichlet, mixed, sizes


def _labels(n, c, seed):
    return np.random.default_rng(seed).integers(0, c, n)


def _check_partition(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n, "covering: every sample is assigned"
    assert len(np.unique(allidx)) == n, "disjoint: no sample is assigned twice"


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


# ------------------------------------------------------------------ property tests
@settings(max_examples=30, deadline=None)
@given(n=st.integers(100, 800), c=st.integers(2, 10), clients=st.integers(1, 25),
       k=st.integers(1, 10), assign=st.sampled_from(["random", "round_robin"]),
       split=st.sampled_from(["even", "dirichlet"]), seed=st.integers(0, 2**31))
def test_classes_exactly_k_disjoint_covering_seed_stable(n, c, clients, k, assign, split,
                                                          seed):
    labels = _labels(n, c, seed)
    kw = dict(k=k, assign=assign, split=split, alpha=0.5, min_samples=1, max_tries=50)
    try:
        parts = classes(labels, clients, rng=np.random.default_rng(seed), **kw)
    except PartitionError as e:  # a named constraint, never a hang
        msg = str(e)
        assert any(w in msg for w in ("k must be", "cannot cover", "no holder",
                                      "samples for", "min_samples")), msg
        return
    _check_partition(parts, n)
    assert len(parts) == clients
    held = [len(np.unique(labels[p])) for p in parts]
    assert held == [k] * clients, "every client holds exactly k classes"
    assert _same(parts, classes(labels, clients, rng=np.random.default_rng(seed), **kw))


@settings(max_examples=30, deadline=None)
@given(n=st.integers(100, 1500), clients=st.integers(1, 30),
       dist=st.sampled_from(["powerlaw", "lognormal"]), then=st.sampled_from(["iid", "dirichlet"]),
       seed=st.integers(0, 2**31))
def test_sizes_disjoint_covering_minimum_seed_stable(n, clients, dist, then, seed):
    labels = _labels(n, 10, seed)
    kw = dict(distribution=dist, exponent=1.2, sigma=1.5, then=then, alpha=0.3, min_samples=3)
    parts = sizes(labels, clients, rng=np.random.default_rng(seed), **kw)
    _check_partition(parts, n)
    assert min(len(p) for p in parts) >= 3
    assert _same(parts, sizes(labels, clients, rng=np.random.default_rng(seed), **kw))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(200, 1500), clients=st.integers(2, 20), f=st.floats(0, 1),
       seed=st.integers(0, 2**31))
def test_mixed_disjoint_covering_seed_stable(n, clients, f, seed):
    labels = _labels(n, 5, seed)
    kw = dict(iid_fraction=f, then="dirichlet", alpha=0.2, min_samples=1, max_tries=100)
    parts = mixed(labels, clients, rng=np.random.default_rng(seed), **kw)
    _check_partition(parts, n)
    assert len(parts) == clients
    assert _same(parts, mixed(labels, clients, rng=np.random.default_rng(seed), **kw))


def test_seeds_give_different_splits():
    labels = _labels(1000, 10, 0)
    for fn, kw in ((classes, {"k": 2}), (sizes, {}), (mixed, {"alpha": 0.3})):
        a = fn(labels, 10, rng=np.random.default_rng(1), **kw)
        b = fn(labels, 10, rng=np.random.default_rng(2), **kw)
        assert not _same(a, b), fn.__name__


# ------------------------------------------------------------- constraint errors
@pytest.mark.parametrize(("fn", "kw", "n", "clients", "words"), [
    (classes, {"k": 11}, 500, 10, "k must be between 1 and the 10 classes"),
    (classes, {"k": 0}, 500, 10, "k must be between"),
    (classes, {"k": 1}, 500, 5, "5 clients x k=1 classes = 5 holders cannot cover"),
    (classes, {"k": 2, "min_samples": 100}, 500, 10, "min_samples"),
    (classes, {"assign": "cyclic"}, 500, 10, "assign must be"),
    (sizes, {"min_samples": 60}, 500, 10, "min_samples 60 = 600 exceeds the 500"),
    (sizes, {"distribution": "list", "counts": [1, 2]}, 500, 10, "one value per client"),
    (sizes, {"counts": [1.0] * 10}, 500, 10, "counts is used by distribution list only"),
    (sizes, {"then": "shards"}, 500, 10, "then must be"),
    (mixed, {"then": "nope"}, 500, 10, "unknown partitioner"),
    (dirichlet, {"alpha": [0.1, 0.2]}, 500, 10, "one value per class (10 classes"),
    (dirichlet, {"alpha": [0.1] * 9 + [0.0]}, 500, 10, "alpha must be > 0"),
    (classes, {"k": 1}, 5, 6, "cannot give 6 clients"),  # more clients than samples
])
def test_impossible_requests_raise_named_constraint(fn, kw, n, clients, words):
    labels = np.arange(n) % 10
    with pytest.raises(PartitionError, match=words.replace("(", r"\(").replace("+", r"\+")):
        fn(labels, clients, rng=np.random.default_rng(0), **kw)


def test_classes_one_sample_too_few_for_its_holders_is_refused_not_looped():
    # class 9 has one sample; round_robin with k=1 over 20 clients gives it 2 holders,
    # deterministically: one draw, refused
    labels = np.concatenate([np.arange(9).repeat(20), [9]])
    with pytest.raises(PartitionError, match="class 9 has 1 samples for 2 holders"):
        classes(labels, 20, rng=np.random.default_rng(0), k=1, assign="round_robin",
                min_samples=1)


# ----------------------------------------------------------------- golden values
def test_classes_round_robin_golden_assignment():
    # client i holds {(2i + j) mod 10 : j < 2} = {2i, 2i+1}; 5 clients, each class once,
    # so each client gets all 30 samples of its two classes
    labels = np.arange(300) % 10
    parts = classes(labels, 5, rng=np.random.default_rng(0), k=2, assign="round_robin")
    assert [sorted(np.unique(labels[p]).tolist()) for p in parts] == \
        [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert [len(p) for p in parts] == [60] * 5


def test_classes_even_split_among_holders():
    # 10 clients, k=1, round robin: class c goes to clients c... only clients c and
    # c+10 would share it — here with 20 clients each class has 2 holders of 50 each
    labels = np.arange(1000) % 10
    parts = classes(labels, 20, rng=np.random.default_rng(3), k=1, assign="round_robin")
    assert [len(p) for p in parts] == [50] * 20


def test_sizes_list_golden():
    # counts [1, 1, 2] on 40 samples, min 0 → 40 · (1/4, 1/4, 1/2) = 10, 10, 20
    parts = sizes(np.arange(40) % 4, 3, rng=np.random.default_rng(0), distribution="list",
                  counts=[1, 1, 2], min_samples=0)
    assert [len(p) for p in parts] == [10, 10, 20]


def test_sizes_powerlaw_is_skewed_and_lognormal_zero_sigma_is_equal():
    labels = _labels(5000, 10, 1)
    g = heterogeneity(class_counts(labels, sizes(labels, 50, rng=np.random.default_rng(0),
                                                 exponent=1.0, min_samples=5)))
    assert g["size_gini"] > 0.3
    eq = sizes(labels, 50, rng=np.random.default_rng(0), distribution="lognormal", sigma=0.0)
    assert {len(p) for p in eq} == {100}


def test_mixed_fraction_of_clients_is_iid():
    labels = np.arange(2000) % 10
    parts = mixed(labels, 20, rng=np.random.default_rng(0), iid_fraction=0.3, then="classes",
                  k=1, min_samples=1)
    # 6 IID clients get 6/20 of the data, 100 each; the 14 others one class each
    assert [len(p) for p in parts[:6]] == [100] * 6
    assert all(len(np.unique(labels[p])) >= 8 for p in parts[:6])
    assert all(len(np.unique(labels[p])) == 1 for p in parts[6:])


def test_dirichlet_per_class_alpha_concentrates_small_alpha_classes():
    labels = np.arange(20000) % 2
    parts = dirichlet(labels, 50, rng=np.random.default_rng(0), alpha=[0.01, 100.0],
                      min_samples=1)
    counts = class_counts(labels, parts, 2)
    # α = 0.01: nearly all of class 0 on a few clients; α = 100: class 1 nearly even
    top = np.sort(counts[:, 0])[::-1]
    assert top[:5].sum() > 0.9 * counts[:, 0].sum()
    assert counts[:, 1].std() / counts[:, 1].mean() < 0.5


def test_scalar_and_list_alpha_give_the_same_split():
    labels = _labels(1000, 4, 2)
    a = dirichlet(labels, 8, rng=np.random.default_rng(5), alpha=0.4, min_samples=1)
    b = dirichlet(labels, 8, rng=np.random.default_rng(5), alpha=[0.4] * 4, min_samples=1)
    assert _same(a, b)


def test_heterogeneity_golden_values():
    # two clients each holding one of two classes: g = (½, ½), p = (1, 0):
    # H = sqrt(1 − sqrt(½)) = 0.541196…, TV = ½(½ + ½) = ½, exp(entropy 0) = 1
    m = heterogeneity(np.array([[10, 0], [0, 10]]))
    assert m["hellinger"] == pytest.approx(np.sqrt(1 - np.sqrt(0.5)))
    assert m["tv"] == pytest.approx(0.5)
    assert m["eff_classes"] == pytest.approx(1.0)
    assert m["classes"] == 1.0 and m["size_gini"] == 0.0
    # IID clients: every distance 0, exp(ln 2) = 2 effective classes
    m = heterogeneity(np.array([[5, 5], [5, 5]]))
    assert m["hellinger"] == pytest.approx(0.0, abs=1e-7) and m["tv"] == 0.0
    assert m["eff_classes"] == pytest.approx(2.0)
    # sizes 1 and 3: Σ|n_i − n_j| = 4 over 2·N²·mean = 2·4·2 = 16 → Gini ¼; CV = 1/2
    m = heterogeneity(np.array([[1, 0], [0, 3]]))
    assert m["size_gini"] == pytest.approx(0.25)
    assert m["size_cv"] == pytest.approx(0.5)


def test_size_gini_equals_the_pairwise_sum_of_differences():
    """The sorted-rank form of the Gini coefficient (no N × N matrix) equals its
    definition Σ_k Σ_l |n_k − n_l| / (2 N² mean(n)), empty clients included."""
    rng = np.random.default_rng(0)
    for n_clients in (1, 2, 7, 300):
        counts = rng.integers(0, 40, size=(n_clients, 3))
        counts[0] = [1, 0, 0]  # at least one sample
        n = counts.sum(axis=1).astype(np.float64)
        want = np.abs(n[:, None] - n[None, :]).sum() / (2 * n_clients ** 2 * n.mean())
        assert heterogeneity(counts)["size_gini"] == pytest.approx(want, rel=1e-12, abs=0)


# ------------------------------------------------------------------ feature skew
def test_feature_skew_is_per_client_seeded_and_leaves_labels():
    x = torch.zeros(40, 1, 4, 4)
    parts = [np.arange(0, 10), np.arange(10, 20), np.arange(20, 30), np.arange(30, 40)]
    noisy = apply_feature_skew(x, parts, "noise", 1.0, seed=7)
    assert torch.equal(noisy, apply_feature_skew(x, parts, "noise", 1.0, seed=7))
    assert not torch.equal(noisy, apply_feature_skew(x, parts, "noise", 1.0, seed=8))
    # NIID-Bench's schedule σ_k = scale·k/(N−1): client 0 untouched, client 3 the most
    stds = [float(noisy[p].std()) for p in parts]
    assert stds[0] == 0.0 and stds[1] < stds[2] < stds[3]
    assert torch.equal(x, torch.zeros(40, 1, 4, 4)), "the input is left as it was"
    img = torch.arange(40 * 16, dtype=torch.float32).reshape(40, 1, 4, 4)
    perm = apply_feature_skew(img, parts, "permute", 1.0, seed=1)
    for p in parts:  # one permutation per client: the same for all its rows
        flat = perm[p].reshape(len(p), -1) - img[p].reshape(len(p), -1)[:, :1]
        assert torch.equal(flat, flat[:1].expand_as(flat))
        assert sorted(perm[p[0]].flatten().tolist()) == sorted(img[p[0]].flatten().tolist())
    rot = apply_feature_skew(img, parts, "rotate", 30.0, seed=1)
    assert rot.shape == img.shape and not torch.equal(rot, img)
    with pytest.raises(ValueError, match="rotate needs images"):
        apply_feature_skew(torch.zeros(4, 3), [np.arange(4)], "rotate", 10.0, seed=0)


# ---------------------------------------------------- config, runs and the CLI
_BASE = ["data.name=digits", "data.num_clients=12", "cohort.size=4", "rounds=1",
         "model.options.hidden=[8]", "eval.every=1", "checkpoint.every=0", "data.partition=classes",
         "data.partition.options.k=2", "data.partition.options.min_samples=5",
         "data.partition.options.alpha=0.5"]


def test_config_refuses_keys_the_partitioner_does_not_take():
    with pytest.raises(ConfigError, match=r"data.partition.options.k: unknown option for "
                                          r"partitioner 'dirichlet'"):
        load_config("configs/quickstart.yaml", ["data.partition.options.k=3"])
    with pytest.raises(ConfigError, match=r"data.feature.name: must be one of"):
        load_config("configs/quickstart.yaml", ["data.feature.name=blur"])
    cfg = load_config("configs/quickstart.yaml", ["data.partition=mixed",
                                                  "data.partition.options.then=classes",
                                                  "data.partition.options.k=3"])
    assert cfg.data.partition.options == {"then": "classes", "k": 3}
    with pytest.raises(ConfigError, match=r"data.partition.options.k: unknown option for "
                                          r"partitioner 'dirichlet'"):  # mixed's then
        load_config("configs/quickstart.yaml", ["data.partition=mixed",
                                                "data.partition.options.k=3"])


def test_run_writes_partition_png_and_measures(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "configs/quickstart.yaml", *_BASE, "data.feature.name=noise",
                 "data.feature.scale=0.5", "--out", str(out), "--quiet"]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["partition_classes"] == 2.0 and s["partition_eff_classes"] <= 2.0
    assert 0 < s["partition_hellinger"] < 1
    assert (out / "partition.png").stat().st_size > 0
    out2 = tmp_path / "run2"
    assert main(["run", "configs/quickstart.yaml", *_BASE, "logging.plots=false",
                 "--out", str(out2), "--quiet"]) == 0
    s2 = json.loads((out2 / "summary.json").read_text())
    assert not (out2 / "partition.png").exists() and "partition_hellinger" in s2
    # the feature skew changes the inputs, not the split
    assert s2["partition_hellinger"] == s["partition_hellinger"]


def test_partition_cli_table_plot_and_bad_input(tmp_path, capsys):
    png = tmp_path / "p.png"
    assert main(["partition", "configs/quickstart.yaml", *_BASE, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "Hellinger (hellinger)" in out and "size Gini (size_gini)" in out
    assert png.stat().st_size > 0
    assert main(["partition", "configs/quickstart.yaml", *_BASE,
                 "data.partition.options.k=20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "data.partition: classes: k must be between" in err[0]
    assert main(["partition", str(tmp_path / "none.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert main(["partition", "configs/quickstart.yaml", *_BASE, "--plot",
                 str(tmp_path / "no" / "p.png")]) == 2
    assert "--plot: folder" in capsys.readouterr().err
