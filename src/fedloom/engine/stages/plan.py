"""Plan and dispatch: the round's cohort, and each client's job, built in one place.

:func:`client_job` is the one definition of a client's local work: the start
point, gradient shift, penalty and smoothness probe of the feedback policy,
the module buffers, the step budget and the batch-order seed. The engine's
plan (:func:`plan_round`, for every backend: sequential, lock-step, process,
Ray) and Flower's ClientApp (:class:`fedloom.integrations.flower.FedloomTrainer`)
both build jobs through it, so a new local-training hook of a feedback policy
is written once, here, and reaches every trainer through :class:`~fedloom.job.ClientJob`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedloom.buffers import load_buffers, unflatten_buffers
from fedloom.client.transforms import job_terms
from fedloom.device import to_device
from fedloom.engine.algorithm import Algorithm
from fedloom.engine.clientfields import BUFFERS, FEEDBACK, METHOD, ClientFields
from fedloom.engine.inputs import ClientData, HookView, ModelSpace, Schedule
from fedloom.engine.runstate import RoundPlan, RunState
from fedloom.engine.trainers.backends import take_rows
from fedloom.job import ClientJob, JobData, StepPlan
from fedloom.rng import Purpose, derive_seed

__all__ = ["client_job", "plan_round"]

_NO_DATA = torch.empty(0)


def client_job(feedback: Any, *, seed: int, client: int, round: int, w: torch.Tensor,
               lr: float, x: torch.Tensor, y: torch.Tensor, fb_state: Mapping[str, torch.Tensor],
               fb_server: Mapping[str, Any], alpha: float, epochs: int | None = None,
               state: Mapping[str, torch.Tensor] | None = None,
               buffers: Mapping[str, torch.Tensor] | None = None, start_loss: bool = False,
               data_index: torch.Tensor | None = None, shifted_here: bool = True) -> ClientJob:
    """Client ``client``'s job in round ``round``.

    Args:
        feedback: the run's feedback policy; its hooks on local training are
            ``start_point(w, fb_state, alpha)`` (SA-PEF: ``w − α e``),
            ``grad_shift(fb_state, fb_server)`` (SCAFCOM), ``penalty(w, fb_state,
            round)`` (FLARE, EC+prox) and ``probes_smoothness`` (SA-PEF's theory α).
        fb_state: the client's rows of the feedback policy, by its field names.
        fb_server: the policy's server state (``{}`` where the client has none).
        state: the client's rows of the local method (before its ``prepare``).
        buffers: the module buffers local training starts from.
        shifted_here: ``False`` where the model handed over already is the start
            point (Flower's mod shifts it before the train handler runs).
    """
    terms = job_terms(feedback.grad_shift(fb_state, fb_server),
                      feedback.penalty(w, fb_state, round))
    steps = StepPlan(feedback.start_point(w, fb_state, alpha) if shifted_here else None,
                     epochs, None, start_loss, feedback.probes_smoothness)
    return ClientJob(client, round, w, lr, JobData(x, y, data_index),
                     derive_seed(seed, round, client, Purpose.BATCH), dict(state or {}),
                     dict(buffers or {}), terms, steps)


def plan_round(algo: Algorithm, clients: ClientData, space: ModelSpace, schedule: Schedule,
               st: RunState, *, hooks: Sequence[Any] = (), view: HookView | None = None,
               ships_indices: bool = False, cohort: torch.Tensor | None = None) -> RoundPlan:
    """The round's cohort and fully specified client jobs (the client state rows
    they need are gathered from the state's store, ``st.clients``). ``hooks`` are
    the run's client-metric plug-ins and ``view`` what they and the round planner read
    (:mod:`fedloom.hooks`); ``ships_indices``: the backend gathers the samples
    where it trains (no copy of the cohort's data here); ``cohort``: these
    clients instead of the schedule's draw (the event-driven modes)."""
    r = st.next_round
    selection = st.selection_state
    if cohort is None:
        cohort, selection = schedule.select(r, selection)
    lr = schedule.lr(r)
    w = st.w
    store, fields = st.clients, clients.fields
    # The store stays in host memory; the cohort's rows go to the device
    # (pinned, asynchronous copies on CUDA).
    old_rows = to_device({f: store.gather(f, cohort) for f in fields.specs},
                         space.device, pin=True)
    fb = algo.feedback
    # The module holds the global buffers: an evaluation that names none
    # (a planner's, a metric hook's) sees the current ones.
    load_buffers(space.module, st.buffers)
    adjust = algo.planner.plan(r, w, st.feedback_state, view)
    comp = adjust.compressor if adjust.compressor is not None else algo.compressor
    jobs, alphas, fb_rows = [], [], []
    start_loss = "start_losses" in algo.requires
    measured: list[list[Any]] = [[] for _ in hooks]
    for i, k in enumerate(cohort.tolist()):
        idx = torch.from_numpy(clients.fed.train[k])
        fb_state = fields.own(FEEDBACK, old_rows, i)
        alpha = fb.alpha(lr, algo.local.num_steps(len(idx), adjust.epochs), st.feedback_state)
        for hook, got in zip(hooks, measured, strict=True):
            value = hook.measure(view, w, k, fb_state, len(idx))
            if value is not None:
                got.append(value)
        xk, yk, index = _samples(clients, k, idx, ships_indices)
        job = client_job(fb, seed=schedule.seed, client=k, round=r, w=w, lr=lr, x=xk, y=yk,
                         fb_state=fb_state, fb_server=st.feedback_state, alpha=alpha,
                         epochs=adjust.epochs, state=fields.own(METHOD, old_rows, i),
                         buffers=_start_buffers(fields, space, st, old_rows, i),
                         start_loss=start_loss, data_index=index)
        jobs.append(algo.method.prepare(job, st.method_state))
        alphas.append(alpha)
        fb_rows.append(fb_state)
    return RoundPlan(r, cohort, lr, jobs, alphas, fb_rows, old_rows, comp, adjust, measured,
                     selection_state=selection)


def _samples(clients: ClientData, k: int, idx: torch.Tensor, ships_indices: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Client ``k``'s training samples for its job, and their positions in the
    clients' ``x`` (``None``: the job carries samples of its own)."""
    pop = clients.fed.population
    if pop is not None:
        # a population's user is generated for the round, from (seed, user), and
        # shipped with its job whatever the backend (fedloom.data.population)
        xk, yk = pop.client(k)
        return (torch.from_numpy(xk).to(device=clients.x.device, dtype=clients.x.dtype),
                torch.from_numpy(yk).to(clients.y.device), None)
    if ships_indices:
        return _NO_DATA, _NO_DATA, idx
    # a client's block of rows is handed over as a view, not copied (take_rows)
    return take_rows(clients.x, idx), take_rows(clients.y, idx), idx


def _start_buffers(fields: ClientFields, space: ModelSpace, st: RunState,
                   old_rows: Mapping[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """The buffers client ``i`` of the cohort starts from: its own under
    ``model.buffers=local`` once it has them, else the global ones."""
    if fields.has(BUFFERS):
        own = fields.own(BUFFERS, old_rows, i)
        if bool(own["buffers_set"][0] > 0):
            return unflatten_buffers(own["buffers"], space.buffer_template)
    return st.buffers
