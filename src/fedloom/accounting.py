"""Privacy accountants for DP-FedAvg: RDP, PLD and PRV over Poisson or fixed-size
client sampling, add/remove or replace-one neighbours, rounds of changing rate and noise.

A round releases the clipped sum (each update clipped to C) plus N(0, z²C²I) from a
cohort sampled at rate q (fixed-size: m of N, q = m/N). Each (sampling, neighbours)
pair is bounded by one event (:func:`round_event` writes the validity argument out)::

    poisson  add_remove   PoissonSampled(q, Gaussian(z))               RDP, PLD, PRV
    poisson  replace_one  PLD: the same under REPLACE_ONE (both sides mixtures);
                          RDP and PRV refused (no such pair in either library)
    fixed    add_remove   PoissonSampled(q, Gaussian(z/2))             RDP, PLD, PRV
    fixed    replace_one  PLD, PRV: PoissonSampled(q, Gaussian(z/2));
                          RDP: SampledWithoutReplacement(q, Gaussian(z/2))

RDP: dp-accounting's RdpAccountant (Mironov, Talwar & Zhang 2019; Wang, Balle &
Kasiviswanathan, AISTATS 2019 without replacement). PLD: dp-accounting's PLDAccountant
(Doroshenko et al., PETS 2022: pessimistic, connect-the-dots, interval 1e-4).
PRV: prv-accountant's PRVAccountant (Gopi, Lee & Wutschitz, NeurIPS 2021), its upper
bound at eps_error 0.01, delta_error δ/1000, as Opacus's. Calibration: bisection on
z, the smallest z meeting the target ε to 1e-3 (relative), never above it.

Checked against pfl 0.6's and Opacus 1.6's accountants on a grid of (q, z, T, δ)
(tests/test_accounting.py, tests/data/privacy_reference.json from
benchmarks/privacy_reference.py). Departure: PRV reports the upper bound (pfl the
estimate). The ε table and timings: docs/howto/privacy.md (Accounting).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

import numpy as np

__all__ = ["KINDS", "NEIGHBOURS", "SAMPLINGS", "Accountant", "Step", "as_it_ran", "round_event",
           "steps"]

Kind = Literal["rdp", "pld", "prv"]
Sampling = Literal["poisson", "fixed"]
Neighbours = Literal["add_remove", "replace_one"]
KINDS: tuple[str, ...] = ("rdp", "pld", "prv")
SAMPLINGS: tuple[str, ...] = ("poisson", "fixed")
NEIGHBOURS: tuple[str, ...] = ("add_remove", "replace_one")

# the PLD's value_discretization_interval, dp-accounting's and pfl's default: 1e-3 is
# ten times faster but its ε (pessimistic, never below) was 7 % above at q=0.002, z=2,
# T=10,000 (0.04 % at the example; docs/howto/privacy.md, Accounting)
PLD_INTERVAL = 1e-4
PRV_EPS_ERROR = 0.01      # Opacus's default for its PRVAccountant
PRV_DELTA_ERROR = 1e-10   # for Accountant.delta, where no δ is given (pfl's default)
NOISE_RTOL = 1e-3         # Accountant.noise: relative width of the final bracket in z
NOISE_MAX = 1e4           # no noise multiplier above this is searched
COARSE_INTERVAL = 1e-3    # Accountant.noise brackets a PLD's z at this interval first


@dataclass(frozen=True)
class Step:
    """``count`` rounds at sampling rate ``q`` and noise multiplier ``z``."""

    q: float
    z: float
    count: int


@dataclass(frozen=True)
class Event:
    """What bounds one round: the sampled Gaussian at ``q`` with noise multiplier
    ``sigma`` (sensitivity 1), ``how`` it is sampled for the bound and the relation
    the bound is computed under (``replace`` only for Poisson/replace-one PLD)."""

    q: float
    sigma: float
    how: Literal["poisson", "without_replacement"]
    replace: bool = False


def _check_unit(name: str, v: float, *, closed: bool) -> float:
    v = float(v)
    ok = 0 < v <= 1 if closed else 0 < v < 1
    if not ok:  # also NaN
        raise ValueError(f"{name}: must be in (0, 1{']' if closed else ')'}, got {v!r}")
    return v


def _check_positive(name: str, v: float) -> float:
    v = float(v)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name}: must be a finite number > 0, got {v!r}")
    return v


def _per_round(name: str, v: float | Sequence[float], rounds: int) -> list[float]:
    if isinstance(v, (int, float, np.floating, np.integer)):
        return [float(v)] * rounds
    vals = [float(x) for x in v]
    if len(vals) != rounds:
        raise ValueError(f"{name}: one value a round: {len(vals)} given for T={rounds}")
    return vals


def steps(q: float | Sequence[float], z: float | Sequence[float], rounds: int) -> tuple[Step, ...]:
    """The ``rounds`` rounds at ``q`` and ``z`` (each a number, or one a round) as
    steps of equal (q, z), sorted (composition does not depend on the order, and the
    same rounds in any order are one cached result). Bad input: a one-line
    ``ValueError`` naming the argument."""
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 0:
        raise ValueError(f"T: must be an integer >= 0, got {rounds!r}")
    qs, zs = _per_round("q", q, int(rounds)), _per_round("z", z, int(rounds))
    for v in qs:
        _check_unit("q", v, closed=True)
    for v in zs:
        _check_positive("z", v)
    counts = Counter(zip(qs, zs, strict=True))
    return tuple(Step(a, b, c) for (a, b), c in sorted(counts.items()))


def round_event(q: float, z: float, sampling: str, neighbours: str, kind: str) -> Event:
    """The event bounding one round of the sampled Gaussian (clipped sum, noise ``z·C``).

    Poisson, add/remove: the sum moves by at most C; PoissonSampled(q, Gaussian(z)),
    the pair ((1−q)N(0,z²) + qN(1,z²), N(0,z²)) both ways (Mironov et al. 2019; PLD
    and PRV the same pair). Poisson, replace-one: x→x′ moves the sampled sum by x
    or x′ from the rest: PLD takes dp-accounting's REPLACE_ONE pair
    ((1−q)N(0)+qN(−1), (1−q)N(0)+qN(1)) (Lebeda, Regehr, Kamath & Steinke 2024);
    RDP and PRV are refused: neither library has that pair, and the valid bound they
    could give (the add/remove pair at z/2, below) is 4× PLD's ε at the issue's example.

    Fixed-size, m of N without replacement (q = m/N). Couple the samples: with
    probability q the differing client is sampled and, the rest being S′ (m−1
    others), the same draw from the neighbour holds S′ ∪ {y} for a uniform other y;
    otherwise both draw the same m. So, with R = M(S′∪y), A = M(S′∪x), B = M(S′∪x′):
    add/remove (D ∋ x, D′ = D∖x): M(D) = E[(1−q)R + qA], M(D′) = E[R]; replace-one:
    M(D) = E[(1−q)R + qA], M(D′) = E[(1−q)R + qB], the means of A, B, R at most 2C
    apart (a cohort of fixed size displaces a client: both relations move the sum
    by up to 2C). Joint convexity of the hockey-stick divergence takes the
    expectation out; for add/remove the pair left is the Poisson add/remove pair at
    z/2 (shift 2C); for replace-one Balle, Barthe & Gaboardi's advanced joint
    convexity (NeurIPS 2018, Thm 2: H_{e^ε′}((1−q)R+qA ‖ (1−q)R+qB) =
    q·H_{e^ε}(A ‖ (1−β)R+βB) ≤ q·H_{e^ε}(N(2C) ‖ N(0)), ε ≥ 0) gives the same
    pair (Zhu, Dong & Wang, AISTATS 2022, state this pair for sampling without
    replacement). PLD and PRV compute δ(ε) for ε ≥ 0: valid for both. RDP:
    add/remove by the joint quasi-convexity of Rényi divergence (van Erven &
    Harremoës 2014, Thm 13) and Mironov et al.'s bound at z/2; replace-one takes
    dp-accounting's SampledWithoutReplacement event (Wang et al. 2019) at z/2.
    The neighbour D′ = D ∪ {x} samples at m/(N+1) < q: covered, the bound grows with q.
    The pair is attained (every other client sends u, ‖u‖ = C, x sends −u, x′ = u):
    PLD's and PRV's fixed-size ε is the mechanism's, not a loose bound.
    """
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling: must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    if neighbours not in NEIGHBOURS:
        raise ValueError(f"neighbours: must be one of {', '.join(NEIGHBOURS)}, "
                         f"got {neighbours!r}")
    if kind not in KINDS:
        raise ValueError(f"kind: must be one of {', '.join(KINDS)}, got {kind!r}")
    if sampling == "poisson" and neighbours == "add_remove":
        return Event(q, z, "poisson")
    if sampling == "poisson":
        if kind != "pld":
            raise ValueError(f"kind: {kind} has no tight bound for Poisson sampling under "
                             "replace_one (its library takes add/remove); use pld")
        return Event(q, z, "poisson", True)
    if kind == "rdp" and neighbours == "replace_one" and q < 1:
        return Event(q, z / 2, "without_replacement")
    return Event(q, z / 2, "poisson")


# ------------------------------------------------------------------ the libraries
def _dpa() -> Any:
    try:
        import dp_accounting
    except ImportError:  # pragma: no cover (a dependency of the package)
        raise ValueError("the accountant needs dp-accounting (pip install dp-accounting)") \
            from None
    return dp_accounting


def _dp_event(e: Event) -> Any:
    dpa = _dpa()
    g = dpa.GaussianDpEvent(e.sigma)
    if e.q >= 1:
        return g
    if e.how == "without_replacement":
        f = Fraction(e.q).limit_denominator(10**9)
        return dpa.SampledWithoutReplacementDpEvent(f.denominator, f.numerator, g)
    return dpa.PoissonSampledDpEvent(e.q, g)


@functools.lru_cache(maxsize=64)
def _rdp_curve(e: Event) -> tuple[np.ndarray, np.ndarray]:
    """The RDP orders and one round's RDP (dp-accounting's own computation)."""
    dpa = _dpa()
    rel = (dpa.NeighboringRelation.REPLACE_ONE if e.how == "without_replacement"
           else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc = dpa.rdp.RdpAccountant(neighboring_relation=rel)
    acc.compose(_dp_event(e))
    # the library adds count · (this vector) for a SelfComposedDpEvent: T rounds are
    # T times it (tests/test_accounting.py checks ε against its get_epsilon)
    return np.asarray(acc._orders, dtype=float), np.asarray(acc._rdp, dtype=float)


def _rdp(events: tuple[tuple[Event, int], ...]) -> tuple[np.ndarray, np.ndarray]:
    orders = _rdp_curve(events[0][0])[0]
    total = sum((c * _rdp_curve(e)[1] for e, c in events), np.zeros_like(orders))
    return orders, total


@functools.lru_cache(maxsize=64)
def _gaussian_pld(e: Event, sigma: float, interval: float) -> Any:
    """The PLD of one event (``sigma``: its noise, or the composed Gaussian's),
    as dp-accounting's PLDAccountant builds it (pessimistic, connect-the-dots)."""
    dpa = _dpa()
    rel = dpa.NeighboringRelation
    return dpa.pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=sigma, sampling_prob=min(1.0, e.q),
        value_discretization_interval=interval,
        neighboring_relation=rel.REPLACE_ONE if e.replace else rel.ADD_OR_REMOVE_ONE)


