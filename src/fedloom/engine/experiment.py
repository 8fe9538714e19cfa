"""The running experiment: three values bound to a model, and a round of its stages.

``Experiment(algorithm, federation, runtime, model)`` binds an
:class:`~fedloom.engine.values.Algorithm`, a :class:`~fedloom.engine.values.Federation`
and a :class:`~fedloom.engine.values.Runtime` to the model (:mod:`fedloom.engine.binding`);
:meth:`Experiment.from_config` builds the values of a config first
(:mod:`fedloom.engine.build`). ``state = exp.init()``, then ``state, metrics =
exp.round(state)``: the experiment holds no run state, so states advance side by side
on one experiment and a checkpoint is the state (:mod:`fedloom.engine.snapshot`); a
round updates the state's client rows in place, returned in the new state
(:class:`~fedloom.engine.runstate.RunState`: ``copy()`` keeps an old one). Kept between
rounds is workspace only: the server's row buffer, and the module models are loaded
into. Callers drive a round whole (:func:`fedloom.engine.runs.loop.run`) or in parts
(Flower's strategy: plan, what the clients sent, the server's half).

A round is plan → train → uplink → receive → server → scatter → record, one call
into its stage each (:mod:`fedloom.engine.stages`), each handed the values it reads,
never the experiment; the system model, when on, wraps training and the uplink.
What never reaches the model (rejected updates, clipped updates, rejected rounds:
counted in the metrics, the totals and the summary, and logged) is on
docs/explanation/reliability.md; a rejected round leaves model, server states,
client rows and buffers exactly as before it, so a resume stays bit-identical.
Departure for Flower (``client_state=False``): the clients keep their own rows and
have updated them when they sent, so a rejected round cannot undo them there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedloom.aggregate.base import Aggregator
from fedloom.buffers import load_buffers
from fedloom.capabilities import backend_caps, backend_close
from fedloom.client.sgd import LocalSGD
from fedloom.compress.base import Compressor
from fedloom.compress.feedback.base import NoFeedback
from fedloom.config import Config, ConfigError, EvalConfig
from fedloom.data.federated import FederatedData
from fedloom.data.sources import Dataset
from fedloom.device import (
    apply_threads,
    configure,
    describe,
    keep_freed_heap,
    reset_peak,
    to_device,
)
from fedloom.engine.binding import bind
from fedloom.engine.build import Model, build
from fedloom.engine.build import describe as describe_values
from fedloom.engine.clientfields import FEEDBACK, ClientFields
from fedloom.engine.events import ClientClock
from fedloom.engine.inputs import HookView
from fedloom.engine.objects import OBJECT_PREFIX, Components
from fedloom.engine.runs.legacy import Fresh
from fedloom.engine.runstate import RoundOutcome, RoundPlan, RunState, withdraw
from fedloom.engine.snapshot import checkpoint_state, restore_state
from fedloom.engine.stages.plan import plan_round
from fedloom.engine.stages.receive import RowBuffer, receive
from fedloom.engine.stages.reference import reference_update
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
from fedloom.engine.values import Algorithm, Federation, Runtime, ServerStep
from fedloom.hooks import ClientMetric
from fedloom.job import ClientJob, ClientResult
from fedloom.metrics import evaluate
from fedloom.params import Layout
from fedloom.system import System, samples_for_steps

__all__ = ["Experiment"]

log = logging.getLogger("fedloom")


@dataclass(frozen=True)
class Origin:
    """Where a run's split and model came from (``summary.json``, ``model.pt``)."""

    partition_counts: np.ndarray  # [N, C] class counts of each client's part
    model_from_config: bool       # the model was built of the config (load_model rebuilds it)


