"""Bulyan, geometric median, centered clipping and the pre-aggregation steps (NNM,
bucketing): golden values (derivations beside them), the refusals (one line), the
chain in a run (config, checkpoint and resume, a NaN client rejected and counted).
The comparisons with ByzFL and Flower are in test_byzfl_equality.py; the shared
properties in test_aggregator_conformance.py and test_aggregator_properties.py."""

from fractions import Fraction

import numpy as np
import pytest
import torch

import fedloom
from conftest import round_with_a_nan_client, stop_and_resume
from fedloom import CohortInfo, make_aggregator
from fedloom.aggregate.bucketing import Bucketing, bucket_means
from fedloom.aggregate.bulyan import closest_to_median
from fedloom.aggregate.nnm import NNM
from fedloom.aggregate.pre import PreAggregated, build_chain
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment

ONE = torch.ones


def _t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def _call(agg, rows, state=None, info=None):
    U = _t(rows)
    return agg(U, ONE(len(rows), dtype=torch.float64), state, info=info)


def _info(m, round=0):
    return CohortInfo(clients=torch.arange(10, 10 + m), round=round, num_clients=50,
                      losses=ONE(m, dtype=torch.float64), steps=torch.full((m,), 3),
                      start_losses=ONE(m, dtype=torch.float64))


# ------------------------------------------------------------------------------ Bulyan
def test_closest_to_median_golden_and_ties_shared():
    # column [1, 2, 4, 6]: median (2 + 4)/2 = 3, distances 2, 1, 1, 3
    col = _t([[1], [2], [4], [6]])
    # β = 3: 2 and 4 (distance 1) and 1 (distance 2) → (2 + 4 + 1)/3 = 7/3
    assert closest_to_median(col, 3).item() == pytest.approx(7 / 3, abs=1e-15)
    # β = 1: 2 and 4 tie at distance 1 and share the one place → (2 + 4)/2 = 3
    assert closest_to_median(col, 1).item() == 3.0
    # odd θ: [0, 5, 6, 7, 100], median 6, β = 3 → 5, 6, 7 → 6
    assert closest_to_median(_t([[0], [5], [6], [7], [100]]), 3).item() == 6.0


def test_bulyan_never_lets_far_attackers_in():
    # 9 honest rows near 1, f = 1 attacker far away (n = 10 ≥ 4f + 3): each coordinate
    # lies within the honest rows' range (θ = 8 chosen by Krum, then β = 6 around the median)
    gen = torch.Generator().manual_seed(0)
    honest = 1.0 + 0.1 * torch.randn(9, 20, generator=gen, dtype=torch.float64)
    rows = torch.cat([honest, torch.full((1, 20), -1e6, dtype=torch.float64)])
    out, _, m = make_aggregator("bulyan", f=1)(rows, ONE(10, dtype=torch.float64), None)
    assert bool((out >= honest.min(0).values).all() and (out <= honest.max(0).values).all())
    assert m == {"bulyan_selected": 8.0, "bulyan_beta": 6.0}


def test_bulyan_refuses_too_few_updates_in_one_line():
    with pytest.raises(ValueError, match=r"^bulyan: f = 2 needs n >= 4f \+ 3 = 11 updates, "
                                         r"got 10$"):
        _call(make_aggregator("bulyan", f=2), [[float(i)] for i in range(10)])


