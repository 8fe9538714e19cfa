"""Anytime-valid paired comparisons: a confidence sequence for the mean paired difference.

A sweep with ``seeds: {min, max, batch}`` (:mod:`fedloom.sweep`) looks at each
comparison after every batch of seeds; what holds under such optional stopping is a
**confidence sequence** (CS): intervals with ``P(∃ n ≥ 1: μ ∉ C_n) ≤ α``.

The method: a scale-invariant Gaussian-mixture t-test on the paired differences
``d_i ~ N(μ, σ²)`` i.i.d., σ unknown. For a candidate mean ``m``, with ``r_n =
T² / (n − 1 + T²)`` (``T`` the t-statistic of ``m``), the Bayes factor

    B_n(m) = (1 + nτ²)^(−1/2) · (1 − nτ²/(1 + nτ²) · r_n)^(−n/2),     B_1 = 1

is a nonnegative martingale under ``μ = m`` (Pérez-Ortiz, Lardy, de Heide &
Grünwald 2024, "E-statistics, group invariance and anytime-valid testing", Ann.
Statist.; Wang & Ramdas 2023, "Anytime-valid t-tests and confidence sequences for
Gaussian means with unknown variance"), so by Ville's inequality
``C_n = {m: B_n(m) < 1/α}`` is a CS, a t-interval with a larger critical value:

    C_n = d̄_n ± c_n · s_n / √n,    c_n² = (n − 1) ρ / (1 − ρ),
    ρ = (1 − ((1 + nτ²)^(1/2) / α)^(−2/n)) · (1 + nτ²) / (nτ²),

reported as the running intersection ``C_1 ∩ … ∩ C_n``; ``τ² = 20``; a sequence that
has :func:`missed` reads ``inconsistent``, no verdict. Departures: none from the
papers' e-process; the two-sided CS inverts the symmetric mixture. Derivation, cost,
``τ²``, and the betting CS (:mod:`fedloom.report.betting`): docs/howto/sweeps.md.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedloom.report.stats import Paired, _finite, check_paired_args, verdict_of

__all__ = ["TAU2", "UNDECIDED", "boundary", "confidence_sequence", "missed",
           "sequential_paired", "simulate", "widths_table"]

TAU2 = 20.0  # prior variance of the standardised effect μ/σ (module docstring)
# The looks of the tests' and the docs' stopping rule: seeds 3, 5, 7, 9, 11, then 12.
LOOKS = (3, 5, 7, 9, 11, 12)
NULLS = ("normal", "uniform", "skewed", "strongly-skewed")
# The verdicts that decide nothing: the sequential protocol gives such a cell's pair
# more seeds, and a page does not count it as decided.
UNDECIDED = ("no evidence", "inconsistent")


def boundary(n: Any, level: float = 0.95, tau2: float = TAU2) -> np.ndarray:
    """``c_n``: the CS is ``d̄ ± c_n s/√n`` (module docstring); ``inf`` where it is ℝ."""
    n = np.asarray(n, dtype=np.float64)
    alpha = 1.0 - level
    with np.errstate(divide="ignore", invalid="ignore"):
        log_k = 0.5 * np.log1p(n * tau2) - math.log(alpha)
        rho = -np.expm1(-2.0 * log_k / n) * (1.0 + n * tau2) / (n * tau2)
        c = np.sqrt((n - 1.0) * rho / (1.0 - rho))
    return np.where((n >= 2) & (rho < 1.0), c, np.inf)


def confidence_sequence(d: Any, level: float = 0.95, tau2: float = TAU2
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high) after each of the differences ``d[..., :n]``, n = 1 … N, along
    the last axis (leading axes: independent sequences); low/high are the running
    intersection of the CS (``±inf`` while it is ℝ)."""
    mean, low, high, _ = _running(d, level, tau2)
    return mean, low, high


