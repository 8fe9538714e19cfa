"""The tuning protocol of a sweep: one search space per method, one budget for all.

A comparison is only fair when every method was tuned as much as every other,
on data it is not judged on. A suite's ``tuning:`` section (:mod:`fedloom.sweep`
reads it) states ``budget`` (trials per method and setting), ``seeds`` (none of them
a reported seed), ``metric``, ``rounds``, ``sampler`` (``grid | tpe | halving``) and
a ``space`` that a method or a setting extends with its own ``space:``.

Samplers: ``grid`` visits the product of the lists in an order drawn once per
(sampler seed, setting, method) (:func:`fedloom.rng.derive_seed`), its first
``budget`` points the trials; ``tpe`` is Optuna's TPE sampler, trial ``i`` asked of
a fresh study holding trials ``0 … i−1``; ``halving`` is successive halving
(Jamieson & Talwalkar, AISTATS 2016; one bracket of Hyperband, Li et al., JMLR
2018) over the grid sampler's trials, rung ``k`` running ``r_k = min_rounds · eta^k``
rounds (:func:`halving_rungs`, :func:`promote`, :func:`halving_choice`); with
``brackets: true``, Hyperband's brackets over the grid's trials
(:func:`hyperband_brackets`). Departures from the papers: ties go to the earlier
trial; non-finite scores are dropped, not ranked.

A trial runs on every tuning seed; its score is the mean of the selection metric
over them. A run that diverged (a NaN or missing metric) scores worst. The
chosen point is the best score, the earliest trial on a tie.

The format, each sampler in full, the cost of halving and the sensitivity runs:
docs/howto/sweeps.md (The tuning protocol).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard, cast

import numpy as np

from fedloom.config import ConfigError
from fedloom.config.translate import old_spelling
from fedloom.names import encode_component
from fedloom.rng import derive_seed

__all__ = ["Protocol", "Range", "Trial", "best_trial", "grid_points", "halving_choice",
           "halving_rungs", "hyperband_brackets", "load_protocol", "merge_space", "overrides",
           "parse_space", "plan_rounds", "point_slug", "promote", "tpe_point"]

SAMPLERS = ("grid", "tpe", "halving")


@dataclass(frozen=True)
class Range:
    """A continuous dimension (``tpe`` only): ``low ≤ x ≤ high``, log-uniform if ``log``."""

    low: float
    high: float
    log: bool = False


Space = dict[str, list[Any] | Range]


@dataclass
class Protocol:
    """A suite's ``tuning:`` section (module docstring)."""

    budget: int
    seeds: list[int]
    metric: str = "client_acc_mean"
    rounds: int | None = None
    sampler: str = "grid"
    seed: int = 0
    startup: int = 4
    space: Space = field(default_factory=dict)
    sensitivity: dict[str, Any] | None = None
    eta: int = 3                   # halving: the best 1/eta of a rung go on
    min_rounds: int | None = None  # halving: the first rung's rounds
    brackets: bool = False         # halving: Hyperband's brackets (hyperband_brackets)
    # Filled by the sweep (halving): each (setting, method)'s plan — its rungs, the
    # client rounds planned, used, and what the grid sampler's runs would cost.
    plans: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)


@dataclass
class Trial:
    """One point of a method's space and its score (mean over the tuning seeds)."""

    index: int
    params: dict[str, Any]
    scores: dict[int, float] = field(default_factory=dict)
    # halving: the last rung the trial ran (0 = the first), its rounds (``scores`` are
    # those at that rung), each rung's score by rounds, and the client rounds it cost
    # over the tuning seeds (rounds run × cohort size)
    rung: int | None = None
    rounds: int | None = None
    rung_scores: dict[int, float] = field(default_factory=dict)
    cost: int | None = None

    @property
    def score(self) -> float:
        vals = list(self.scores.values())
        if not vals or any(not math.isfinite(v) for v in vals):
            return math.nan  # a diverged tuning seed: the point scores worst
        return float(np.mean(vals))