# -------------------------------------------------------------------- geometric median
def test_geometric_median_one_step_golden():
    # points 0, 1, 10; z0 = mean = 11/3; distances 11/3, 8/3, 19/3; β_i ∝ 1/d_i:
    # z1 = (0·3/11 + 1·3/8 + 10·3/19) / (3/11 + 3/8 + 3/19) = (1/8 + 10/19) / (1/11 + 1/8 + 1/19)
    want = (Fraction(1, 8) + Fraction(10, 19)) / (Fraction(1, 11) + Fraction(1, 8)
                                                  + Fraction(1, 19))
    out, _, _ = _call(make_aggregator("geometric_median", iterations=1), [[0], [1], [10]])
    assert out.item() == pytest.approx(float(want), rel=1e-15)
    # start: zero, one step: distances 0→ν (smoothed), 1, 10: β ∝ 1/ν, 1, 1/10 →
    # z1 = (1 + 10/10) / (1/ν + 1 + 1/10) with ν = 0.5
    out, _, _ = _call(make_aggregator("geometric_median", iterations=1, start="zero", nu=0.5),
                      [[0], [1], [10]])
    assert out.item() == pytest.approx(2 / (2 + 1 + 0.1), rel=1e-15)


def test_geometric_median_converges_to_the_median():
    # 1-d: the geometric median of 0, 1, 10 is the median 1; of an equilateral
    # triangle, its centre (all angles < 120°: the Fermat point)
    out, _, _ = _call(make_aggregator("geometric_median", iterations=200, nu=1e-12),
                      [[0], [1], [10]])
    assert out.item() == pytest.approx(1.0, abs=1e-6)
    tri = [[0.0, 0.0], [2.0, 0.0], [1.0, 3 ** 0.5]]
    out, _, _ = _call(make_aggregator("geometric_median", iterations=200, nu=1e-12), tri)
    assert out.tolist() == pytest.approx([1.0, 3 ** 0.5 / 3], abs=1e-9)
    # a far outlier moves it by little; the mean by a lot
    out, _, _ = _call(make_aggregator("geometric_median", iterations=50),
                      [[0], [1], [2], [1e9]])
    assert 1.0 <= out.item() <= 2.0


def test_geometric_median_weighted_is_rfa():
    # weighted: z0 = (0·1 + 1·1 + 10·8)/10 = 8.1; the weighted median (weight 8 of 10 at
    # 10) is 10; unweighted (the default) it is 1: a claimed count buys no influence
    agg = make_aggregator("geometric_median", weighted=True, iterations=0)
    U, n = _t([[0], [1], [10]]), _t([1, 1, 8])
    assert agg(U, n, None)[0].item() == pytest.approx(8.1, rel=1e-15)
    agg = make_aggregator("geometric_median", weighted=True, iterations=300, nu=1e-12)
    assert agg(U, n, None)[0].item() == pytest.approx(10.0, abs=1e-6)
    agg = make_aggregator("geometric_median", iterations=300, nu=1e-12)
    assert agg(U, n, None)[0].item() == pytest.approx(1.0, abs=1e-6)


# -------------------------------------------------------------------- centered clipping
def test_centered_clipping_golden_over_two_rounds():
    agg = make_aggregator("centered_clipping", tau=2.0)
    # round 1, centre 0: differences 0, 1, 10 → clipped 0, 1, 2 → v = 0 + 3/3 = 1
    out, state, m = _call(agg, [[0], [1], [10]])
    assert out.item() == 1.0 and state.item() == 1.0 and m["cclip_clipped"] == 1.0
    # round 2, centre 1: rows 1, 2, −20: differences 0, 1, −21 → 0, 1, −2 → v = 1 − 1/3
    out, state, _ = _call(agg, [[1], [2], [-20]], state)
    assert out.item() == pytest.approx(2 / 3, abs=1e-15) and torch.equal(out, state)
    # L = 2 on round 1: v1 = 1, then differences −1, 0, 9 → −1, 0, 2 → v2 = 1 + 1/3
    out, _, _ = _call(make_aggregator("centered_clipping", tau=2.0, iterations=2),
                      [[0], [1], [10]])
    assert out.item() == pytest.approx(4 / 3, abs=1e-15)


def test_centered_clipping_bounds_an_attacker_pull():
    # one attacker of any size moves the centre by at most τ/n a step
    agg = make_aggregator("centered_clipping", tau=1.0)
    out, _, _ = _call(agg, [[0.0], [0.0], [0.0], [1e12]])
    assert out.item() == 0.25
    # huge rows: the norms do not overflow (1e200² would): clipped to τ, not to 0
    out, _, _ = _call(agg, [[1e200], [1e200]])
    assert out.item() == 1.0


