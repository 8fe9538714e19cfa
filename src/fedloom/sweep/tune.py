"""What the tuning runs choose, and the runs a sweep then reports.

:func:`tuned_values` runs the ``tune:`` grids (one key per method, on
``tune_seed``); :func:`tune_protocol` runs the ``tuning:`` protocol
(:mod:`fedloom.tuning`: a budget of trials per setting and method, grid or TPE),
writes every trial and the choice to ``OUT/NAME.tuning.json`` and returns each
method's chosen point. :func:`main_specs` and :func:`sensitivity_specs` are the
runs made with what was chosen.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from fedloom.config import ConfigError
from fedloom.files import write_output
from fedloom.sweep.checks import _sens_values, _sensitive
from fedloom.sweep.running import _run_all, read_summary
from fedloom.sweep.suite import (
    TUNE,
    RunSpec,
    StaleRunsError,
    Suite,
    SweepError,
    _applies,
    _spec,
    _tune_tag,
)
from fedloom.tuning import (
    Trial,
    best_trial,
    grid_points,
    halving_choice,
    overrides,
    point_slug,
    tpe_point,
)


def tuned_values(
    suite: Suite, workers: int, log: Callable[[str], None]
) -> dict[tuple[str, str], Any]:
    """Run the tuning grids; return {(setting, method): chosen value}."""
    specs: dict[tuple[str, str, Any], RunSpec] = {}
    def applies(method: str, setting: str) -> bool:
        return method not in suite.method_settings or setting in suite.method_settings[method]

    for setting in suite.settings:
        for method, t in suite.tuning.grids.items():
            if not applies(method, setting):
                continue
            for value in t["grid"]:
                ov = [o.replace(TUNE, str(value)) for o in suite.methods[method]]
                specs[(setting, method, value)] = _spec(suite, setting, method,
                                                        suite.tuning.grid_seed, ov,
                                                        tag=_tune_tag(value))
    _run_all(list(specs.values()), workers, log, suite.fallbacks)
    chosen: dict[tuple[str, str], Any] = {}
    for setting in suite.settings:
        for method, t in suite.tuning.grids.items():
            if not applies(method, setting):
                continue
            scores = {v: read_summary(specs[(setting, method, v)].out).get(suite.tuning.grid_metric,
                                                                            float("-inf"))
                      for v in t["grid"]}
            scores = {v: (s if s == s else float("-inf")) for v, s in scores.items()}  # NaN
            chosen[(setting, method)] = max(scores, key=lambda v: scores[v])
        for method, source in suite.tuning.shared.items():
            if applies(method, setting) and (setting, source) in chosen:
                chosen[(setting, method)] = chosen[(setting, source)]
    return chosen


def _trial_specs(suite: Suite, setting: str, method: str, point: dict[str, Any]
                 ) -> list[RunSpec]:
    proto = suite.tuning.protocol
    assert proto is not None
    ov = [*suite.methods[method], *overrides(point)]
    rounds = suite.settings[setting].get("tuning_rounds", proto.rounds)
    if rounds:
        ov.append(f"rounds={rounds}")
    return [_spec(suite, setting, method, seed, ov, tag=f"@tune={point_slug(point)}")
            for seed in proto.seeds]


def _score(spec: RunSpec, metric: str) -> float:
    from fedloom.report.compare import load_run, metric_value

    if not spec.done:
        return math.nan
    return metric_value(load_run(spec.out), metric)


def tune_protocol(suite: Suite, workers: int, log: Callable[[str], None]
                  ) -> dict[tuple[str, str], dict[str, Any]]:
    """Run the tuning protocol (fedloom.tuning); return {(setting, method): chosen
    point} and keep every trial in ``suite.trials``. ``workers=0``: run nothing
    (:class:`FileNotFoundError` when a trial has not finished)."""
    from fedloom.report.compare import lower_is_better

    proto = suite.tuning.protocol
    assert proto is not None

    def metric_of(method: str) -> str:
        return suite.tuning.method_metric.get(method, proto.metric)

    pairs = [(s, m) for s in suite.settings for m in suite.methods
             if _applies(suite, m, s) and suite.tuned(m)]
    trials: dict[tuple[str, str], list[Trial]] = {pair: [] for pair in pairs}
    specs: dict[tuple[str, str, int], list[RunSpec]] = {}

    def run_trials(sps: list[RunSpec]) -> None:
        suite.trial_specs.extend(sps)  # the page's compute counts them
        _run_trials(sps, workers, log, suite.fallbacks)

    def record(step_pairs: list[tuple[str, str]], index: int) -> None:
        for pair in step_pairs:
            t = trials[pair][index]
            for spec in specs[(*pair, index)]:
                t.scores[spec.seed] = _score(spec, metric_of(pair[1]))

    if proto.sampler == "halving":
        from fedloom.sweep.halving import tune_halving

        trials = tune_halving(suite, pairs, lower_is_better, metric_of,
                              run_trials,
                              continue_runs=workers > 0)
    elif proto.sampler == "grid":
        for pair in pairs:
            for i, point in enumerate(grid_points(suite.space(*pair), proto.budget, proto.seed,
                                                  *pair)):
                trials[pair].append(Trial(i, point))
                specs[(*pair, i)] = _trial_specs(suite, *pair, point)
        run_trials([sp for v in specs.values() for sp in v])
        for i in range(proto.budget):
            record(pairs, i)
    else:
        # TPE: trial i of every (setting, method) from its trials 0 … i−1, one step at a time
        for i in range(proto.budget):
            for pair in pairs:
                point = tpe_point(suite.space(*pair), trials[pair], i, proto.seed, *pair,
                                  lower=lower_is_better(metric_of(pair[1])),
                                  startup=proto.startup)
                trials[pair].append(Trial(i, point))
                specs[(*pair, i)] = _trial_specs(suite, *pair, point)
            run_trials([sp for pair in pairs for sp in specs[(*pair, i)]])
            record(pairs, i)
    suite.trials = trials
    choose = halving_choice if proto.sampler == "halving" else best_trial
    chosen = {pair: dict(choose(ts, lower_is_better(metric_of(pair[1]))).params)
              for pair, ts in trials.items()}
    for method, source in suite.tuning.shared.items():
        for setting in suite.settings:
            if _applies(suite, method, setting) and (setting, source) in chosen:
                own = {o.split("=", 1)[0] for o in suite.methods[method]}
                # a method's own overrides win over the values it borrows
                chosen[(setting, method)] = {k: v for k, v in chosen[(setting, source)].items()
                                             if k not in own}
    _write_tuning_record(suite, chosen)
    return chosen


def _run_trials(specs: list[RunSpec], workers: int, log: Callable[[str], None],
                fallbacks: list[str]) -> None:
    """Tuning runs: one that fails scores worst (NaN) and the tuning goes on. Trials
    in ``out:`` that hold another config stop the sweep (:class:`StaleRunsError`), as
    main runs do: a stale trial must not be scored, nor chosen. ``fallbacks``: as
    :func:`~fedloom.sweep.running._run_all`'s."""
    try:
        _run_all(specs, workers, log, fallbacks)
    except StaleRunsError:
        raise
    except SweepError as e:
        log(f"tuning: {e} (those trials score worst)")


