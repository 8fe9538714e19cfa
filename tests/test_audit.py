"""The one-run audit's bound (fedloom.audit): exact tails, monotone, valid on a
mechanism of known ε, and loud on bad input."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fedloom.audit import epsilon_lower_bound, p_value


def _tail(r: int, v: int, p: float) -> float:
    # P[Bin(r, p) ≥ v] summed term by term with exact binomial coefficients
    return sum(math.comb(r, k) * p**k * (1 - p) ** (r - k) for k in range(v, r + 1))


@pytest.mark.parametrize("r,v,eps", [(10, 7, 0.5), (20, 20, 2.0), (30, 12, 1.0), (15, 0, 3.0)])
def test_pure_dp_p_value_is_the_binomial_tail(r, v, eps):
    p = math.exp(eps) / (1 + math.exp(eps))
    assert p_value(100, r, v, eps) == pytest.approx(_tail(r, v, p), rel=1e-12, abs=1e-15)


def test_the_delta_term_is_2m_delta_times_the_largest_mean_of_the_tail_below_v():
    m, r, v, eps, delta = 50, 12, 9, 0.7, 1e-4
    p = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, k) * p**k * (1 - p) ** (r - k) for k in range(r + 1)]
    alpha = max(sum(pmf[v - i:v]) / i for i in range(1, v + 1))
    want = _tail(r, v, p) + 2 * m * delta * alpha
    assert p_value(m, r, v, eps, delta) == pytest.approx(want, rel=1e-12)


def test_monotone_in_eps_correct_guesses_confidence_and_delta():
    m, r = 1000, 200
    ps = [p_value(m, r, 150, e, 1e-5) for e in np.linspace(0, 6, 25)]
    assert all(a <= b for a, b in itertools.pairwise(ps))
    lbs = [epsilon_lower_bound(m, r, v, delta=1e-5) for v in range(100, 201, 10)]
    assert all(a <= b for a, b in itertools.pairwise(lbs))
    assert lbs[0] == 0.0  # chance-level guesses reject nothing
    assert epsilon_lower_bound(m, r, 180, beta=0.01) < epsilon_lower_bound(m, r, 180, beta=0.05)
    assert epsilon_lower_bound(m, r, 180, delta=1e-3) < epsilon_lower_bound(m, r, 180)


def test_the_bound_is_at_most_beta_likely_to_exceed_a_mechanisms_true_eps():
    # Randomized response with ε0: each canary's guess is right with p(ε0), the
    # worst case of an ε0-DP run. The bound may pass ε0 with probability ≤ β = 0.05:
    # over 400 trials, 20 expected at most; 35 is 3.5 binomial σ above that.
    eps0, m, trials = 1.0, 500, 400
    gen = np.random.default_rng(0)
    right = gen.random((trials, m)) < math.exp(eps0) / (1 + math.exp(eps0))
    over = sum(epsilon_lower_bound(m, m, int(v)) > eps0 for v in right.sum(axis=1))
    assert over <= 35


def test_a_run_without_noise_is_caught_above_a_small_claimed_eps():
    # every guess right: a mechanism claiming ε = 1 is refuted (bound ≈ 5.8 for
    # m = r = 1000 at β = 0.05: p^1000 ≤ 0.05, the most one run of 1000 can show)
    lb = epsilon_lower_bound(1000, 1000, 1000)
    assert 5.5 < lb < 6.5
    assert p_value(1000, 1000, 1000, 1.0) < 1e-100


@pytest.mark.parametrize("args,field", [
    ((10, 5, 6), "v ≤ r ≤ m"), ((10, 11, 5), "v ≤ r ≤ m"), ((-1, 0, 0), "m"),
    ((10, 5.0, 2), "r"), ((10, 5, True), "v"),
])
def test_bad_counts_are_one_line(args, field):
    with pytest.raises(ValueError, match="audit: ") as e:
        epsilon_lower_bound(*args)
    assert field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kw,field", [({"delta": 1.0}, "delta"), ({"delta": float("nan")}, "delta"),
                                      ({"beta": 0.0}, "beta"), ({"beta": 1.5}, "beta")])
def test_bad_levels_are_one_line(kw, field):
    with pytest.raises(ValueError, match=f"audit: {field}"):
        epsilon_lower_bound(100, 50, 40, **kw)
    with pytest.raises(ValueError, match="audit: eps"):
        p_value(100, 50, 40, float("inf"))