# --------------------------------------------------------------------------- NNM
def test_nnm_golden_and_refusal():
    # f = 1, n = 4: each row's n − f = 3 nearest (itself included):
    # 0 → {0, 1, 3}, 1 → {1, 0, 3}, 3 → {3, 1, 0} (10 is 7 away), 10 → {10, 3, 1}
    out, _w, info, m = NNM(f=1)(_t([[0], [1], [3], [10]]), ONE(4, dtype=torch.float64),
                               _info(4))
    assert out.flatten().tolist() == pytest.approx([4 / 3, 4 / 3, 4 / 3, 14 / 3], abs=1e-15)
    assert m == {"nnm_neighbours": 3.0} and info.losses is not None
    with pytest.raises(ValueError, match=r"^nnm: f = 2 needs more than 2f = 4 updates, got 4$"):
        NNM(f=2)(_t([[0], [1], [3], [10]]), ONE(4, dtype=torch.float64), _info(4))


# ----------------------------------------------------------------------- bucketing
def test_bucket_means_golden():
    # rows 0, 10, 20, 30, 40 in the order 1, 0, 4, 3, 2, s = 2:
    # (10 + 0)/2 = 5, (40 + 30)/2 = 35, the last bucket 20 alone
    out = bucket_means(_t([[0], [10], [20], [30], [40]]), torch.tensor([1, 0, 4, 3, 2]), 2)
    assert out.flatten().tolist() == [5.0, 35.0, 20.0]


def test_bucketing_draws_from_seed_and_round():
    rows, n = _t([[float(i)] for i in range(7)]), _t([1, 2, 3, 4, 5, 6, 7])
    a = Bucketing(s=3, seed=5)(rows, n, _info(7, round=2))
    b = Bucketing(s=3, seed=5)(rows, n, _info(7, round=2))
    c = Bucketing(s=3, seed=5)(rows, n, _info(7, round=3))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    out, w, info, m = a
    assert out.shape == (3, 1) and m == {"bucketing_buckets": 3.0}
    assert float(w.sum()) == 28.0 and info.losses is None and info.start_losses is None
    # every bucket mean is the mean of its members (the rows are 0 … 6, weights i + 1)
    assert float((out.flatten() * _t([3, 3, 1])).sum()) == 21.0


def test_bucketing_refuses_a_rule_that_needs_each_clients_numbers():
    with pytest.raises(ValueError, match=r"^server\.pre_aggregation\[0\]: Bucketing mixes "
                                         r"clients into groups; the aggregator needs each "
                                         r"client's start_losses$"):
        PreAggregated(make_aggregator("qfedavg"), [Bucketing(s=2)])
    PreAggregated(make_aggregator("qfedavg"), [NNM(f=1)])  # NNM keeps one row a client


@pytest.mark.parametrize("make", [
    lambda: make_aggregator("bulyan"), lambda: make_aggregator("geometric_median"),
    lambda: make_aggregator("centered_clipping"),
    lambda: PreAggregated(make_aggregator("median"), [NNM(f=1)]),
    lambda: PreAggregated(make_aggregator("median"), [Bucketing(s=2)])])
def test_a_non_finite_row_is_refused_in_one_line(make):
    rows = [[0.0, 1.0], [1.0, float("nan")], [2.0, 2.0], [3.0, 1.0], [1.0, 1.0]]
    with pytest.raises(ValueError, match=r"^[a-z_]+: an update is not finite$"):
        _call(make(), rows, info=_info(5))


