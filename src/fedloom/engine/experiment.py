"""The running experiment: the built components, and a round composed of its stages.

:class:`Experiment` is :class:`~fedloom.engine.setup.Setup` (every component
of the run, and the values the stages read: :class:`~fedloom.engine.algorithm.Algorithm`,
:class:`~fedloom.engine.parts.ModelSpace`, :class:`~fedloom.engine.parts.ClientData`,
:class:`~fedloom.engine.parts.Schedule`, :class:`~fedloom.engine.parts.ScreenRules`,
:class:`~fedloom.engine.stages.evaluation.Evaluator`) with a round as methods, for the
callers that drive a round whole (:func:`fedloom.engine.runs.loop.run`) or in parts
(Flower's strategy: plan, then what the clients sent, then the server's half).

A round is plan → train → uplink → receive → server → scatter → record, one
call into its module each (:mod:`~fedloom.engine.stages.plan`, the backend,
:mod:`~fedloom.engine.stages.uplink`, :mod:`~fedloom.engine.stages.receive`,
:mod:`~fedloom.engine.stages.server`, :mod:`~fedloom.engine.stages.scatter`,
:mod:`~fedloom.engine.stages.tally`, :mod:`~fedloom.engine.stages.evaluation`); each stage is
handed the values it reads, never the experiment. The system model
(``system.*``), when on, wraps training and the uplink. The round names no
algorithm.

What never reaches the model (each counted in the round's metrics, the run's
totals and the summary, and logged):

- **Rejected updates** (``rejected_updates``, ids in ``rejected_clients``,
  reasons in ``rejected_reasons``). A client is rejected, for the round only,
  when its update is non-finite, cannot be encoded or decoded (a
  :class:`~fedloom.compress.base.PayloadError`, ``ValueError`` or overflow
  from its compressor: the run goes on), holds a non-finite state row, or
  fails :func:`~fedloom.engine.stages.screen.screen_updates` (``server.max_update_norm``,
  ``server.max_norm_ratio``). The rules run twice: on the dense update before
  encoding (a client never sends what the server would refuse, and a huge
  value in a coordinate a sparsifier leaves out is still seen), and on the
  decoded row the aggregator would receive (the server's own check, the one
  that holds for deployed clients too). A rejected client is treated as one
  whose worker failed: nothing of it is aggregated and its state rows stay as
  they were.
- **Clipped updates** (``clipped_updates``): with ``server.clip_norm`` every
  accepted row is scaled to at most that norm before any aggregator
  (:func:`~fedloom.engine.stages.screen.clip_rows`), so it composes with every rule and compressor.
- **Rejected rounds** (``rejected_rounds``, reason in
  ``rejected_round_reason``): the aggregator raised (a ``LinAlgError`` or any
  ``RuntimeError``/``ValueError``/``ArithmeticError``), or returned a
  direction that is not a finite vector of the model's size, or the server
  optimizer's step, the feedback policy's shift or the new server states are
  not finite. The round's step is skipped: the model, the server optimizer's
  state, the aggregator's state, the feedback policy's server state (SA-PEF's
  ``L̂``, SCAFCOM's ``c``), the local method's server state and every client's
  state rows (EF residuals, EF21's ``h_k``, SCAFFOLD/SCAFCOM control variates,
  Ditto's personal models, FedBN's buffers) and the global module buffers
  (BatchNorm statistics) are exactly those before the round — a resumed run
  is bit-identical to an uninterrupted one through it. What the round did
  happen is kept: its bytes (``uplink_bytes``/``downlink_bytes``), its counts,
  and the running iterate average (``eval.average_iterates``), which averages
  the unchanged model as that round's iterate so it stays the mean of
  ``w_0 … w_{r+1}``. Departure for the Flower integration
  (``client_state=False``): the clients hold their own state and have already
  updated it when they sent; the server cannot undo that, so there a rejected
  round leaves the clients' residuals (and, under ``model.buffers=local``,
  their own buffers) as the clients wrote them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from fedloom.buffers import load_buffers
from fedloom.capabilities import backend_caps
from fedloom.engine.clientfields import FEEDBACK
from fedloom.engine.runstate import RoundOutcome, RoundPlan, RunState, withdraw
from fedloom.engine.setup import Setup
from fedloom.engine.stages.plan import plan_round
from fedloom.engine.stages.receive import RowBuffer, receive
from fedloom.engine.stages.scatter import next_buffers, scatter
from fedloom.engine.stages.screen import all_finite
from fedloom.engine.stages.server import server_round, server_rule
from fedloom.engine.stages.tally import (
    account_privacy,
    add_totals,
    round_metrics,
    selection_feedback,
)
from fedloom.engine.stages.uplink import EarlyUplink, client_postprocessors, uplink_round
from fedloom.job import ClientResult
from fedloom.system import samples_for_steps

__all__ = ["Experiment"]

log = logging.getLogger("fedloom")


class Experiment(Setup):
    """A config turned into typed objects, and its rounds.

    Building it validates everything that needs the data or the model (e.g. an
    aggregator option), so a bad run fails before any file is written.
    """

    def round(self, st: RunState) -> tuple[RunState, dict[str, Any]]:
        """Run round ``st.next_round``; return the new state and its metrics. In the
        event-driven modes (``system.mode`` async, buffered) a round is one server
        step (:mod:`fedloom.engine.events`)."""
        if self.events is not None:
            return self.events.step(self, st)
        t0 = time.perf_counter()
        plan = self.plan_round(st)
        sysm = self.system
        early = self._early_uplink(st, plan) if sysm is None else None
        if early is not None:
            raw = self.backend.train_cohort(plan.jobs, on_result=early)
        elif sysm is None:
            raw = self.backend.train_cohort(plan.jobs)
        else:  # dropouts, partial work (fedloom.system): the plan with its cut budgets
            plan, sim = sysm.begin(plan, self.clients, self.trainer, self.layout.size,
                                   self.downlink_size)
            raw = sim.train(self.backend, plan.jobs)
        t_train = time.perf_counter() - t0
        if sysm is None:
            plan, outcome = self.uplink_round(st, plan, raw, early)
            return self.finish_round(st, plan, outcome, t0=t0, t_train=t_train)
        plan, outcome = self.uplink_round(st, plan, raw, withheld=set(sim.withheld))
        gone = sysm.after_uplink(sim, self.clients, self.downlink_size,
                                 outcome.results, outcome.ups)  # timing, late
        if gone:
            plan, outcome = withdraw(plan, outcome, gone)
        new, metrics = self.finish_round(st, plan, outcome, t0=t0, t_train=t_train,
                                         times=sim.times if sysm.timed else None,
                                         late=sim.late, deadline_s=sysm.cfg.deadline_s)
        return sysm.finish(sim, st, new, metrics)

    def plan_round(self, st: RunState, cohort: torch.Tensor | None = None) -> RoundPlan:
        """The round's cohort (``cohort``: these clients) and fully specified client
        jobs (:func:`~fedloom.engine.stages.plan.plan_round`)."""
        return plan_round(self.algorithm, self.clients, self.space, self.schedule, st,
                          hooks=self.client_metrics, view=self.hook_view,
                          ships_indices=backend_caps(self.backend).ships_indices,
                          cohort=cohort)

    def uplink_round(self, st: RunState, plan: RoundPlan,
                     raw: Sequence[ClientResult | None], early: EarlyUplink | None = None,
                     withheld: Collection[int] = ()) -> tuple[RoundPlan, RoundOutcome]:
        """The kept clients' plan and what they send
        (:func:`~fedloom.engine.stages.uplink.uplink_round`)."""
        return uplink_round(self.algorithm, client_postprocessors(self.attack, self.privacy),
                            self.rules, self.schedule, self.device, st, plan, raw, early,
                            withheld)

    def _early_uplink(self, st: RunState, plan: RoundPlan) -> EarlyUplink | None:
        """Each client's own uplink work, done as its result arrives, where the
        backend hands results over one by one (``process``): on 50 clients a round
        it was a serial tail after the workers returned, the cores idle but one."""
        caps = backend_caps(self.backend)
        if not caps.streams or not EarlyUplink.applies(
                self.algorithm, client_postprocessors(self.attack, self.privacy),
                self.device, plan):
            return None
        space = self.space
        buffer = self._server_rows()
        rows = buffer.rows(len(plan.jobs), space.layout.size, space.dtype, space.device)
        if caps.writes_rows and caps.shared_rows:
            # the workers write each update into its server row: no copy of it here
            buffer.share()
        return EarlyUplink(self.algorithm, self.schedule, st, plan, rows)

    def _server_rows(self) -> RowBuffer:
        """The server's ``[m, d]`` rows: one buffer for the run, written over every round."""
        rows = self.__dict__.get("_row_buffer")
        if rows is None:
            rows = self.__dict__["_row_buffer"] = RowBuffer()
        return rows

    def finish_round(self, st: RunState, plan: RoundPlan, outcome: RoundOutcome, *,
                     t0: float, t_train: float,
                     client_state: bool = True, client_buffers: bool = False,
                     times: Mapping[int, float] | None = None, late: Sequence[int] = (),
                     deadline_s: float | None = None) -> tuple[RunState, dict[str, Any]]:
        """The server's half of a round, from what the kept clients sent (``plan``:
        theirs, ``outcome``: what they sent, :meth:`uplink_round`): receive
        (reject, clip), aggregate and step (a bad step is skipped, the round counted
        in ``rejected_rounds``), scatter client state (unless the clients keep it
        themselves: ``client_state=False``; ``client_buffers=True`` still keeps the
        accepted clients' own buffers under ``model.buffers=local``), evaluate, log;
        tell the client selector what the server received (with the system model's
        round times ``times`` of the reporting clients, the ``late`` ones and the
        deadline, where it is on)."""
        r, results, ups = plan.round, outcome.results, outcome.ups
        algo, space, clients = self.algorithm, self.space, self.clients
        rx = receive(algo, space, self.rules, self.downlink_size, st, plan, outcome,
                     self._server_rows())
        t1 = time.perf_counter()
        out = server_round(algo, server_rule(self.privacy, algo.aggregator), space,
                           clients.num_clients, st, plan, results, ups, rx)
        method_state, buffers = st.method_state, st.buffers
        if out.bad_round is None:
            method_state = scatter(algo.method, clients, space.dtype, st, plan, results, ups,
                                   rx.ok, client_state=client_state,
                                   client_buffers=client_buffers)
            buffers = next_buffers(space.buffer_policy, st, results, rx.ok)
            # a local method's server-side correction of the new model (FedDyn's − h/α);
            # one that is not finite is not applied
            adjusted = algo.method.adjust_model(out.w, method_state)
            if all_finite(adjusted):
                out.w = adjusted
            else:
                log.warning("round %d: the local method's model correction is not finite; "
                            "not applied", r + 1)
        t_agg = time.perf_counter() - t1
        w_avg = st.w_avg
        if w_avg is not None:  # mean of w_0 … w_{r+1}
            w_avg = w_avg + (out.w - w_avg) / (r + 2)
        totals = add_totals(st.totals, rx, out)
        metrics = round_metrics(algo.feedback, self.client_metrics,
                                clients.fields.has(FEEDBACK), plan, outcome, rx, out, totals)
        load_buffers(space.module, buffers)  # evaluations see the new global buffers
        every, rounds = self.cfg.eval.every, self.cfg.rounds
        if (r + 1) % every == 0 or r + 1 == rounds:
            ev = self.evaluator
            metrics.update(ev.global_(w_avg if w_avg is not None else out.w))
            if algo.method.personal:
                metrics.update(ev.personal(out.w))
            if ev.settings.finetune_steps:
                metrics.update(ev.finetuned(out.w, r))
        metrics["train_s"] = t_train
        per_sample = self.fed.dataset.tokens_per_sample
        if per_sample:  # token data: what local training put through (train_tokens_per_s)
            batch = self.cfg.client.batch_size
            metrics["train_tokens"] = per_sample * sum(
                samples_for_steps(res.steps, len(clients.fed.train[res.client]), batch)
                for res in results)
        metrics["agg_s"] = t_agg
        metrics["wall_s"] = time.perf_counter() - t0
        privacy_state = account_privacy(self.privacy, plan, outcome, out.privacy_state,
                                        metrics)
        selection_state = self.schedule.observe(plan.selection_state, selection_feedback(
            plan, outcome, rx, self.cfg.client.batch_size, times=times, late=late,
            deadline_s=deadline_s))
        return RunState(r + 1, out.w, out.opt_state, out.agg_state, method_state,
                        out.feedback_state, w_avg, totals, privacy_state=privacy_state,
                        buffers=buffers, selection_state=selection_state), metrics

    def evaluate(self, w: torch.Tensor) -> dict[str, float]:
        """Global test accuracy/loss and per-client accuracy statistics of ``w``
        (:meth:`~fedloom.engine.stages.evaluation.Evaluator.global_`)."""
        return self.evaluator.global_(w)
