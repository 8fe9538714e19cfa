"""Paired comparisons of two methods over shared seeds, with an interval and a verdict.

Methods of one setting run on the same seeds, and a seed fixes the partition, the
cohorts and the initial model (:mod:`fedloom.rng`): run ``s`` of method A and
run ``s`` of method B see the same clients in the same rounds. A comparison is
therefore made seed by seed, on the differences

    d_s = A_s − B_s,        s ∈ seeds run by both, value finite for both,

and reports their mean ``d̄`` with a two-sided confidence interval: ``t`` (default,
``d̄ ± t_{1−(1−level)/2, n−1} · sd(d) / √n``, ``ddof=1``, Student's t from scipy)
or ``bootstrap`` (scipy's BCa bootstrap of the mean difference; below 10 pairs the
t-interval instead, and the result says so).

The **verdict** is read from the interval, never from the size of the mean:
``equivalent`` when a ``margin`` is given and the interval lies inside
``(−margin, margin)`` (two one-sided tests), else ``better`` or ``worse`` when the
whole interval lies on one side of 0, else ``no evidence`` (always with fewer than 2
pairs). Each interval is per comparison (not adjusted for the number of comparisons
on a page).

Each interval and verdict in full, and zero-width intervals:
docs/howto/sweeps.md (Paired comparisons and claims).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedloom.rng import derive_seed

__all__ = ["VERDICTS", "Paired", "paired", "verdict_of"]

# "inconsistent": a confidence sequence that has missed (fedloom.report.sequential)
VERDICTS = ("better", "worse", "equivalent", "no evidence", "inconsistent")
MIN_BOOTSTRAP = 10


@dataclass(frozen=True)
class Paired:
    """One comparison A − B over shared seeds (module docstring)."""

    mean: float            # d̄, in the metric's units (NaN without pairs)
    low: float             # the interval (NaN with fewer than 2 pairs)
    high: float
    n: int                 # pairs used
    seeds: tuple[Any, ...]
    verdict: str           # one of VERDICTS
    method: str            # "t" or "bootstrap" (what was actually used)
    level: float = 0.95
    dropped: tuple[Any, ...] = ()  # seeds one side lacks or holds a non-finite value for

    def text(self, scale: float = 1.0, unit: str = "", digits: int = 1) -> str:
        """``better +2.1 pp [+0.4, +3.8] (3 seeds)``: the verdict, d̄ and interval."""
        if self.n == 0:
            return "no pairs"
        u = f" {unit}" if unit else ""
        m = f"{self.mean * scale:+.{digits}f}{u}"
        if self.n < 2:
            return f"{self.verdict} {m} (1 seed: no interval)"
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            # a confidence sequence (fedloom.report.sequential) is ℝ while pairs are few
            return f"{self.verdict} {m} (no finite interval yet) ({self.n} seeds)"
        iv = f"[{self.low * scale:+.{digits}f}, {self.high * scale:+.{digits}f}]"
        return f"{self.verdict} {m} {iv} ({self.n} seeds)"


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def check_paired_args(better: str, level: float, margin: float | None) -> None:
    """``ValueError`` naming the argument of a paired comparison that is out of range
    (shared by :func:`paired` and :func:`fedloom.report.sequential.sequential_paired`)."""
    if better not in ("higher", "lower"):
        raise ValueError(f"better: {better!r} (expected higher or lower)")
    if not 0.5 < level < 1.0:
        raise ValueError(f"level: {level} (expected a confidence level in (0.5, 1))")
    if margin is not None and not (_finite(margin) and margin > 0):
        raise ValueError(f"margin: {margin} (expected a positive number)")


def paired(a: Mapping[Any, float], b: Mapping[Any, float], better: str = "higher",
           level: float = 0.95, method: str = "t", margin: float | None = None,
           seed: int = 0) -> Paired:
    """Compare ``a`` and ``b`` ({seed: value}) seed by seed (module docstring).

    ``better``: ``"higher"`` or ``"lower"`` (the direction in which the metric
    improves; the mean and interval are always of ``a − b``).

    >>> r = paired({1: 0.90, 2: 0.85, 3: 0.88}, {1: 0.80, 2: 0.78, 3: 0.79})
    >>> r.n, r.verdict
    (3, 'better')
    >>> r.text(scale=100, unit="pp")
    'better +8.7 pp [+4.9, +12.5] (3 seeds)'
    >>> paired({1: 0.9}, {1: 0.8}).text()
    'no evidence +0.1 (1 seed: no interval)'
    """
    check_paired_args(better, level, margin)
    if method not in ("t", "bootstrap"):
        raise ValueError(f"method: {method!r} (expected t or bootstrap)")
    shared = [s for s in a if s in b]
    # a pair counts when both values and their difference are finite (1e308 − (−1e308)
    # overflows: that pair is dropped and named, not averaged as inf)
    pairs = [s for s in shared if _finite(a[s]) and _finite(b[s])
             and math.isfinite(float(a[s]) - float(b[s]))]
    dropped = tuple(s for s in {**dict.fromkeys(a), **dict.fromkeys(b)} if s not in pairs)
    d = np.asarray([float(a[s]) - float(b[s]) for s in pairs], dtype=np.float64)
    n = int(d.size)
    if n == 0:
        return Paired(math.nan, math.nan, math.nan, 0, (), "no evidence", method, level,
                      dropped)
    mean = float(d.mean())
    if n < 2:
        return Paired(mean, math.nan, math.nan, 1, tuple(pairs), "no evidence", method, level,
                      dropped)
    used = method
    if method == "bootstrap" and n >= MIN_BOOTSTRAP and float(d.std()) > 0:
        from scipy.stats import bootstrap

        rng = np.random.default_rng(derive_seed(seed, purpose="bootstrap"))
        res = bootstrap((d,), np.mean, confidence_level=level, n_resamples=9999,
                        method="BCa", rng=rng)
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    else:
        used = "t"
        from scipy.stats import t as student_t

        half = float(student_t.ppf(0.5 + level / 2, n - 1)) * float(d.std(ddof=1)) / math.sqrt(n)
        low, high = mean - half, mean + half
    return Paired(mean, low, high, n, tuple(pairs), verdict_of(low, high, better, margin),
                  used, level, dropped)


def verdict_of(low: float, high: float, better: str = "higher",
               margin: float | None = None) -> str:
    """The verdict of an interval ``[low, high]`` of ``a − b`` (module docstring); also
    that of the confidence sequence of :mod:`fedloom.report.sequential`.

    >>> verdict_of(0.5, 2.0)
    'better'
    >>> verdict_of(0.5, 2.0, better="lower")
    'worse'
    >>> verdict_of(-0.2, 0.3), verdict_of(-0.2, 0.3, margin=0.5)
    ('no evidence', 'equivalent')
    >>> verdict_of(0.017, 0.022, better="lower"), verdict_of(0.017, 0.022, "lower", 0.05)
    ('worse', 'equivalent')
    """
    if margin is not None and -margin < low and high < margin:
        return "equivalent"
    sign = 1.0 if better == "higher" else -1.0
    lo_s, hi_s = sorted((low * sign, high * sign))
    if lo_s > 0:
        return "better"
    if hi_s < 0:
        return "worse"
    return "no evidence"