# ------------------------------------------------------------------- config and runs
def test_pre_aggregation_config_errors_name_the_entry(tiny):
    for entry, msg in (
            ({"name": "nmm"}, r"server\.pre_aggregation\[0\]\.name: unknown preaggregator"),
            ({"name": "nnm", "options": {"g": 1}}, r"server\.pre_aggregation\[0\]\.options\.g"),
            ({"name": "bucketing", "options": {"seed": 1}},
             r"server\.pre_aggregation\[0\]\.options\.seed: not an option"),
            ({"name": "nnm", "option": {}}, r"server\.pre_aggregation\[0\]\.option: unknown"),
            ("nnm", r"server\.pre_aggregation\[0\]: must be a mapping")):
        tiny["server"] = {"pre_aggregation": [entry]}
        with pytest.raises(ConfigError, match=msg):
            load_config(tiny)
    tiny["server"] = {"pre_aggregation": [{"name": "nnm"}]}
    for over, why in ((["server.secure_aggregation=true"], "masked sum"),
                      (["privacy.mode=central", "privacy.noise_multiplier=1.0"], "central")):
        with pytest.raises(ConfigError, match=rf"^server\.pre_aggregation: .*{why}"):
            load_config(tiny, over)
    load_config(tiny, ["privacy.mode=local", "privacy.noise_multiplier=1.0"])  # composes
    with pytest.raises(ValueError, match=r"server\.pre_aggregation\[0\]\.options\.s: must be"):
        build_chain(make_aggregator("median"), [{"name": "bucketing", "options": {"s": 0}}], 0)
    with pytest.raises(ValueError, match=r"^server\.pre_aggregation\[1\]\.options\.chunk: must"):
        build_chain(make_aggregator("median"),
                    [{"name": "nnm"}, {"name": "nnm", "options": {"chunk": 0}}], 0)


def test_chain_runs_resumes_bit_identical_and_records(tiny, tmp_path):
    # bucketing (a per-round draw), then NNM, then centered clipping (a server state):
    # stopped after round 2 and resumed from the checkpoint = the run straight through
    tiny["server"] = {"pre_aggregation": [{"name": "bucketing", "options": {"s": 2}},
                                          {"name": "nnm", "options": {"f": 0}}]}
    tiny["aggregator"] = {"name": "centered_clipping", "options": {"tau": 0.5}}
    ref, res = stop_and_resume(tiny, [], tmp_path / "r", stop_after=2)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    assert ref.metrics[0]["bucketing_buckets"] == 2.0
    assert "cclip_clipped" in ref.metrics[-1] and ref.metrics[-1]["nnm_neighbours"] == 2.0
    cfg = load_config(tmp_path / "r" / "config.yaml")
    assert cfg.server.pre_aggregation[0]["name"] == "bucketing"


@pytest.mark.parametrize("setting", [
    ["aggregator.name=bulyan"], ["aggregator.name=geometric_median"],
    ["aggregator.name=centered_clipping"], ["aggregator.name=flame"],
    ["aggregator.name=krum", "aggregator.options.f=1"]])
def test_nan_client_rejected_and_counted_before_the_rule(tiny, setting):
    tiny["server"] = {"pre_aggregation": [{"name": "nnm", "options": {"f": 1}}]}
    exp = Experiment.from_config(load_config(tiny, ["rounds=1", *setting]))
    _, m = round_with_a_nan_client(exp)  # cohort position 1 sends a NaN
    assert m["nnm_neighbours"] == 2.0  # NNM on the 3 accepted rows, f = 1


def test_library_entry_point_takes_the_chain():
    agg = PreAggregated(make_aggregator("trimmed_mean", trim=1), [NNM(f=1)])
    out, state, _m = _call(agg, [[0.0], [1.0], [2.0], [100.0]], info=_info(4))
    # NNM f = 1: 0 → {0,1,2} = 1, 1 → 1, 2 → 1, 100 → {100, 2, 1} = 103/3;
    # trimmed mean b = 1: sorted 1, 1, 1, 34.33 → mean(1, 1) = 1
    assert out.item() == pytest.approx(1.0, abs=1e-15) and state is None
    assert fedloom.registry.available("preaggregator") == ["bucketing", "nnm"]


