"""Paired comparisons (fedloom.report.stats): properties, then golden values."""

import math

import numpy as np
import pytest

from fedloom.report.stats import paired

# t_{0.975, 2} = 4.302652729911275 (Student's t, 2 degrees of freedom; tables give 4.303).
T2 = 4.302652729911275


def test_golden_t_interval_three_seeds():
    # d = (1, 2, 3): mean 2, sd 1, half-width T2 / sqrt(3) = 2.4841 -> [-0.484, 4.484]
    r = paired({1: 2.0, 2: 3.0, 3: 4.0}, {1: 1.0, 2: 1.0, 3: 1.0})
    assert r.n == 3 and r.mean == pytest.approx(2.0)
    assert r.low == pytest.approx(2 - T2 / math.sqrt(3))
    assert r.high == pytest.approx(2 + T2 / math.sqrt(3))
    assert r.verdict == "no evidence"  # the interval holds 0: three seeds do not support it
    # d = (1, 1.1, 0.9): sd 0.1, half-width 0.248 -> wholly above 0
    r = paired({1: 1.0, 2: 1.1, 3: 0.9}, {1: 0.0, 2: 0.0, 3: 0.0})
    assert r.verdict == "better" and r.low == pytest.approx(1 - 0.1 * T2 / math.sqrt(3))
    assert "better +1.0" in r.text() and "(3 seeds)" in r.text()


def test_antisymmetric_and_translation_invariant():
    rng = np.random.default_rng(0)
    a = {s: float(v) for s, v in enumerate(rng.normal(0.7, 0.05, 6))}
    b = {s: float(v) for s, v in enumerate(rng.normal(0.6, 0.05, 6))}
    ab, ba = paired(a, b), paired(b, a)
    assert ab.mean == pytest.approx(-ba.mean)
    assert (ab.low, ab.high) == pytest.approx((-ba.high, -ba.low))
    assert {ab.verdict, ba.verdict} in ({"better", "worse"}, {"no evidence"})
    shifted = paired({s: v + 1e3 for s, v in a.items()}, {s: v + 1e3 for s, v in b.items()})
    assert shifted.mean == pytest.approx(ab.mean, abs=1e-9)
    assert shifted.verdict == ab.verdict


def test_lower_is_better_flips_the_verdict_not_the_numbers():
    a, b = {1: 0.10, 2: 0.11, 3: 0.09}, {1: 0.20, 2: 0.21, 3: 0.19}
    hi, lo = paired(a, b, better="higher"), paired(a, b, better="lower")
    assert hi.verdict == "worse" and lo.verdict == "better"
    assert hi.mean == lo.mean and hi.low == lo.low


def test_pairs_only_shared_finite_seeds_and_names_the_rest():
    a = {1: 0.5, 2: float("nan"), 3: 0.7, 4: 0.9, 5: 1e308}
    b = {1: 0.4, 2: 0.1, 3: 0.6, 6: 0.2, 5: -1e308}  # 5: the difference overflows
    r = paired(a, b)
    assert r.seeds == (1, 3) and r.n == 2
    assert set(r.dropped) == {2, 4, 5, 6}
    assert math.isfinite(r.low) and math.isfinite(r.high)


def test_one_or_no_pair_is_never_evidence():
    one = paired({1: 0.9}, {1: 0.1})
    assert one.verdict == "no evidence" and math.isnan(one.low) and "no interval" in one.text()
    none = paired({1: 0.9}, {2: 0.1})
    assert none.n == 0 and none.verdict == "no evidence" and none.text() == "no pairs"


def test_identical_differences_give_a_point_interval():
    r = paired({1: 0.6, 2: 0.7}, {1: 0.5, 2: 0.6})
    assert r.low == pytest.approx(0.1) and r.high == pytest.approx(0.1)
    assert r.verdict == "better"
    same = paired({1: 0.6, 2: 0.7}, {1: 0.6, 2: 0.7})
    assert same.verdict == "no evidence" and same.mean == 0.0


def test_margin_gives_equivalence_only_inside_it():
    a = {1: 0.800, 2: 0.801, 3: 0.799, 4: 0.800}
    b = {1: 0.799, 2: 0.801, 3: 0.800, 4: 0.800}
    assert paired(a, b, margin=0.01).verdict == "equivalent"
    assert paired(a, b, margin=1e-5).verdict == "no evidence"
    assert paired(a, b).verdict == "no evidence"


def test_t_interval_covers_at_its_level():
    # 4000 experiments of 3 normal differences: the 95 % interval holds the true mean in
    # 95 % of them (binomial sd 0.34 pp); a z-interval would cover about 88 %.
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(4000):
        d = rng.normal(0.3, 1.0, 3)
        r = paired(dict(enumerate(d)), dict(enumerate(np.zeros(3))))
        hits += r.low <= 0.3 <= r.high
    assert 0.935 < hits / 4000 < 0.965


def test_bootstrap_falls_back_to_t_below_ten_pairs_and_is_seeded():
    a, b = {s: 0.5 + 0.01 * s for s in range(5)}, {s: 0.5 for s in range(5)}
    assert paired(a, b, method="bootstrap").method == "t"
    rng = np.random.default_rng(3)
    d = rng.normal(0.2, 0.1, 30)
    a, b = dict(enumerate(d)), dict(enumerate(np.zeros(30)))
    r1, r2 = paired(a, b, method="bootstrap"), paired(a, b, method="bootstrap")
    t = paired(a, b)
    assert r1.method == "bootstrap" and (r1.low, r1.high) == (r2.low, r2.high)
    assert r1.low < r1.mean < r1.high
    assert abs((r1.high - r1.low) - (t.high - t.low)) < 0.5 * (t.high - t.low)


@pytest.mark.parametrize("kw", [{"better": "up"}, {"method": "z"}, {"level": 1.5},
                                {"margin": -1.0}, {"margin": float("nan")}])
def test_bad_arguments_name_the_field(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        paired({1: 1.0}, {1: 0.0}, **kw)