def _number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def parse_space(raw: Any, where: str) -> Space:
    """A ``space:`` mapping: key → non-empty list of scalars, or a range."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must map config keys to lists of values")
    space: Space = {}
    for key, vals in raw.items():
        at = f"{where}.{key}"
        if not isinstance(key, str) or not key or "=" in key:
            raise ConfigError(f"{at}: not a dotted config key")
        if isinstance(vals, dict):
            unknown = set(vals) - {"low", "high", "log"}
            if unknown:
                raise ConfigError(f"{at}: {sorted(unknown)[0]}: unknown key (a range has "
                                  "low, high, log)")
            lo, hi = vals.get("low"), vals.get("high")
            if not (_number(lo) and _number(hi) and lo < hi):
                raise ConfigError(f"{at}: a range needs numbers low < high")
            log = bool(vals.get("log", False))
            if log and lo <= 0:
                raise ConfigError(f"{at}: a log range needs low > 0")
            space[key] = Range(float(lo), float(hi), log)
        elif isinstance(vals, list) and vals:
            if any(isinstance(v, dict | list) or v is None for v in vals):
                raise ConfigError(f"{at}: values must be numbers or strings")
            if any(isinstance(v, float) and not math.isfinite(v) for v in vals):
                raise ConfigError(f"{at}: values must be finite")
            if len({json.dumps(v) for v in vals}) < len(vals):
                raise ConfigError(f"{at}: a value is listed twice")
            space[key] = list(vals)
        else:
            raise ConfigError(f"{at}: needs a non-empty list of values (or a range)")
    return space


def load_protocol(raw: Any, where: str, reported: Sequence[int]) -> Protocol:
    """Read and check a ``tuning:`` section (``reported``: the suite's seeds)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping")
    known = {"budget", "seeds", "metric", "rounds", "sampler", "seed", "startup", "space",
             "sensitivity", "eta", "min_rounds", "brackets"}
    for key in raw:
        if key not in known:
            raise ConfigError(f"{where}.{key}: unknown key (expected one of: "
                              f"{', '.join(sorted(known))})")
    budget = raw.get("budget")
    if not (isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1):
        raise ConfigError(f"{where}.budget: needs a whole number of trials ≥ 1")
    seeds = raw.get("seeds")
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) for s in seeds)):
        raise ConfigError(f"{where}.seeds: needs a non-empty list of integer seeds")
    both = sorted(set(seeds) & set(reported))
    if both:
        raise ConfigError(f"{where}.seeds: {both[0]} is also a reported seed (tuning seeds "
                          "must be separate)")
    sampler = raw.get("sampler", "grid")
    if sampler not in SAMPLERS:
        raise ConfigError(f"{where}.sampler: {sampler!r} (expected one of: "
                          f"{', '.join(SAMPLERS)})")
    rounds = raw.get("rounds")
    if rounds is not None and not (isinstance(rounds, int) and rounds >= 1):
        raise ConfigError(f"{where}.rounds: needs a whole number ≥ 1")
    startup = raw.get("startup", 4)
    if not (isinstance(startup, int) and startup >= 1):
        raise ConfigError(f"{where}.startup: needs a whole number ≥ 1")
    eta, min_rounds = raw.get("eta", 3), raw.get("min_rounds")
    if sampler != "halving":
        given = [k for k in ("eta", "min_rounds", "brackets") if k in raw]
        if given:
            raise ConfigError(f"{where}.{given[0]}: only with sampler: halving")
    else:
        if not (isinstance(eta, int) and not isinstance(eta, bool) and eta >= 2):
            raise ConfigError(f"{where}.eta: needs a whole number ≥ 2")
        if not (isinstance(min_rounds, int) and not isinstance(min_rounds, bool)
                and min_rounds >= 1):
            raise ConfigError(f"{where}.min_rounds: sampler: halving needs the first rung's "
                              "rounds, a whole number ≥ 1")
        if rounds is not None and min_rounds > rounds:
            raise ConfigError(f"{where}.min_rounds: {min_rounds} is above rounds {rounds}")
        if not isinstance(raw.get("brackets", False), bool):
            raise ConfigError(f"{where}.brackets: needs true or false")
    space = parse_space(raw.get("space"), f"{where}.space")
    sens = raw.get("sensitivity")
    if sens is not None:
        if not (isinstance(sens, dict) and isinstance(sens.get("key"), str)):
            raise ConfigError(f"{where}.sensitivity: needs key: and values:")
        extra = set(sens) - {"key", "values", "methods"}
        if extra:
            raise ConfigError(f"{where}.sensitivity.{sorted(extra)[0]}: unknown key")
        values = None
        if sens.get("values") is not None:
            vals = parse_space({sens["key"]: sens["values"]}, f"{where}.sensitivity")
            if isinstance(vals[sens["key"]], Range):
                raise ConfigError(f"{where}.sensitivity.values: needs a list")
            values = vals[sens["key"]]
        sens = {"key": sens["key"], "values": values, "methods": sens.get("methods")}
    metric = raw.get("metric", "client_acc_mean")
    if not isinstance(metric, str) or not metric:
        raise ConfigError(f"{where}.metric: needs a metric name")
    return Protocol(budget=budget, seeds=list(seeds), metric=metric, rounds=rounds,
                    sampler=sampler, seed=int(raw.get("seed", 0)), startup=startup,
                    space=space, sensitivity=sens, eta=eta, min_rounds=min_rounds,
                    brackets=bool(raw.get("brackets", False)))