# ------------------------------------------------------------------------------- FLAME
def _flame_cohort(seed, honest=7, bad=3, d=50):
    """Honest rows around one direction, attackers around its opposite (a sign flip)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(d, generator=gen, dtype=torch.float64)
    h = base + 0.3 * torch.randn(honest, d, generator=gen, dtype=torch.float64)
    a = -3 * base + 0.3 * torch.randn(bad, d, generator=gen, dtype=torch.float64)
    return torch.cat([h, a])


def test_flame_admits_the_majority_and_clips_to_the_median_norm():
    rows = _flame_cohort(0)
    out, _, m = make_aggregator("flame", lam=0.0)(rows, ONE(10, dtype=torch.float64), None)
    assert m["flame_admitted"] == 7.0
    # golden: S = the median of the 10 norms (mean of the 5th and 6th), each admitted
    # row scaled by min(1, S/‖g‖), their plain mean
    norms = rows.norm(dim=1)
    S = float(norms.sort().values[4:6].mean())
    want = (rows[:7] * (S / norms[:7]).clamp(max=1.0)[:, None]).mean(0)
    assert m["flame_clip_norm"] == pytest.approx(S, rel=1e-15)
    assert torch.allclose(out, want, rtol=0, atol=1e-14)


def test_flame_clusters_as_hdbscan_on_the_raw_rows():
    # Blades' call (hdbscan's HDBSCAN, metric="cosine", min_cluster_size n//2 + 1,
    # min_samples 1, one cluster allowed) through scikit-learn's port of it
    from sklearn.cluster import HDBSCAN

    from fedloom.aggregate.flame import flame_admitted

    for seed in range(30):
        n_bad = seed % 4
        rows = _flame_cohort(seed, honest=9 - n_bad, bad=n_bad)
        n = rows.shape[0]
        labels = HDBSCAN(min_cluster_size=n // 2 + 1, min_samples=1, allow_single_cluster=True,
                         metric="cosine", copy=True).fit_predict(rows.numpy())
        want = labels == np.bincount(labels[labels >= 0]).argmax()
        assert flame_admitted(rows, n // 2 + 1).numpy().tolist() == want.tolist()


def test_flame_noise_has_its_stated_law_and_draws_from_seed_and_round():
    d, lam = 200_000, 0.01
    rows = torch.ones(5, d, dtype=torch.float64)  # one cluster, S = √d, mean 1
    agg = make_aggregator("flame", lam=lam, seed=3)
    out, _, _ = agg(rows, ONE(5, dtype=torch.float64), None, info=_info(5, round=4))
    noise = out - 1.0
    # std λ S = λ √d; over 2e5 draws the sample std is within 1 % (≈ 0.16 % s.e.)
    assert float(noise.std()) == pytest.approx(lam * d ** 0.5, rel=0.01)
    assert abs(float(noise.mean())) < 5 * lam * d ** 0.5 / d ** 0.5
    again, _, _ = agg(rows, ONE(5, dtype=torch.float64), None, info=_info(5, round=4))
    other, _, _ = agg(rows, ONE(5, dtype=torch.float64), None, info=_info(5, round=5))
    assert torch.equal(out, again) and not torch.equal(out, other)


def test_a_chain_given_as_an_object_records_and_rebuilds():
    from fedloom.recorded import object_name, rebuild, record

    chain = PreAggregated(make_aggregator("krum", f=1), [NNM(f=1), Bucketing(s=2, seed=4)])
    again = rebuild(object_name(chain), record(chain), "aggregator")
    assert type(again.rule).__name__ == "Krum" and again.rule.f == 1
    assert [type(s).__name__ for s in again.steps] == ["NNM", "Bucketing"]
    assert again.steps[1].seed == 4 and record(again) == record(chain)