def latest_intervals(d: Any, level: float = 0.95, tau2: float = TAU2
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high): the CS ``C_n`` of each prefix alone, not intersected with the
    earlier ones. Still anytime-valid (Ville's inequality bounds the chance that *any*
    ``C_n`` misses), wider than the intersection, and never empty."""
    mean, half = _halfwidths(d, level, tau2)
    return mean, mean - half, mean + half


def missed(d: Any, level: float = 0.95, tau2: float = TAU2) -> np.ndarray:
    """Whether the sequence of ``d`` (last axis) has missed by its end: its running
    intersection emptied at some look, or the last mean lies outside it. Under the
    model that has chance ≤ 1 − ``level``; on a page it means the seeds disagree
    (a method that collapses on some of them), and no verdict is read."""
    return _misses(d, level, tau2)[..., -1]


def _misses(d: Any, level: float, tau2: float) -> np.ndarray:
    """:func:`missed` after each prefix."""
    mean, low, high, emptied = _running(d, level, tau2)
    return emptied | ~((low <= mean) & (mean <= high))


def _halfwidths(d: Any, level: float, tau2: float) -> tuple[np.ndarray, np.ndarray]:
    d = np.asarray(d, dtype=np.float64)
    n = np.arange(1, d.shape[-1] + 1, dtype=np.float64)
    mean = np.cumsum(d, axis=-1) / n
    # The variance about the first value (translation-invariant, no cancellation when
    # the values are large and their spread small).
    y = d - d[..., :1]
    ss = np.cumsum(y * y, axis=-1) - np.cumsum(y, axis=-1) ** 2 / n
    sd = np.sqrt(np.maximum(ss, 0.0) / np.maximum(n - 1.0, 1.0))
    c = boundary(n, level, tau2)
    with np.errstate(invalid="ignore"):
        half = np.where(np.isfinite(c), c * sd / np.sqrt(n), np.inf)
    return mean, half


def _running(d: Any, level: float, tau2: float
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(mean, low, high, emptied): the running intersection, and whether it has emptied
    by each look (it then keeps the last non-empty one)."""
    mean, half = _halfwidths(d, level, tau2)
    lo_n, hi_n = mean - half, mean + half
    low, high = np.empty_like(mean), np.empty_like(mean)
    lo = np.full(mean.shape[:-1], -np.inf)
    hi = np.full(mean.shape[:-1], np.inf)
    emptied = np.zeros(mean.shape, dtype=bool)
    gone = np.zeros(mean.shape[:-1], dtype=bool)
    for k in range(mean.shape[-1]):
        nlo, nhi = np.maximum(lo, lo_n[..., k]), np.minimum(hi, hi_n[..., k])
        keep = nlo <= nhi  # an empty intersection keeps the last non-empty one
        gone = gone | ~keep
        lo, hi = np.where(keep, nlo, lo), np.where(keep, nhi, hi)
        low[..., k], high[..., k], emptied[..., k] = lo, hi, gone
    return mean, low, high, emptied


def _seed_order(s: Any) -> tuple[int, Any]:
    return (0, s) if isinstance(s, int) and not isinstance(s, bool) else (1, str(s))


def sequential_paired(a: Mapping[Any, float], b: Mapping[Any, float], better: str = "higher",
                      level: float = 0.95, margin: float | None = None) -> Paired:
    """:func:`fedloom.report.stats.paired` with the confidence sequence in place of the
    t-interval: the differences in seed order (integers ascending), the verdict read
    from the CS after the last shared seed (``method="cs"``); ``inconsistent`` when
    the sequence has :func:`missed` (no verdict from a collapsed interval)."""
    check_paired_args(better, level, margin)
    pairs = sorted((s for s in a if s in b and _finite(a[s]) and _finite(b[s])
                    and math.isfinite(float(a[s]) - float(b[s]))), key=_seed_order)
    dropped = tuple(s for s in {**dict.fromkeys(a), **dict.fromkeys(b)} if s not in pairs)
    d = np.asarray([float(a[s]) - float(b[s]) for s in pairs], dtype=np.float64)
    if d.size == 0:
        return Paired(math.nan, math.nan, math.nan, 0, (), "no evidence", "cs", level, dropped)
    mean, low, high = (float(v[-1]) for v in confidence_sequence(d, level))
    if d.size < 2:
        return Paired(mean, math.nan, math.nan, 1, tuple(pairs), "no evidence", "cs", level,
                      dropped)
    verdict = "inconsistent" if bool(missed(d, level)) else \
        verdict_of(low, high, better, margin)
    return Paired(mean, low, high, int(d.size), tuple(pairs), verdict, "cs", level, dropped)