def _write_tuning_record(suite: Suite, chosen: dict[tuple[str, str], dict[str, Any]]) -> None:
    """``OUT/NAME.tuning.json``: the protocol, every trial with its per-seed scores, the
    choice (named by the suite: suites may share ``out:`` and so reuse runs)."""
    proto = suite.tuning.protocol
    assert proto is not None
    rec: dict[str, Any] = {
        "budget": proto.budget, "sampler": proto.sampler, "seeds": proto.seeds,
        "metric": proto.metric, "method_metric": dict(suite.tuning.method_metric),
        "rounds": proto.rounds, "settings": {}}
    if proto.sampler == "halving":
        rec.update(eta=proto.eta, min_rounds=proto.min_rounds, brackets=proto.brackets)
    for (setting, method), ts in suite.trials.items():
        rec["settings"].setdefault(setting, {})[method] = {
            "chosen": chosen[(setting, method)],
            "trials": [{"index": t.index, "params": t.params,
                        "scores": {str(k): v for k, v in t.scores.items()},
                        "score": t.score,
                        **({"rung": t.rung, "rounds": t.rounds, "cost": t.cost,
                            "rung_scores": {str(r): v for r, v in t.rung_scores.items()}}
                           if t.rung is not None else {})} for t in ts],
            **({"plan": proto.plans[(setting, method)]}
               if (setting, method) in proto.plans else {})}
    # replaced whole: a link there is replaced, never written through
    write_output(suite.out / f"{suite.name}.tuning.json", json.dumps(rec, indent=1, default=str))


def sensitivity_specs(suite: Suite, chosen: dict[tuple[str, str], Any]
                      ) -> dict[tuple[str, str], list[tuple[Any, list[RunSpec]]]]:
    """The sensitivity runs (fedloom.tuning): per (setting, method), per value of the
    key, the reported seeds with the other keys at their chosen values. A value equal
    to the chosen one is the main run itself."""
    proto = suite.tuning.protocol
    if proto is None or not proto.sensitivity:
        return {}
    key = proto.sensitivity["key"]
    out: dict[tuple[str, str], list[tuple[Any, list[RunSpec]]]] = {}
    for setting in suite.settings:
        for method in suite.methods:
            if not (_applies(suite, method, setting) and _sensitive(suite, method)):
                continue
            point = dict(chosen.get((setting, method), {}))
            rows = []
            for v in _sens_values(suite, setting, method):
                if key in point and point[key] == v:
                    tag, pov = "", _point_overrides(suite, method, point)
                else:
                    tag = f"@sens={point_slug({key: v})}"
                    pov = [*_point_overrides(suite, method, point), *overrides({key: v})]
                rows.append((v, [_spec(suite, setting, method, seed, pov, tag=tag)
                                 for seed in suite.seeds]))
            out[(setting, method)] = rows
    return out


def _point_overrides(suite: Suite, method: str, point: dict[str, Any]) -> list[str]:
    """A method's overrides with its chosen point: after its own (tuned), or before
    them (borrowed by share_tuning: its own values win)."""
    if method in suite.tuning.shared:
        return [*overrides(point), *suite.methods[method]]
    return [*suite.methods[method], *overrides(point)]


def _tune(suite: Suite, workers: int, log: Callable[[str], None]) -> dict[tuple[str, str], Any]:
    if suite.tuning.protocol is not None:
        return tune_protocol(suite, workers, log)
    return tuned_values(suite, workers, log)


def main_specs(suite: Suite, chosen: dict[tuple[str, str], Any]) -> list[RunSpec]:
    specs = []
    for setting in suite.settings:
        for method, ov in suite.methods.items():
            if method in suite.method_settings and setting not in suite.method_settings[method]:
                continue
            value = chosen.get((setting, method))
            if suite.tuning.protocol is not None:
                pov = _point_overrides(suite, method, dict(value or {}))
                specs += [_spec(suite, setting, method, seed, pov) for seed in suite.seeds]
                continue
            if any(TUNE in o for o in ov) and value is None:
                raise ConfigError(f"methods.{method}: uses {TUNE} but has no tune entry")
            ov2 = [o.replace(TUNE, str(value)) for o in ov]
            for seed in suite.seeds:
                specs.append(_spec(suite, setting, method, seed, ov2))
    return specs
