"""Event-driven rounds on the simulated clock: FedAsync and FedBuff.

``system.mode: async`` (FedAsync; Xie, Koyejo & Gupta, "Asynchronous Federated
Optimization", 2019) and ``buffered`` (FedBuff; Nguyen et al., "Federated
Learning with Buffered Asynchronous Aggregation", AISTATS 2022) keep
``system.concurrency`` clients in flight. A client dispatched at server step ``v``
starts from ``w_v`` and arrives after :func:`fedloom.system.client_time`; arrivals are
taken in time order, each slot refilled at once. A server step takes ``K`` arrivals
(1 for async, ``system.buffer`` for buffered) through the same objects as a synchronous
cohort, each row weighted by ``s(τ)`` of its staleness ``τ = t − v``: ``constant`` 1,
``polynomial`` ``(1+τ)^-a``, ``hinge`` 1 for ``τ ≤ b`` else ``1/(a(τ−b)+1)``.

- **buffered** (FedBuff): the row is ``s(τ)·Δ_k``, ``Δ_k = w_v − w_k`` the
  client's update from the model it started from; the aggregate of the ``K``
  rows is stepped by the server optimizer (FedBuff's ``η_g``: ``server.lr``).
- **async** (FedAsync): ``w ← (1 − α_t) w + α_t w_k`` with ``α_t = α·s(τ)``,
  i.e. the row ``s(τ)·(w_t − w_v + Δ_k)`` stepped with ``server.lr = α``
  (FedAsync's mixing weight) under ``server.optimizer: sgd``.

The job is built and trained when the client arrives, from the model and server state
of its dispatch (``RunState.events``), so a run resumed at any step is bit-identical.
Departures: the arrival time uses the compressor's payload size on a fixed vector;
a client's local step size is the schedule's at its dispatch step.
The arrivals, the clients' state, resume and what it does not combine with:
docs/howto/async.md (The event driver in detail).
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from fedloom.client.sgd import LocalSGD
from fedloom.config import SystemConfig
from fedloom.engine.runstate import RoundOutcome, RoundPlan, RunState
from fedloom.job import ClientJob, ClientResult
from fedloom.rng import derive_seed
from fedloom.system import System, client_time, samples_for_steps

__all__ = ["ClientClock", "EventDriver", "RoundHalves", "staleness_weight"]


class RoundHalves(Protocol):
    """The stages a server step calls, in order (the experiment's): a one-client plan
    at a dispatch version, training the arrivals, the uplink and the server half."""

    def plan_round(self, st: RunState, cohort: torch.Tensor | None = None) -> RoundPlan: ...

    def train_cohort(self, jobs: Sequence[ClientJob]) -> Sequence[ClientResult | None]: ...

    def uplink_round(self, st: RunState, plan: RoundPlan,
                     raw: Sequence[ClientResult | None]) -> tuple[RoundPlan, RoundOutcome]: ...

    def finish_round(self, st: RunState, plan: RoundPlan, outcome: RoundOutcome, *,
                     t0: float, t_train: float) -> tuple[RunState, dict[str, Any]]: ...

    def lr(self, r: int) -> float: ...


@dataclass(frozen=True)
class ClientClock:
    """What a dispatch reads to time a client: the system model, the broadcast's and
    the expected upload's bytes, each client's training positions and the local
    trainer's step budget and batch size."""

    system: System
    downlink_size: int
    uplink_size: int
    train: Sequence[np.ndarray]
    local: LocalSGD

    def duration(self, k: int) -> float:
        """Client ``k``'s simulated time from dispatch to arrival."""
        nk = len(self.train[k])
        steps = self.local.num_steps(nk)
        return client_time(self.system.device(k), self.downlink_size,
                           samples_for_steps(steps, nk, self.local.batch_size),
                           self.uplink_size)


def staleness_weight(cfg: SystemConfig, tau: int) -> float:
    """``s(τ)`` of ``system.staleness`` (FedAsync's constant, polynomial, hinge)."""
    a, b = cfg.staleness_a, cfg.staleness_b
    if cfg.staleness == "constant":
        return 1.0
    if cfg.staleness == "polynomial":
        return float((1.0 + tau) ** -a)
    return 1.0 if tau <= b else 1.0 / (a * (tau - b) + 1.0)


class EventDriver:
    """One server step of the event-driven modes (see the module docstring)."""

    def __init__(self, cfg: SystemConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self.k = 1 if cfg.mode == "async" else cfg.buffer

    # ------------------------------------------------------------- dispatch
    def _dispatch(self, times: ClientClock, ev: dict[str, Any], st: RunState, t: float,
                  exclude: set[int]) -> None:
        """Fill the free slots at time ``t`` from the model of ``st``."""
        flight: list[list[float]] = ev["flight"]
        busy = {int(f[2]) for f in flight} | exclude
        free = self.cfg.concurrency - len(flight)
        if free <= 0:
            return
        v = st.next_round
        versions: dict[str, Any] = ev["versions"]
        if str(v) not in versions:  # the model and server state a client starts from
            versions[str(v)] = {"w": st.w.clone(), "feedback": st.feedback_state,
                                "method": st.method_state, "buffers": st.buffers}
        candidates = np.array([k for k in range(len(times.train)) if k not in busy])
        n = int(ev["dispatched"])
        gen = np.random.default_rng(derive_seed(self.seed, n, -1, "dispatch"))
        chosen = gen.choice(candidates, free, replace=False)
        for i, k in enumerate(chosen.tolist()):
            dt = times.duration(k)
            # [arrival time, dispatch order, client, version, dispatch time]
            flight.append([t + dt, float(n + i), float(k), float(v), t])
        ev["dispatched"] = n + len(chosen)

    # ------------------------------------------------------------ one step
    def step(self, halves: RoundHalves, times: ClientClock, st: RunState
             ) -> tuple[RunState, dict[str, Any]]:
        """Take the next ``K`` arrivals (timed by ``times``), train and aggregate them
        through ``halves``, step the model."""
        t0 = time.perf_counter()
        ev = st.events or {"flight": [], "versions": {}, "dispatched": 0}
        ev = {"flight": [list(f) for f in ev["flight"]], "versions": dict(ev["versions"]),
              "dispatched": int(ev["dispatched"])}
        clock = st.sim_time_s
        if not ev["flight"]:  # the first step: every slot from w_0 at time 0
            self._dispatch(times, ev, st, clock, set())
        arrived: list[list[float]] = []
        while len(arrived) < self.k:
            heapq.heapify(ev["flight"])
            nxt = heapq.heappop(ev["flight"])
            arrived.append(nxt)
            clock = max(clock, nxt[0])
            if len(arrived) < self.k:  # its slot refilled now, from the current model
                self._dispatch(times, ev, st, nxt[0], {int(a[2]) for a in arrived})
        plan, raw = self._train(halves, st, ev, arrived)
        t_train = time.perf_counter() - t0
        plan, outcome = halves.uplink_round(st, plan, raw)
        new, metrics = halves.finish_round(st, plan, outcome, t0=t0, t_train=t_train)
        taus = [st.next_round - int(a[3]) for a in arrived]
        metrics["staleness_mean"] = float(np.mean(taus))
        metrics["staleness_max"] = int(max(taus))
        metrics["sim_round_s"] = clock - st.sim_time_s
        metrics["sim_time_s"] = clock
        new = dataclasses.replace(new, sim_time_s=clock)
        # the last arrival's slot, from the model after the step
        self._dispatch(times, ev, new, clock, set())
        live = {str(int(f[3])) for f in ev["flight"]}
        ev["versions"] = {v: s for v, s in ev["versions"].items() if v in live}
        new.events = ev
        return new, metrics

    def _train(self, halves: RoundHalves, st: RunState, ev: dict[str, Any],
               arrived: list[list[float]]) -> tuple[RoundPlan, list[Any]]:
        """The arrivals' jobs, each from its dispatch version, trained as one cohort;
        their plan with the staleness rows of the server half."""
        plans: list[RoundPlan] = []
        for a in arrived:
            k, v = int(a[2]), int(a[3])
            ver = ev["versions"][str(v)]
            # the state of step v: its model, server states and lr (the job's seeds
            # derive from (v, k): a client is dispatched at most once per step)
            at_v = dataclasses.replace(st, next_round=v, w=ver["w"],
                                       feedback_state=ver["feedback"],
                                       method_state=ver["method"], buffers=ver["buffers"])
            plans.append(halves.plan_round(at_v, cohort=torch.tensor([k], dtype=torch.long)))
        taus = [st.next_round - int(a[3]) for a in arrived]
        scales = [staleness_weight(self.cfg, tau) for tau in taus]
        shifts = None
        if self.cfg.mode == "async":  # FedAsync mixes with w_k = w_v − Δ_k: add w_t − w_v
            shifts = [(st.w - ev["versions"][str(int(a[3]))]["w"]) if tau else None
                      for a, tau in zip(arrived, taus, strict=True)]
        plan = _merge(plans, st.next_round, halves.lr(st.next_round), scales, shifts)
        raw = halves.train_cohort(plan.jobs)
        return plan, list(raw)


def _merge(plans: list[RoundPlan], r: int, lr: float, row_scales: list[float],
           row_shifts: list[torch.Tensor | None] | None) -> RoundPlan:
    """One plan of the arrivals' one-client plans, for step ``r`` (``lr``: the
    schedule's at ``r``, what the uplink and the rules read; each job keeps its own),
    with the staleness rows of the server half (``row_scales``, ``row_shifts``)."""
    first = plans[0]
    old_rows = {f: torch.cat([p.old_rows[f] for p in plans]) for f in first.old_rows}
    measured = [[m for p in plans for m in p.measured[h]] for h in range(len(first.measured))]
    return RoundPlan(r, torch.cat([p.cohort for p in plans]), lr,
                     [j for p in plans for j in p.jobs], [a for p in plans for a in p.alphas],
                     [f for p in plans for f in p.fb_rows], old_rows, first.comp,
                     first.adjust, measured, row_shifts=row_shifts, row_scales=row_scales)