def _pld(events: tuple[tuple[Event, int], ...], interval: float) -> Any:
    """The composed PLD: what PLDAccountant composes for these events (a Gaussian's
    T rounds as one Gaussian of noise σ/√T), each round's PLD built once."""
    pld = None
    for e, c in events:
        one = (_gaussian_pld(e, e.sigma / math.sqrt(c), interval) if e.q >= 1
               else _gaussian_pld(e, e.sigma, interval).self_compose(c))
        pld = one if pld is None else pld.compose(one)
    return pld


def _prv(events: tuple[tuple[Event, int], ...], delta_error: float) -> Any:
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import (
        GaussianMechanism,
        PoissonSubsampledGaussianMechanism,
    )
    prvs = [GaussianMechanism(e.sigma) if e.q >= 1
            else PoissonSubsampledGaussianMechanism(e.q, e.sigma) for e, _ in events]
    counts = [c for _, c in events]
    return PRVAccountant(prvs=prvs, max_self_compositions=counts, eps_error=PRV_EPS_ERROR,
                         delta_error=delta_error), counts


@functools.lru_cache(maxsize=256)
def _epsilon(kind: str, events: tuple[tuple[Event, int], ...], delta: float,
             interval: float) -> float:
    if not events:
        return 0.0
    if kind == "rdp":
        from dp_accounting.rdp import rdp_privacy_accountant as rdp
        orders, total = _rdp(events)
        return float(rdp.compute_epsilon(orders, total, delta)[0])
    if kind == "pld":
        return float(_pld(events, interval).get_epsilon_for_delta(delta))
    try:
        acc, counts = _prv(events, delta / 1000)
        return float(acc.compute_epsilon(delta, counts)[2])  # the upper bound
    except (RuntimeError, ValueError, FloatingPointError) as e:
        raise ValueError(f"kind: prv-accountant failed here ({str(e).splitlines()[0]}); "
                         "use pld") from None