def merge_space(*layers: Space) -> Space:
    """Later layers add keys or replace earlier ones (suite, setting, method)."""
    out: Space = {}
    for layer in layers:
        out.update(layer)
    return out


def grid_size(space: Space) -> int | None:
    """Points in the grid (None when a dimension is a range)."""
    size = 1
    for v in space.values():
        if isinstance(v, Range):
            return None
        size *= len(v)
    return size


def grid_points(space: Space, budget: int, seed: int, setting: str, method: str
                ) -> list[dict[str, Any]]:
    """The ``budget`` trials of the grid sampler (module docstring)."""
    size = grid_size(space)
    if size is None:
        raise ConfigError(f"{method}: the grid sampler needs lists, not ranges "
                          "(use sampler: tpe)")
    if size < budget:
        raise ConfigError(f"methods.{method} (setting {setting}): its space has {size} points, "
                          f"fewer than tuning.budget {budget}: every method gets the same "
                          "number of trials")
    keys = list(space)
    points = [dict(zip(keys, combo, strict=True))
              # a grid (grid_size checked it above): every dimension a list of values
              for combo in itertools.product(*(cast("list[Any]", space[k]) for k in keys))]
    rng = np.random.default_rng(derive_seed(seed, purpose=f"tuning-grid/{setting}/{method}"))
    order = rng.permutation(len(points))
    return [points[i] for i in order[:budget]]


def _distributions(space: Space) -> dict[str, Any]:
    import optuna

    dists: dict[str, Any] = {}
    for k, v in space.items():
        if isinstance(v, Range):
            dists[k] = optuna.distributions.FloatDistribution(v.low, v.high, log=v.log)
        else:
            dists[k] = optuna.distributions.CategoricalDistribution(list(v))
    return dists


def tpe_point(space: Space, history: Sequence[Trial], index: int, seed: int, setting: str,
              method: str, lower: bool, startup: int = 4) -> dict[str, Any]:
    """Trial ``index`` of the TPE sampler, from trials ``0 … index−1`` (module docstring)."""
    try:
        import optuna
    except ImportError:
        raise ConfigError("tuning.sampler: tpe needs optuna (pip install optuna)") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    dists = _distributions(space)
    sampler = optuna.samplers.TPESampler(
        seed=derive_seed(seed, round=index, purpose=f"tuning-tpe/{setting}/{method}") % 2**32,
        n_startup_trials=startup)
    study = optuna.create_study(direction="minimize" if lower else "maximize", sampler=sampler)
    for t in history[:index]:
        score = t.score
        state = (optuna.trial.TrialState.COMPLETE if math.isfinite(score)
                 else optuna.trial.TrialState.FAIL)  # a diverged point: TPE leaves it out
        study.add_trial(optuna.trial.create_trial(
            params=t.params, distributions=dists, state=state,
            value=score if math.isfinite(score) else None))
    trial = study.ask(dists)
    point: dict[str, Any] = {}
    for k, v in trial.params.items():
        # a range's draw keeps 3 significant digits: readable run names, same runs reused
        point[k] = float(f"{v:.3g}") if isinstance(space[k], Range) else v
    return point


def best_trial(trials: Sequence[Trial], lower: bool) -> Trial:
    """The best score (NaN worst), the earliest trial on a tie."""
    if not trials:
        raise ValueError("no trials")

    def key(t: Trial) -> tuple[float, int]:
        s = t.score
        if not math.isfinite(s):
            return (math.inf, t.index)
        return (s if lower else -s, t.index)

    return min(trials, key=key)


