"""A round: plan → train → uplink → receive → server → scatter → record.

Each stage is one call into its module (:mod:`~fedloom.engine.dispatch`,
the backend, :mod:`~fedloom.engine.uplink`, :mod:`~fedloom.engine.receive`,
:mod:`~fedloom.engine.server`, :mod:`~fedloom.engine.scatter`,
:mod:`~fedloom.engine.record`, :mod:`~fedloom.engine.evaluation`); the system
model (``system.*``), when on, wraps training and the uplink. The round names
no algorithm.

What never reaches the model (each counted in the round's metrics, the run's
totals and the summary, and logged): **rejected updates** (non-finite,
undecodable, a non-finite state row, or out of the size rules; checked on
the dense update before encoding and on the decoded row), **clipped
updates** (``server.clip_norm``) and **rejected rounds** (the rule raised or
returned a bad direction, or a step or new state is not finite: the model
and every server and client state stay exactly as before the round, so a
resumed run is bit-identical through it; its bytes, counts and the iterate
average are kept). Departure for the Flower integration
(``client_state=False``): the clients hold their own state and have already
updated it when they sent; the server cannot undo that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fedloom.buffers import load_buffers
from fedloom.compress.feedback import UplinkResult
from fedloom.engine.dispatch import plan_round
from fedloom.engine.evaluation import evaluate_global, evaluate_personal
from fedloom.engine.receive import receive
from fedloom.engine.record import account_privacy, add_totals, round_metrics
from fedloom.engine.records import RoundPlan, RunState
from fedloom.engine.scatter import next_buffers, scatter
from fedloom.engine.server import server_round
from fedloom.engine.setup import Setup
from fedloom.engine.uplink import uplink_round
from fedloom.job import ClientResult

__all__ = ["finish_round", "run_round"]


def run_round(exp: Setup, st: RunState) -> tuple[RunState, dict[str, Any]]:
    """Run round ``st.next_round``; return the new state and its metrics."""
    t0 = time.perf_counter()
    plan = plan_round(exp, st)
    sysm = exp.system
    if sysm is None:
        raw = exp.backend.train_cohort(plan.jobs)
    else:  # dropouts, partial work (fedloom.system)
        sim = sysm.begin(plan, exp)
        raw = sim.train(exp.backend, plan.jobs)
    t_train = time.perf_counter() - t0
    results, ups = uplink_round(exp, st, plan, raw)
    if sysm is None:
        return finish_round(exp, st, plan, results, ups, t0=t0, t_train=t_train)
    results, ups = sysm.after_uplink(sim, plan, exp, results, ups)  # timing, late
    new, metrics = finish_round(exp, st, plan, results, ups, t0=t0, t_train=t_train)
    return sysm.finish(sim, st, new, metrics)


def finish_round(exp: Setup, st: RunState, plan: RoundPlan, results: Sequence[ClientResult],
                 ups: Sequence[UplinkResult], *, t0: float, t_train: float,
                 client_state: bool = True, client_buffers: bool = False
                 ) -> tuple[RunState, dict[str, Any]]:
    """The server's half of a round, from what the kept clients sent: receive
    (reject, clip), aggregate and step (a bad step is skipped, the round counted
    in ``rejected_rounds``), scatter client state (unless the clients keep it
    themselves: ``client_state=False``; ``client_buffers=True`` still keeps the
    accepted clients' own buffers under ``model.buffers=local``), evaluate, log."""
    r = plan.round
    rx = receive(exp, st, plan, results, ups)
    t1 = time.perf_counter()
    out = server_round(exp, st, plan, results, ups, rx)
    method_state, buffers = st.method_state, st.buffers
    if out.bad_round is None:
        method_state = scatter(exp, st, plan, results, ups, rx.ok, client_state=client_state,
                               client_buffers=client_buffers)
        buffers = next_buffers(exp, st, results, rx.ok)
    t_agg = time.perf_counter() - t1
    w_avg = st.w_avg
    if w_avg is not None:  # mean of w_0 … w_{r+1}
        w_avg = w_avg + (out.w - w_avg) / (r + 2)
    totals = add_totals(st.totals, rx, out)
    metrics = round_metrics(exp, plan, results, ups, rx, out, totals)
    load_buffers(exp.module, buffers)  # evaluations see the new global buffers
    if (r + 1) % exp.cfg.eval.every == 0 or r + 1 == exp.cfg.rounds:
        metrics.update(evaluate_global(exp, w_avg if w_avg is not None else out.w))
        if exp.method.personal:
            metrics.update(evaluate_personal(exp, out.w))
    metrics["train_s"] = t_train
    metrics["agg_s"] = t_agg
    metrics["wall_s"] = time.perf_counter() - t0
    privacy_state = account_privacy(exp, plan, results, out.privacy_state, metrics)
    return RunState(r + 1, out.w, out.opt_state, out.agg_state, method_state,
                    out.feedback_state, w_avg, totals, privacy_state=privacy_state,
                    buffers=buffers), metrics