def _decided(low: np.ndarray, high: np.ndarray, margin: float | None) -> np.ndarray:
    """Vectorised :func:`verdict_of` ≠ "no evidence"."""
    out = (low > 0) | (high < 0)
    if margin is not None:
        out |= (-margin < low) & (high < margin)
    return out


def _t_intervals(d: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """The fixed-n t-interval after each prefix (n ≥ 2), re-computed at every look."""
    from scipy.stats import t as student_t

    n = np.arange(1, d.shape[-1] + 1, dtype=np.float64)
    mean = np.cumsum(d, axis=-1) / n
    y = d - d[..., :1]
    ss = np.cumsum(y * y, axis=-1) - np.cumsum(y, axis=-1) ** 2 / n
    sd = np.sqrt(np.maximum(ss, 0.0) / np.maximum(n - 1.0, 1.0))
    q = student_t.ppf(0.5 + level / 2, np.maximum(n - 1.0, 1.0))
    half = np.where(n >= 2, q * sd / np.sqrt(n), np.inf)
    return mean - half, mean + half


def simulate(d: Any, looks: Sequence[int] = LOOKS, level: float = 0.95,
             margin: float | None = None, method: str = "cs", mu: float = 0.0
             ) -> dict[str, Any]:
    """Apply the sweep's stopping rule to experiments ``d`` (rows: paired differences
    in seed order, true mean ``mu``): look after each of ``looks`` seeds, stop at the
    first decided verdict (or the last look). ``method``: ``"cs"`` (this module),
    ``"latest"`` (its latest interval alone, :func:`latest_intervals`), ``"betting"``
    (:func:`fedloom.report.betting.betting_cs`, differences in [−1, 1], its grid in
    steps of 0.5 pp) or ``"t"``
    (the fixed-n t-interval re-tested at every look, the naive protocol). Returns the
    coverage of ``mu`` by the interval at the stop, the share of experiments stopped
    with a decision, the share stopped with a decision whose interval misses ``mu``
    (``wrong``), the mean number of seeds used and the median half-widths after 3, 6
    and 12 seeds (``half_widths``, where ``d`` has them). Under ``"cs"`` a look whose
    sequence has :func:`missed` decides nothing (``inconsistent``), as on a page."""
    d = np.asarray(d, dtype=np.float64)
    if method == "cs":
        _, low, high = confidence_sequence(d, level)
    elif method == "latest":
        _, low, high = latest_intervals(d, level)
    elif method == "betting":
        from fedloom.report.betting import betting_cs

        _, low, high = betting_cs(d, level, grid=401)  # ends widened by 0.5 pp
    elif method == "t":
        low, high = _t_intervals(d, level)
    else:
        raise ValueError(f"method: {method!r} (expected cs, latest, betting or t)")
    idx = np.asarray(looks) - 1
    lo, hi = low[:, idx], high[:, idx]
    with np.errstate(invalid="ignore"):
        dec = _decided(lo, hi, margin)
    if method == "cs":
        dec &= ~_misses(d, level, TAU2)[:, idx]
    first = np.where(dec.any(axis=1), dec.argmax(axis=1), len(idx) - 1)
    rows = np.arange(d.shape[0])
    lo_s, hi_s = lo[rows, first], hi[rows, first]
    with np.errstate(invalid="ignore"):
        half = [float(np.median((high[:, n - 1] - low[:, n - 1]) / 2))
                for n in (3, 6, 12) if n <= d.shape[1]]
    covered = (lo_s <= mu) & (mu <= hi_s)
    return {"coverage": float(np.mean(covered)),
            "decided": float(np.mean(dec[rows, first])),
            "wrong": float(np.mean(dec[rows, first] & ~covered)),
            "seeds_mean": float(np.mean(np.asarray(looks)[first])),
            "experiments": int(d.shape[0]), "half_widths": half}


def null_experiments(kind: str, experiments: int = 4000, n: int = 12, seed: int = 0
                     ) -> np.ndarray:
    """Paired differences with mean 0, bounded in [−1, 1]: ``normal`` (sd 0.02, clipped
    at ±1, never reached), ``uniform`` (on ±0.03), ``skewed`` (0.1·(Beta(2, 5) − 2/7),
    skewness 0.6) or ``strongly-skewed`` (0.1·(Beta(1, 6) − 1/7), skewness 1.5: a long
    right tail, where the t-interval itself no longer holds its level)."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return np.clip(rng.normal(0.0, 0.02, (experiments, n)), -1.0, 1.0)
    if kind == "uniform":
        return rng.uniform(-0.03, 0.03, (experiments, n))
    if kind == "skewed":
        return 0.1 * (rng.beta(2.0, 5.0, (experiments, n)) - 2.0 / 7.0)
    if kind == "strongly-skewed":
        return 0.1 * (rng.beta(1.0, 6.0, (experiments, n)) - 1.0 / 7.0)
    raise ValueError(f"kind: {kind!r} (expected one of {', '.join(NULLS)})")


def _range_bound_half_width(n: int, level: float = 0.95) -> float:
    """Howard et al.'s (2021) two-sided normal-mixture boundary for the mean of
    1-sub-Gaussian differences (the range [−1, 1] gives σ = 1), its mixture tuned to
    ``n``: ``√(2(n + ρ) log(√((n + ρ)/ρ)/α)) / n`` with ρ = n, α split over two sides."""
    alpha = (1.0 - level) / 2
    rho = float(n)
    return math.sqrt(2 * (n + rho) * math.log(math.sqrt((n + rho) / rho) / alpha)) / n


def widths_table(ns: Sequence[int] = (3, 6, 12), level: float = 0.95) -> str:
    """The markdown table of the CS's critical value against the t-interval's."""
    from scipy.stats import t as student_t

    rows = ["| n | t-interval `t_{0.975,n−1}` | CS `c_n` | CS / t | "
            "range-bound CS half-width (pp) |", "|---|---|---|---|---|"]
    for n in ns:
        t = float(student_t.ppf(0.5 + level / 2, n - 1))
        c = float(boundary(n, level))
        rows.append(f"| {n} | {t:.2f} | {c:.2f} | {c / t:.2f}× | "
                    f"±{100 * _range_bound_half_width(n, level):.0f} |")
    return "\n".join(rows)


def coverage_table(experiments: int = 4000) -> str:
    """The markdown table of coverage under the null with the stopping rule applied."""
    from scipy.stats import t as student_t

    rows = ["| differences (mean 0) | CS, stopped | naive t, stopped | fixed-n t at n = 3 |"
            " CS: mean seeds used |", "|---|---|---|---|---|"]
    for kind in NULLS:
        d = null_experiments(kind, experiments)
        cs, t = simulate(d, method="cs"), simulate(d, method="t")
        # the fixed-n t-interval's own coverage at the first look, for reference
        q = float(student_t.ppf(0.975, 2))
        half = q * d[:, :3].std(axis=1, ddof=1) / math.sqrt(3)
        fixed = float(np.mean(np.abs(d[:, :3].mean(axis=1)) <= half))
        rows.append(f"| {kind} | {100 * cs['coverage']:.1f} % | {100 * t['coverage']:.1f} % | "
                    f"{100 * fixed:.1f} % | {cs['seeds_mean']:.1f} |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fedloom.report.sequential",
        description="the confidence sequence of sequential sweeps: its width against the "
                    "fixed-n t-interval, its coverage under the stopping rule")
    p.add_argument("--widths", action="store_true", help="the widths table (n = 3, 6, 12)")
    p.add_argument("--coverage", action="store_true",
                   help=f"coverage of 4,000 null experiments stopped at the first decision "
                        f"(looks after {', '.join(map(str, LOOKS))} seeds)")
    p.add_argument("--robust", action="store_true",
                   help="coverage and widths on a bimodal collapse and t(2) tails, against "
                        "the betting CS (fedloom.report.betting)")
    args = p.parse_args(argv)
    if not (args.widths or args.coverage or args.robust):
        p.error("give --widths, --coverage and/or --robust")
    out = []
    if args.widths:
        out.append(widths_table())
    if args.coverage:
        out.append(coverage_table())
    if args.robust:
        from fedloom.report.betting import robust_table

        out.append(robust_table())
    sys.stdout.write("\n\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