class Experiment:
    """Three values bound to a model, and its rounds (see the module docstring).

    Binding validates everything that needs the data or the model (e.g. an
    aggregator option), so a bad run fails before any file is written. The module
    is the experiment's: a round's model is loaded into it (pass a copy to keep
    yours). Process-wide settings (torch threads, CUDA determinism) are applied
    here and put back by :meth:`close`.
    """

    def __init__(self, algorithm: Algorithm, federation: Federation, runtime: Runtime,
                 model: torch.nn.Module, *, evaluation: EvalConfig | None = None,
                 rounds: int = 30, hooks: Sequence[ClientMetric] = (),
                 state_dir: Path | None = None, record: Config | None = None,
                 model_from_config: bool = False) -> None:
        """``evaluation``: the eval section (every, batch size, iterate averaging,
        fine-tuning); ``rounds``: the run's length (the step-size schedule and the
        last evaluation read it); ``hooks``: client metrics (:mod:`fedloom.hooks`);
        ``state_dir``: where a memmap client state store keeps its files;
        ``record``: the config this experiment was built of (:meth:`from_config`;
        ``None``: described from the values, :func:`fedloom.engine.build.describe`);
        ``model_from_config``: ``model`` was built from ``record`` (already in the
        run's dtype, rebuilt by ``load_model``)."""
        evaluation = evaluation if evaluation is not None else EvalConfig()
        self.cfg = record if record is not None else describe_values(
            algorithm, federation, runtime, model, evaluation, rounds)
        self.runtime = runtime
        b = bind(algorithm, federation, runtime, model, record=self.cfg,
                 evaluation=evaluation, rounds=rounds, hooks=tuple(hooks),
                 state_dir=state_dir, user_model=not model_from_config)
        self.space, self.clients, self.algorithm = b.space, b.clients, b.algorithm
        self.backend, self.privacy, self.schedule = b.backend, b.privacy, b.schedule
        self.rules, self.evaluator, self.around = b.rules, b.evaluator, b.around
        self.origin = Origin(b.partition_counts, model_from_config)
        # what close() puts back of the process-wide settings (_apply_process_settings)
        self._restore: list[Callable[[], None]] = []
        # Workspace, not state: the server's [m, d] rows, written over by every round
        # before they are read (nothing a round returns refers to them), kept so that
        # a round neither copies nor page-faults a new m × d matrix, and so that the
        # process backend's workers can write into shared memory (receive.RowBuffer).
        self.workspace = RowBuffer()
        self.threads = self._apply_process_settings()

    @classmethod
    def from_config(cls, cfg: Config, *, state_dir: Path | None = None,
                    data: Dataset | None = None, model: Model | None = None,
                    components: Components | None = None,
                    data_check: Callable[[Dataset], None] | None = None) -> Experiment:
        """The experiment of a config (:func:`fedloom.engine.build.build`: ``data``,
        ``model`` and ``components`` replace the configured ones; ``data_check``
        sees the data as loaded, before anything writes into ``state_dir``)."""
        b = build(cfg, data=data, model=model, components=components, data_check=data_check)
        return cls(b.algorithm, b.federation, b.runtime, b.model, evaluation=b.evaluation,
                   rounds=b.rounds, hooks=b.hooks, state_dir=state_dir, record=b.record,
                   model_from_config=b.model_from_config)

    def _apply_process_settings(self) -> int:
        """Process-wide settings, last (nothing before can fail after them); close()
        puts the previous ones back. Determinism and TF32 off on CUDA
        (fedloom.device.configure); the runtime's threads for the process that trains
        (process and ray workers set their own). Returns the threads in force."""
        device = self.space.device
        self._restore.append(configure(device))
        in_process = self.runtime.backend not in ("process", "ray")
        threads, undo = apply_threads(self.runtime.threads if in_process else 0)
        if in_process and self.runtime.backend_settings.keep_heap:
            # not put back by close(): glibc cannot return to its moving thresholds
            keep_freed_heap()
        self._restore.append(undo)
        reset_peak(device)
        info = describe(device)
        log.info("device %s (%s, %.1f GB), %d threads", info["device"], info["device_name"],
                 info["device_memory_gb"], threads)
        return threads

    def close(self) -> None:
        """Stop the backend's workers, if it has any; put back the process-wide
        settings the run changed (threads, CUDA determinism flags)."""
        backend_close(self.backend)()
        while self._restore:
            self._restore.pop()()

    # ------------------------------------------------------------------ state
    def init(self) -> RunState:
        """The state of a new run: the model's weights, every server state, the
        initial buffers, the selector's state and a new client state store (every
        row zero; its own: two states never share rows), on the run's device."""
        sp = self.space
        w = sp.layout.flatten(sp.module).to(sp.dtype)
        s = self.algorithm.init(w, sp.layout)
        # Every server state on the run's device (an aggregator's init knows no device).
        return to_device(RunState(0, w, s.opt, s.agg, method_state=s.method,
                                  feedback_state=s.feedback,
                                  w_avg=w.clone() if self.evaluator.settings.average_iterates
                                  else None,
                                  privacy_state=self.privacy.init(),
                                  # the initial buffers, not the module's: evaluation
                                  # loads each round's buffers into the module
                                  buffers={n: v.clone()
                                           for n, v in sp.buffer_template.items()},
                                  selection_state=self.schedule.initial_selection(),
                                  clients=self.clients.new_store()),
                         sp.device)

    initial_state = init  # the name the run directory, SecAgg and Flower still call

    def checkpoint_state(self, st: RunState, snapshot_dir: Path | None = None
                         ) -> dict[str, Any]:
        """The checkpoint of ``st``, its client rows included
        (:func:`fedloom.engine.snapshot.checkpoint_state`)."""
        return checkpoint_state(st, self.cfg, snapshot_dir)

    def restore(self, ckpt: dict[str, Any], snapshot_dir: Path | None = None) -> RunState:
        """The run state of checkpoint ``ckpt``, its client rows loaded into a new store
        (:func:`fedloom.engine.snapshot.restore_state`)."""
        sp = self.space
        return restore_state(ckpt, self.clients.new_store(), sp.buffer_template, self.privacy,
                             sp.device, snapshot_dir)

    def fresh(self) -> Fresh:
        """What this run starts with, for the entries a checkpoint of an earlier
        version lacks (:func:`fedloom.engine.runs.legacy.current_layout`)."""
        return Fresh(has_buffers=bool(self.space.buffer_template),
                     opt_state=self.algorithm.server.init, privacy_state=self.privacy.init,
                     selection_state=self.schedule.initial_selection)

    # ------------------------------------------------------------- for hooks
    @property
    def hook_view(self) -> HookView:
        """What a round planner or client-metric plug-in reads (:mod:`fedloom.hooks`)."""
        cl = self.clients
        return HookView(self.cfg, self.space.layout, cl.fed, cl.x, cl.y, self.algorithm.local,
                        self.global_eval, self.make_uplink)

    def global_eval(self, w: torch.Tensor) -> tuple[float, float]:
        """``(accuracy, loss)`` of ``w`` on the global test set only (for hooks)."""
        ev = self.evaluator
        return evaluate(self.space.module, self.space.layout, w, ev.x_test, ev.y_test,
                        ev.settings.batch_size)

    def make_uplink(self, **options: Any) -> Compressor:
        """The configured compressor with ``options`` replacing the section's (for hooks)."""
        comp = self.cfg.compression
        if comp.name.startswith(OBJECT_PREFIX):
            raise ConfigError("compression: a round planner rebuilds the compressor with other "
                              "options; give it by name (compression.name), not as an object")
        from fedloom.compress import make_compressor

        return make_compressor(comp.name, layout=self.space.layout,
                               **{**comp.options, **options})

    # ---------------------------------------- names read while callers move to the parts
    @property
    def fed(self) -> FederatedData:
        return self.clients.fed

    @property
    def layout(self) -> Layout:
        return self.space.layout

    @property
    def module(self) -> torch.nn.Module:
        return self.space.module

    @property
    def dtype(self) -> torch.dtype:
        return self.space.dtype

    @property
    def device(self) -> torch.device:
        return self.space.device

    @property
    def buffer_template(self) -> dict[str, torch.Tensor]:
        return self.space.buffer_template

    @property
    def fields(self) -> ClientFields:
        return self.clients.fields

    @property
    def x(self) -> torch.Tensor:
        return self.clients.x

    @property
    def y(self) -> torch.Tensor:
        return self.clients.y

    @property
    def trainer(self) -> LocalSGD:
        return self.algorithm.local

    @property
    def uplink(self) -> Compressor:
        return self.algorithm.compressor

    @property
    def aggregator(self) -> Aggregator:
        return self.algorithm.aggregator

    @property
    def server(self) -> ServerStep:
        return self.algorithm.server

    @property
    def feedback(self) -> NoFeedback:
        return self.algorithm.feedback

    @property
    def requires(self) -> frozenset[str]:
        return self.algorithm.requires

    @property
    def system(self) -> System | None:
        return self.around.system

    @property
    def partition_counts(self) -> np.ndarray:
        return self.origin.partition_counts

    @property
    def model_from_config(self) -> bool:
        return self.origin.model_from_config

    def sample_cohort(self, r: int) -> torch.Tensor:
        """Round ``r``'s cohort from the selector's initial state
        (:meth:`~fedloom.engine.inputs.Schedule.sample_cohort`)."""
        return self.schedule.sample_cohort(r)

    def lr(self, r: int) -> float:
        """Round ``r``'s local step size (``client.lr`` under ``client.schedule``)."""
        return self.schedule.lr(r)

    # ------------------------------------------------------------------ rounds
    def round(self, st: RunState) -> tuple[RunState, dict[str, Any]]:
        """Run round ``st.next_round``; return the new state and its metrics. In the
        event-driven modes (``system.mode`` async, buffered) a round is one server
        step (:mod:`fedloom.engine.events`)."""
        if self.around.events is not None:
            return self.around.events.step(self, self._client_clock(), st)
        t0 = time.perf_counter()
        plan = self.plan_round(st)
        sysm = self.around.system
        early = self._early_uplink(st, plan) if sysm is None else None
        if early is not None:
            # a streaming backend's train_cohort takes on_result (BackendCaps.streams)
            streaming: Any = self.backend
            raw = streaming.train_cohort(plan.jobs, on_result=early)
        elif sysm is None:
            raw = self.backend.train_cohort(plan.jobs)
        else:  # dropouts, partial work (fedloom.system): the plan with its cut budgets
            plan, sim = sysm.begin(plan, self.clients, self.algorithm.local,
                                   self.space.layout.size, self.around.downlink_size)
            raw = sim.train(self.backend, plan.jobs)
        t_train = time.perf_counter() - t0
        if sysm is None:
            plan, outcome = self.uplink_round(st, plan, raw, early)
            return self.finish_round(st, plan, outcome, t0=t0, t_train=t_train)
        plan, outcome = self.uplink_round(st, plan, raw, withheld=set(sim.withheld))
        gone = sysm.after_uplink(sim, self.clients, self.around.downlink_size,
                                 outcome.results, outcome.ups)  # timing, late
        if gone:
            plan, outcome = withdraw(plan, outcome, gone)
        new, metrics = self.finish_round(st, plan, outcome, t0=t0, t_train=t_train,
                                         times=sim.times if sysm.timed else None,
                                         late=sim.late, deadline_s=sysm.cfg.deadline_s)
        return sysm.finish(sim, st, new, metrics)

    def _client_clock(self) -> ClientClock:
        """What the event driver's dispatch reads to time a client."""
        sysm = self.around.system
        assert sysm is not None  # the event modes run on the system model
        return ClientClock(sysm, self.around.downlink_size,
                           sysm.expected_uplink(self.algorithm.compressor, self.space.layout.size),
                           self.clients.fed.train, self.algorithm.local)

    def train_cohort(self, jobs: Sequence[ClientJob]) -> Sequence[ClientResult | None]:
        """The backend's training of ``jobs``."""
        return self.backend.train_cohort(jobs)

    def plan_round(self, st: RunState, cohort: torch.Tensor | None = None) -> RoundPlan:
        """The round's cohort (``cohort``: these clients) and fully specified client
        jobs (:func:`~fedloom.engine.stages.plan.plan_round`)."""
        return plan_round(self.algorithm, self.clients, self.space, self.schedule, st,
                          hooks=self.around.hooks, view=self.hook_view,
                          ships_indices=backend_caps(self.backend).ships_indices,
                          cohort=cohort)

    def uplink_round(self, st: RunState, plan: RoundPlan,
                     raw: Sequence[ClientResult | None], early: EarlyUplink | None = None,
                     withheld: Collection[int] = ()) -> tuple[RoundPlan, RoundOutcome]:
        """The kept clients' plan and what they send
        (:func:`~fedloom.engine.stages.uplink.uplink_round`)."""
        return uplink_round(self.algorithm, client_postprocessors(self.around.attack, self.privacy),
                            self.rules, self.schedule, self.space.device, st, plan, raw, early,
                            withheld)

    def _early_uplink(self, st: RunState, plan: RoundPlan) -> EarlyUplink | None:
        """Each client's own uplink work, done as its result arrives, where the
        backend hands results over one by one (``process``): on 50 clients a round
        it was a serial tail after the workers returned, the cores idle but one."""
        caps = backend_caps(self.backend)
        if not caps.streams or not EarlyUplink.applies(
                self.algorithm, client_postprocessors(self.around.attack, self.privacy),
                self.space.device, plan):
            return None
        space = self.space
        buffer = self.workspace
        rows = buffer.rows(len(plan.jobs), space.layout.size, space.dtype, space.device)
        if caps.writes_rows and caps.shared_rows:
            # the workers write each update into its server row: no copy of it here
            buffer.share()
        return EarlyUplink(self.algorithm, self.schedule, st, plan, rows)

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
        rx = receive(algo, space, self.rules, self.around.downlink_size, st, plan, outcome,
                     self.workspace)
        t1 = time.perf_counter()
        # the server's own update on its root data, where the rule asks for one
        ref = reference_update(self.around.root, algo.local, st, plan)
        out = server_round(algo, server_rule(self.privacy, algo.aggregator), space,
                           clients.num_clients, st, plan, results, ups, rx, ref)
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
        metrics = round_metrics(algo.feedback, self.around.hooks,
                                clients.fields.has(FEEDBACK), plan, outcome, rx, out, totals)
        load_buffers(space.module, buffers)  # evaluations see the new global buffers
        rounds = self.schedule.rounds
        evaluation = st.evaluation
        due = self.evaluator.settings.due(r + 1, rounds)  # eval.every and eval.window
        if due:
            scores, evaluation = self.evaluator.round(
                out.w, w_avg if w_avg is not None else out.w, r, st.clients, evaluation,
                personal=algo.method.personal)
            metrics.update(scores)
        metrics["train_s"] = t_train
        per_sample = clients.fed.dataset.tokens_per_sample
        if per_sample:  # token data: what local training put through (train_tokens_per_s)
            batch = algo.local.batch_size
            metrics["train_tokens"] = per_sample * sum(
                samples_for_steps(res.steps, len(clients.fed.train[res.client]), batch)
                for res in results)
        metrics["agg_s"] = t_agg
        metrics["wall_s"] = time.perf_counter() - t0
        privacy_state = account_privacy(self.privacy, plan, outcome, out.privacy_state,
                                        metrics, evaluated=due)
        selection_state = self.schedule.observe(plan.selection_state, selection_feedback(
            plan, outcome, rx, algo.local.batch_size, times=times, late=late,
            deadline_s=deadline_s))
        return RunState(r + 1, out.w, out.opt_state, out.agg_state, method_state,
                        out.feedback_state, w_avg, totals, privacy_state=privacy_state,
                        buffers=buffers, selection_state=selection_state, clients=st.clients,
                        evaluation=evaluation), metrics

    def evaluate(self, w: torch.Tensor, st: RunState | None = None) -> dict[str, float]:
        """Global test accuracy/loss and per-client accuracy statistics of ``w``
        (:meth:`~fedloom.engine.stages.evaluation.Evaluator.global_`); ``st``: the
        state whose client rows it reads (``model.buffers=local``: each client's own
        buffers; ``None``: the global ones for every client)."""
        return self.evaluator.global_(w, st.clients if st is not None else None)
