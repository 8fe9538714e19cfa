"""One-run privacy auditing: an empirical lower bound on ε from guesses about canaries.

Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023.
Each of ``m`` canaries is included in the run independently with probability 1/2
(``S_i = ±1``); after the run the auditor scores every canary and guesses "in" for
the ``k₊`` highest scores and "out" for the ``k₋`` lowest, ``r = k₊ + k₋`` guesses,
``v`` of them correct. If the run is (ε, δ)-DP in each canary, then (their Theorem
5.2, the δ > 0 form of Theorem 3.1)

    P[W ≥ v] ≤ P[Bin(r, p_ε) ≥ v] + 2mδ · max_{1≤i≤v} P[v > Bin(r, p_ε) ≥ v − i] / i,

``p_ε = e^ε / (1 + e^ε)`` (randomized response's accuracy). :func:`p_value` is that
bound; :func:`epsilon_lower_bound` the largest ε that the observed ``v`` rejects at
level ``β`` (so with probability ≥ 1 − β the run's true ε is at least it), found by
bisection on ε (the bound grows with ε) to :data:`TOLERANCE`. ε = 0 is returned
where no ε > 0 is rejected.

Checked against the paper's Appendix D (``p_value_DP_audit``, ``get_eps_audit``) on
360 (m, r, v, ε, δ) with m ≤ 10⁴, δ ∈ {0, 1e-5, 1e-3}: p-values within 2.8e-17, ε
bounds within 6.7e-6 (its bisection stops at width 1e-5). Tests (tests/test_audit.py):
the tails against exact binomial sums, monotonicity, and a randomized-response
mechanism of known ε whose bound exceeds ε in about β of its trials. How a run's
canaries are drawn and scored is the caller's.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

__all__ = ["TOLERANCE", "epsilon_lower_bound", "p_value"]

TOLERANCE = 1e-6   # the bisection's width on ε
_EPS_MAX = 64.0    # p_ε = 1 − 1.6e-28 there: every count is likely; no bound is above it


def _check(m: int, r: int, v: int, delta: float) -> None:
    for name, x in (("m", m), ("r", r), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, int | np.integer) or x < 0:
            raise ValueError(f"audit: {name} must be an integer ≥ 0, got {x!r}")
    if not v <= r <= m:
        raise ValueError(f"audit: need v ≤ r ≤ m (correct ≤ guesses ≤ canaries), got "
                         f"v={v}, r={r}, m={m}")
    if not (isinstance(delta, int | float) and 0 <= delta < 1 and math.isfinite(delta)):
        raise ValueError(f"audit: delta must be in [0, 1), got {delta!r}")


def p_value(m: int, r: int, v: int, eps: float, delta: float = 0.0) -> float:
    """The bound above on P[W ≥ v] for an (ε, δ)-DP run (at most 1)."""
    _check(m, r, v, delta)
    if not (isinstance(eps, int | float) and eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"audit: eps must be finite and ≥ 0, got {eps!r}")
    p = 1.0 / (1.0 + math.exp(-eps))
    tail = float(stats.binom.sf(v - 1, r, p))  # P[Bin ≥ v]
    if delta == 0.0 or v == 0:
        return min(1.0, tail)
    # P[v > Bin ≥ v − i] for i = 1 … v: cumulative sums of the pmf below v
    below = np.cumsum(stats.binom.pmf(np.arange(v - 1, -1, -1), r, p))
    alpha = float(np.max(below / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, *, delta: float = 0.0,
                        beta: float = 0.05) -> float:
    """The largest ε whose :func:`p_value` for ``v`` correct of ``r`` guesses on ``m``
    canaries is at most ``beta``: with confidence ``1 − beta`` the run is not
    (ε', δ)-DP for any ε' below it. 0 when even ε = 0 is not rejected."""
    _check(m, r, v, delta)
    if not (isinstance(beta, int | float) and 0 < beta < 1):
        raise ValueError(f"audit: beta must be in (0, 1), got {beta!r}")
    if p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    lo, hi = 0.0, _EPS_MAX
    if p_value(m, r, v, hi, delta) <= beta:
        return hi
    while hi - lo > TOLERANCE:
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) <= beta:
            lo = mid
        else:
            hi = mid
    return lo
