"""Successive halving of a sweep's tuning trials (``tuning: {sampler: halving}``).

The algorithm and its properties are :mod:`fedloom.tuning`'s (its module
docstring, :func:`~fedloom.tuning.halving_rungs`, :func:`~fedloom.tuning.promote`);
here are its runs. Rung ``k`` of every (setting, method) runs together
(``workers`` at a time), then each keeps its best. A trial's run at ``r``
rounds is ``OUT/SETTING/METHOD@tune=POINT@rR/seedS`` (the last rung's, at the
tuning rounds, is the grid sampler's folder ``METHOD@tune=POINT``). A promoted
trial's next run starts as a copy of its finished run (less ``summary.json``,
so the sweep resumes it) and continues from its last checkpoint to the next
rung's rounds; a checkpoint at the end of each rung is asked for when the
setting's config has none (``checkpoint.every`` changes no result), and
dropped again from the last rung's runs, which are never continued.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedloom.config import ConfigError, load_config
from fedloom.engine.runs.directory import CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE
from fedloom.sweep.suite import RunSpec, Suite, _spec
from fedloom.tuning import (
    Trial,
    grid_points,
    halving_rungs,
    hyperband_brackets,
    overrides,
    plan_rounds,
    point_slug,
    promote,
)

Pair = tuple[str, str]


def _base_overrides(suite: Suite, setting: str, method: str, point: dict[str, Any]
                    ) -> list[str]:
    return [*suite.methods[method], *overrides(point)]


def _plan_config(suite: Suite, setting: str, method: str, point: dict[str, Any]) -> Any:
    """The trial's config as a run would load it (its rounds, cohort and schedule),
    read as data: the plan needs no plug-in's code, and ``--report-only`` runs none
    (a sweep that runs has checked its configs, plug-ins imported, already)."""
    s = suite.settings[setting]
    return load_config(s["config"], [*s.get("overrides", []),
                                     *_base_overrides(suite, setting, method, point)],
                       plugins=False)


class _Plan:
    """One (setting, method)'s halving: its rungs, whether a promoted trial continues
    its run, the checkpoint override that lets it, and the cost of one trial-round."""

    def __init__(self, suite: Suite, setting: str, method: str, point: dict[str, Any]
                 ) -> None:
        proto = suite.tuning.protocol
        assert proto is not None and proto.min_rounds is not None
        self.proto = proto
        cfg = _plan_config(suite, setting, method, point)
        self.rounds: int = suite.settings[setting].get("tuning_rounds", proto.rounds) \
            or cfg.rounds
        if proto.min_rounds > self.rounds:
            raise ConfigError(f"tuning.min_rounds: {proto.min_rounds} is above the "
                              f"{self.rounds} tuning rounds of setting {setting}")
        self.rungs = halving_rungs(proto.budget, self.rounds, proto.min_rounds, proto.eta)
        # cosine's rate at round t depends on the total: a longer run is another run
        self.extend = cfg.client.schedule.name != "cosine"
        # a run of r rounds must leave a checkpoint at r to be continued (the engine
        # writes one at a run's end whenever checkpoint.every > 0)
        self.ckpt = ([f"checkpoint.every={self.rounds}"]
                     if self.extend and not cfg.checkpoint.every else [])
        # client rounds of one round of one trial: cohort size × tuning seeds
        self.unit = int(cfg.cohort.size) * len(proto.seeds)

    def rounds_to(self, rung: int, rungs: list[tuple[int, int]] | None = None) -> int:
        """Rounds a trial has run when it ends rung ``rung`` (of ``rungs``: its
        bracket's; by default the plan's one bracket)."""
        rs = [r for r, _ in (rungs or self.rungs)[:rung + 1]]
        return rs[-1] if self.extend else sum(rs)

    def groups(self, budget: int) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """(trial indices, rungs) of each bracket: one of every trial, or Hyperband's
        (``brackets: true``, :func:`fedloom.tuning.hyperband_brackets`)."""
        proto = self.proto
        assert proto.min_rounds is not None
        if not proto.brackets:
            return [(list(range(budget)), self.rungs)]
        return hyperband_brackets(budget, self.rounds, proto.min_rounds, proto.eta)


def _specs(suite: Suite, setting: str, method: str, point: dict[str, Any], rounds: int,
           plan: _Plan) -> list[RunSpec]:
    """The trial's runs (one per tuning seed) at ``rounds`` rounds."""
    proto = suite.tuning.protocol
    assert proto is not None
    ov = [*_base_overrides(suite, setting, method, point), f"rounds={rounds}", *plan.ckpt]
    tag = f"@tune={point_slug(point)}"
    if rounds != plan.rounds:
        tag += f"@r{rounds}"
    return [_spec(suite, setting, method, seed, ov, tag=tag) for seed in proto.seeds]