def halving_rungs(budget: int, rounds: int, min_rounds: int, eta: int
                  ) -> list[tuple[int, int]]:
    """Successive halving's rungs as ``(rounds, trials)``: rounds ``min_rounds · eta^k``
    up to ``rounds`` (the last rung), trials ``budget`` then ``max(1, ⌊n / eta⌋)``
    (module docstring). ``min_rounds ≥ rounds``: one rung, the grid sampler's runs."""
    rs = [min(min_rounds, rounds)]
    while rs[-1] < rounds:
        rs.append(min(rs[-1] * eta, rounds))
    out, n = [], budget
    for r in rs:
        out.append((r, n))
        n = max(1, n // eta)
    return out


def hyperband_brackets(budget: int, rounds: int, min_rounds: int, eta: int
                       ) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """Hyperband's brackets (Li et al., JMLR 2018, Algorithm 1) over ``budget`` grid
    trials, as ``(trial indices, rungs)``: ``s_max`` the largest ``s`` with
    ``min_rounds · eta^s ≤ rounds``; bracket ``s = s_max … 0`` takes the next
    ``n_s = ⌈(s_max + 1)/(s + 1) · eta^s⌉`` trials in the grid's order and runs
    successive halving from ``r_s = ⌈rounds / eta^s⌉`` rounds (:func:`halving_rungs`);
    bracket 0 runs its trials to ``rounds`` with no stop, which is what keeps a slow
    starter. Departure: Hyperband draws fresh points for each bracket and repeats the
    loop over brackets; here the loop repeats over the grid's points until ``budget``
    are placed (the last bracket may hold fewer)."""
    s_max = 0
    while min_rounds * eta ** (s_max + 1) <= rounds:
        s_max += 1
    out: list[tuple[list[int], list[tuple[int, int]]]] = []
    nxt = 0
    while nxt < budget:
        for s in range(s_max, -1, -1):
            if nxt >= budget:
                break
            n = min(math.ceil((s_max + 1) / (s + 1) * eta ** s), budget - nxt)
            r0 = min(rounds, math.ceil(rounds / eta ** s))
            out.append((list(range(nxt, nxt + n)), halving_rungs(n, rounds, r0, eta)))
            nxt += n
    return out


def plan_rounds(rungs: Sequence[tuple[int, int]], extend: bool = True) -> int:
    """The rounds a halving plan runs per tuning seed: each rung's trials run on from
    the rung before (``extend``), else from the start."""
    prev, total = 0, 0
    for r, n in rungs:
        total += n * (r - prev if extend else r)
        prev = r
    return total


def promote(scores: Mapping[int, float], size: int, lower: bool) -> list[int]:
    """The trials (by index) that go on from a rung: the ``size`` best finite
    ``scores`` (trial index → score), the earlier trial on a tie, in that order."""
    finite = [(s if lower else -s, i) for i, s in scores.items() if math.isfinite(s)]
    return [i for _, i in sorted(finite)[:size]]


def halving_choice(trials: Sequence[Trial], lower: bool) -> Trial:
    """The best trial of the most rounds a finite score reached (the highest rung; with
    brackets, the trials of every bracket that ran that long), the earliest on a tie;
    with no finite score at all, :func:`best_trial`'s (the earliest)."""
    finite = [t for t in trials if math.isfinite(t.score)]
    if not finite:
        return best_trial(trials, lower)
    def reach(t: Trial) -> tuple[int, int]:
        # by rounds alone where they are known: under brackets a trial of a bracket with
        # no stop ends its rung 0 at the rounds another bracket's promoted trials reach at
        # rung 1, and competes with them; the rung only where no rounds were recorded
        return (t.rounds, 0) if t.rounds is not None else (0, t.rung or 0)

    top = max(reach(t) for t in finite)
    return best_trial([t for t in finite if reach(t) == top], lower)


def _text(v: Any) -> str:
    return repr(v) if isinstance(v, float) else str(v)


def overrides(params: Mapping[str, Any]) -> list[str]:
    """``key=value`` overrides of a point (floats by ``repr``: read back exactly)."""
    return [f"{k}={_text(v)}" for k, v in params.items()]


def point_slug(params: Mapping[str, Any]) -> str:
    """A folder name for a point: ``client.lr=0.03,server.lr=1.0`` (characters outside
    ``[A-Za-z0-9._=,-]`` become ``_``; a name over 120 characters is cut and ended by
    a digest of the whole, so two points never share a folder). A component's option
    is spelt as before it moved into ``SECTION.options`` (``compression.alpha``), so
    a sweep finds the trials an older version ran (fedloom.config.translate)."""
    text = ",".join(f"{old_spelling(k)}={_text(v)}" for k, v in params.items())
    safe = encode_component(text, keep="-_.=,")
    if len(safe) <= 120:
        return safe
    import hashlib

    return safe[:100] + "~" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