@functools.lru_cache(maxsize=256)
def _delta(kind: str, events: tuple[tuple[Event, int], ...], eps: float,
           interval: float) -> float:
    if not events:
        return 0.0
    if kind == "rdp":
        from dp_accounting.rdp import rdp_privacy_accountant as rdp
        orders, total = _rdp(events)
        return float(rdp.compute_delta(orders, total, eps)[0])
    if kind == "pld":
        return float(_pld(events, interval).get_delta_for_epsilon(eps))
    try:
        acc, counts = _prv(events, PRV_DELTA_ERROR)
        return float(min(1.0, acc.compute_delta(eps, counts)[2]))  # the upper bound
    except (RuntimeError, ValueError, FloatingPointError) as e:
        raise ValueError(f"kind: prv-accountant failed here ({str(e).splitlines()[0]}); "
                         "use pld") from None


# ------------------------------------------------------------------ the accountant
class Accountant:
    """ε, δ or the noise of ``T`` rounds of the sampled Gaussian (module docstring).

    ``kind``: rdp | pld | prv; ``sampling``: poisson | fixed (``q = m/N``);
    ``neighbours``: add_remove | replace_one. ``q`` and ``z`` are numbers or one a
    round (``len == T``): rounds of changing rate or noise compose. ``pld_interval``:
    the PLD's discretization of the privacy loss (pessimistic: a coarser one only
    raises ε). Results are cached (the engine asks for ε every round)."""

    def __init__(self, kind: str = "pld", sampling: str = "poisson",
                 neighbours: str = "add_remove", *, pld_interval: float = PLD_INTERVAL) -> None:
        round_event(0.5, 1.0, sampling, neighbours, kind)  # checks the three names
        self.kind, self.sampling, self.neighbours = kind, sampling, neighbours
        self.pld_interval = _check_positive("pld_interval", pld_interval)

    def __repr__(self) -> str:
        return (f"Accountant(kind={self.kind!r}, sampling={self.sampling!r}, "
                f"neighbours={self.neighbours!r})")

    def events(self, q: float | Sequence[float], z: float | Sequence[float],
               rounds: int) -> tuple[tuple[Event, int], ...]:
        """The rounds as (event, count) pairs."""
        return tuple((round_event(s.q, s.z, self.sampling, self.neighbours, self.kind),
                      s.count) for s in steps(q, z, rounds))

    def epsilon(self, q: float | Sequence[float], z: float | Sequence[float], rounds: int,
                delta: float) -> float:
        """ε at ``delta`` after ``rounds`` rounds (0 for none)."""
        delta = _check_unit("delta", delta, closed=False)
        return _epsilon(self.kind, self.events(q, z, rounds), delta, self.pld_interval)

    def delta(self, q: float | Sequence[float], z: float | Sequence[float], rounds: int,
              eps: float) -> float:
        """δ at ``eps`` after ``rounds`` rounds."""
        eps = float(eps)
        if not (eps >= 0 and math.isfinite(eps)):
            raise ValueError(f"eps: must be a finite number >= 0, got {eps!r}")
        return _delta(self.kind, self.events(q, z, rounds), eps, self.pld_interval)

    def noise(self, q: float | Sequence[float], rounds: int, eps: float, delta: float, *,
              rtol: float = NOISE_RTOL) -> float:
        """The noise multiplier z for ε(z) ≤ ``eps`` at ``delta`` after ``rounds`` rounds
        at rate ``q``: bisection on z (ε decreases in z), returning the upper end of a
        bracket [lo, hi] with ε(hi) ≤ eps < ε(lo) and hi − lo ≤ rtol·hi, so the result
        is within ``rtol`` (relative) of the smallest such z and never spends more."""
        eps = _check_positive("eps", eps)
        delta = _check_unit("delta", delta, closed=False)
        if rounds == 0:
            raise ValueError("T: no rounds, no noise to solve for")

        def fits(z: float) -> bool:
            return self.epsilon(q, z, rounds, delta) <= eps

        if self.kind == "pld" and self.pld_interval < COARSE_INTERVAL:
            # the coarser PLD is pessimistic: its z meets the target here too, and is
            # within a few % of ours; bracket below it, then bisect at our interval
            coarse = Accountant("pld", self.sampling, self.neighbours,
                                pld_interval=COARSE_INTERVAL)
            hi = coarse.noise(q, rounds, eps, delta, rtol=rtol)
            if not fits(hi):  # pragma: no cover (a finer PLD is never above a coarser)
                hi = _upper(fits)
            lo = hi * 0.98
        else:
            hi = _upper(fits)
            lo = hi / 2
        while fits(lo):
            if lo < 1e-6:  # ε met by (almost) no noise: the search ends at 1e-6
                return lo
            hi, lo = lo, lo / 2
        while hi - lo > rtol * hi:
            mid = (lo + hi) / 2
            hi, lo = (mid, lo) if fits(mid) else (hi, mid)
        return hi


def _upper(fits: Any) -> float:
    """A noise multiplier that meets the target: 1, doubled until it does."""
    hi = 1.0
    while not fits(hi):
        hi *= 2
        if hi > NOISE_MAX:
            raise ValueError(f"eps: no noise multiplier up to {NOISE_MAX:g} meets the target")
    return hi


# What a run recorded before privacy.accountant and privacy.neighbours existed was
# accounted with: RDP over fixed-size sampling under replace-one neighbours.
RECORDED_BEFORE = {"accountant": "rdp", "neighbours": "replace_one"}


def as_it_ran(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A run's recorded config (``config.yaml`` or a checkpoint's, as written) with the
    accounting its rounds were reported by: a private run recorded before the
    accountant could be chosen names none and ran :data:`RECORDED_BEFORE`, so it is
    read so, and a resume under today's default (another ε for the same rounds) is
    refused as any changed setting is, naming both keys. Other records as given."""
    out = dict(saved)
    priv = out.get("privacy")
    if (isinstance(priv, Mapping) and priv.get("mode", "none") not in (None, "none")
            and not any(k in priv for k in RECORDED_BEFORE)):
        out["privacy"] = {**priv, **RECORDED_BEFORE}
    return out