def _continue_from(prev: RunSpec, spec: RunSpec) -> None:
    """Start ``spec``'s run as a copy of the finished ``prev`` (fewer rounds), less its
    summary: the sweep then resumes it from the copied checkpoint with more rounds."""
    if spec.out.exists() or not prev.done:
        return  # done or stopped already (the sweep resumes it), or nothing to continue
    tmp = spec.out.with_name(spec.out.name + ".copying")
    shutil.rmtree(tmp, ignore_errors=True)  # a copy a killed sweep left half made
    # the resume reads the newest checkpoint; the one before it is only a fallback
    prev_ckpt = Path(PREVIOUS_CHECKPOINT_FILE).name
    shutil.copytree(prev.out, tmp, symlinks=True, ignore=shutil.ignore_patterns(prev_ckpt))
    (tmp / "summary.json").unlink()
    tmp.rename(spec.out)  # whole or not at all: a half copy is never resumed


def _drop_checkpoints(specs: list[RunSpec]) -> None:
    """Remove the checkpoints the sweep asked of a last rung's finished runs: a run of
    the tuning rounds is never continued (a per-client state such as Ditto's personal
    models makes each checkpoint tens of MB)."""
    for spec in specs:
        if spec.done:
            shutil.rmtree(spec.out / Path(CHECKPOINT_FILE).parent, ignore_errors=True)


def _rung_score(spec: RunSpec, metric: str) -> float:
    """The run's selection metric at its end; NaN when it has not finished, or when its
    summary holds the engine's divergence warning (the training loss blew up)."""
    from fedloom.report.compare import load_run, metric_value

    if not spec.done:
        return math.nan
    run = load_run(spec.out)
    if run.summary.get("warnings"):
        return math.nan
    return metric_value(run, metric)


def tune_halving(suite: Suite, pairs: list[Pair], lower: Callable[[str], bool],
                 metric_of: Callable[[str], str], run_trials: Callable[[list[RunSpec]], None],
                 continue_runs: bool = True) -> dict[Pair, list[Trial]]:
    """Successive halving over each pair's grid trials (module docstring); returns
    every trial with its rung, rounds, scores and cost, and fills ``proto.plans``.
    ``run_trials`` runs a rung's runs; ``continue_runs=False`` (a report only) makes
    no copy of a run to continue."""
    proto = suite.tuning.protocol
    assert proto is not None
    trials: dict[Pair, list[Trial]] = {}
    plans: dict[Pair, _Plan] = {}
    # a unit is one bracket of one pair: its trials go through its rungs together
    units: list[tuple[Pair, list[tuple[int, int]]]] = []
    alive: list[list[int]] = []
    for pair in pairs:
        points = grid_points(suite.space(*pair), proto.budget, proto.seed, *pair)
        trials[pair] = [Trial(i, p) for i, p in enumerate(points)]
        plans[pair] = _Plan(suite, *pair, points[0])
        for idx, rungs in plans[pair].groups(len(points)):
            units.append((pair, rungs))
            alive.append(idx)
    done_specs: dict[tuple[Pair, int], list[RunSpec]] = {}  # each trial's last rung's runs
    for k in range(max(len(r) for _, r in units)):
        step: dict[tuple[Pair, int], tuple[list[RunSpec], list[tuple[int, int]]]] = {}
        for u, (pair, rungs) in enumerate(units):
            if k >= len(rungs):
                continue
            for i in alive[u]:
                step[(pair, i)] = (_specs(suite, *pair, trials[pair][i].params, rungs[k][0],
                                          plans[pair]), rungs)
        if not step:
            break
        if k > 0 and continue_runs:
            for (pair, i), (specs, _) in step.items():
                if plans[pair].extend:
                    for prev, spec in zip(done_specs[(pair, i)], specs, strict=True):
                        _continue_from(prev, spec)
        run_trials([sp for specs, _ in step.values() for sp in specs])
        for (pair, i), (specs, rungs) in step.items():
            t, plan = trials[pair][i], plans[pair]
            t.scores = {sp.seed: _rung_score(sp, metric_of(pair[1])) for sp in specs}
            t.rung, t.rounds = k, rungs[k][0]
            t.rung_scores[t.rounds] = t.score
            t.cost = plan.rounds_to(k, rungs) * plan.unit
            done_specs[(pair, i)] = specs
            if k == len(rungs) - 1 and plan.ckpt and continue_runs:
                _drop_checkpoints(specs)
        for u, (pair, rungs) in enumerate(units):
            if k + 1 < len(rungs):
                alive[u] = promote({i: trials[pair][i].score for i in alive[u]},
                                   rungs[k + 1][1], lower(metric_of(pair[1])))
            else:
                alive[u] = []
    for pair, plan in plans.items():
        groups = [rungs for p, rungs in units if p == pair]
        proto.plans[pair] = {
            "rungs": [{"rounds": r, "trials": n} for rungs in groups for r, n in rungs],
            "brackets": [[{"rounds": r, "trials": n} for r, n in rungs] for rungs in groups],
            "continued": plan.extend,
            "client_rounds": sum(plan_rounds(r, plan.extend) for r in groups) * plan.unit,
            "used": sum(t.cost or 0 for t in trials[pair]),
            "grid": proto.budget * plan.rounds * plan.unit}
    return trials
