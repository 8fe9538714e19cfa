"""The ``lockstep`` backend: :class:`LockstepBackend`, its chunks and its fallbacks.

A cohort is trained in chunks of clients, each chunk's steps by
:func:`~fedloom.engine.trainers.lockstep.step._step`; a model, a trainer or jobs that are
not lock-step's (:func:`trainer_reason`, :func:`job_reason`, :func:`shape_reason`,
:func:`~fedloom.engine.trainers.lockstep.plan.lockstep_plan`'s reason) train on the
sequential path with one line in the log naming why.

The cohort runs in chunks of ``chunk`` clients (``backend.options.chunk``; default: as
many as fit in 4 MB of stacked parameters of the run's dtype, but at least 8
while they fit in 64 MB — 8 clients of the reference MLP in float32): a whole
cohort's stacked weights fall out of the cache at every step. The GEMMs and
convolutions are sequential's; what lock-step saves is the per-client Python,
module and autograd work of every step. Measured speed (chunk sizes, the MLP and
CNN against ``sequential`` and ``vmap``, loaded and idle machines, threads):
docs/explanation/backends.md (Lock-step).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Annotated

import torch
from torch.nn import functional as F

from fedloom.capabilities import BackendCaps, LoopCaps
from fedloom.client.loop import (
    BatchTable,
    batch_table,
    jobs_reason,
    pack_results,
    stack_models,
    start_buffers,
    start_losses,
    step_loop,
)
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.client.transforms import jobs_chain
from fedloom.engine.trainers.backends import InProcess, method_reason
from fedloom.engine.trainers.lockstep.plan import (
    _AvgPool,
    _BatchNorm,
    _Conv,
    _Flatten,
    _GroupNorm,
    _Linear,
    _MaxPool,
    _Op,
    lockstep_plan,
)
from fedloom.engine.trainers.lockstep.step import _forward, _step
from fedloom.registry import Range, register
from fedloom.rng import Purpose, derive_seed

log = logging.getLogger("fedloom")

_LOOP = LoopCaps(methods=True)  # no probe, no objective, one prox weight a chunk


def shape_reason(plan: list[_Op], sample: tuple[int, ...]) -> str | None:
    """Why the chain cannot run on samples of shape ``sample`` (None: it can): every
    Linear must see one feature vector per sample (``F.linear`` on more dimensions is
    another kernel), every Conv2d and pool an image ``[C, H, W]`` per sample (fewer
    dimensions would be read as one unbatched image), and the logits must be one
    vector per sample. The shapes are carried through the chain on the meta device."""
    shape = tuple(sample)
    for op in plan:
        if isinstance(op, _Flatten):
            end = op.end if op.end >= 0 else len(shape) + 1 + op.end  # nn.Flatten counts the batch
            end = max(end, 1)
            shape = (math.prod(shape[:end]), *shape[end:])
        elif isinstance(op, _Linear):
            if len(shape) != 1:
                return f"a Linear layer on {len(shape)}-dimensional samples"
            if shape[0] != op.shape[1]:
                return f"a Linear layer of {op.shape[1]} inputs on {shape[0]} features"
            shape = (op.shape[0],)
        elif isinstance(op, _GroupNorm):
            if len(shape) < 1 or shape[0] != op.channels:
                return f"a GroupNorm of {op.channels} channels on samples of shape {list(shape)}"
        elif isinstance(op, _BatchNorm):
            if len(shape) not in op.dims or shape[0] != op.features:
                return (f"a BatchNorm of {op.features} features on samples of shape "
                        f"{list(shape)}")
        elif isinstance(op, _Conv | _MaxPool | _AvgPool):
            if len(shape) != 3:
                return f"a {op.kind} layer on {len(shape)}-dimensional samples"
            weight = torch.empty(op.shape, device="meta") if isinstance(op, _Conv) else None
            try:
                shape = tuple(_forward(op, torch.empty((1, *shape), device="meta"), weight,
                                       None)[0].shape[1:])
            except RuntimeError as e:  # the layer cannot take these images
                return f"a {op.kind} layer on samples of shape {list(shape)} ({e})"
    return None if len(shape) == 1 else f"logits of {len(shape)} dimensions per sample"


def trainer_reason(trainer: LocalSGD, method: LocalMethod,
                   plan: list[_Op] | None = None) -> str | None:
    """Why local training with these settings is not lock-step's (None: it is). A
    random train-mode forward is lock-step's where it is the plan's dropout (the only
    random layer a plan admits)."""
    why = method_reason(_LOOP, method)
    if why is not None:
        return why
    if trainer.amp != "none":
        return f"client.amp {trainer.amp}"
    if trainer.augment is not None:
        return "data augmentation"
    if trainer.random_forward and not (
            plan is not None and any(o.kind == "dropout" for o in plan)):
        return "the train-mode forward draws random numbers"
    return None


def job_reason(jobs: Sequence[ClientJob]) -> str | None:
    """Why these jobs are not lock-step's (None: they are)."""
    return jobs_reason(_LOOP, jobs)


class LockstepBackend(InProcess):
    """See the module docstring."""

    name = "lockstep"
    # Trains on the samples each job carries; runs batched local methods (their terms
    # in the stacked chain, then their complete()).
    capabilities = BackendCaps(loop=_LOOP)

    def __init__(self, trainer: LocalSGD, method: LocalMethod, chunk: int | None = None,
                 x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> None:
        self.trainer, self.method, self.x, self.y = trainer, method, x, y
        self.plan, reason = lockstep_plan(trainer.module, trainer.layout)
        self.reason = trainer_reason(trainer, method, self.plan) or reason
        self.enabled = self.reason is None
        p = next(trainer.module.parameters(), None)
        size = p.element_size() if p is not None else 4
        # Cache-sized chunks: a step streams each client's weights, gradient and
        # momentum several times; 4 MB of stacked weights keeps them in cache. At
        # least 8 clients (up to 64 MB): a CNN's few weights are not what its step
        # streams, and chunks of 1-2 clients save little of the per-client work.
        per = size * max(1, trainer.layout.size)
        self.chunk = chunk or max(1, min(max((4 << 20) // per, 8), (64 << 20) // per))
        self._noted: set[str] = set()

    def _note(self, why: str) -> None:
        if why not in self._noted:  # one line per reason, not one per round
            self._noted.add(why)
            log.info("backend lockstep: %s; training on the sequential path", why)

    def _sequential(self, jobs: Sequence[ClientJob]) -> list[ClientResult | None]:
        return [self.method.run(self.trainer, j) for j in jobs]

    def train_cohort(self, jobs: Sequence[ClientJob]) -> list[ClientResult | None]:
        if self.reason is not None:
            self._note(self.reason)
            return self._sequential(jobs)
        out: list[ClientResult | None] = []
        for s in range(0, len(jobs), self.chunk):
            part = list(jobs[s : s + self.chunk])
            assert self.plan is not None
            why = job_reason(part) or shape_reason(self.plan, tuple(part[0].x.shape[1:]))
            if why is not None:
                self._note(why)
                out += self._sequential(part)
            else:
                done = self._train(part)
                out += [self.method.complete(self.trainer, j, r)
                        for j, r in zip(part, done, strict=True)]
        return out

    # ------------------------------------------------------------------ training
    def _train(self, jobs: list[ClientJob]) -> list[ClientResult]:
        tr = self.trainer
        assert self.plan is not None
        W0, W = stack_models(jobs)
        start_loss = start_losses(tr, jobs)
        table = batch_table(tr, jobs, self.x, self.y, W.device)
        # The direction's terms, as the sequential trainer's (fedloom.client.transforms).
        direction = jobs_chain(jobs, W, weight_decay=tr.weight_decay, prox_mu=tr.prox_mu,
                               momentum=tr.momentum, extra=tr.transforms)
        grads = _LockstepGradients(self.plan, jobs, table, W, start_buffers(tr, jobs))
        step_loop(W, W0, direction, grads, table.steps, [float(j.lr) for j in jobs])
        means = []
        for k in range(len(jobs)):
            loss_sum = 0.0
            for v in grads.losses[k]:  # Python floats in step order, as LocalSGD sums them
                loss_sum += float(v)
            means.append(loss_sum / max(1, table.steps[k]))
        return pack_results(jobs, W, means, table.steps, start_loss, grads.bufs)


class _LockstepGradients:
    """Lock-step's gradient function of :func:`~fedloom.client.loop.step_loop`:
    the clients with a batch at step ``t``, grouped by its size (one group: all),
    each group's gradients by the plan's batched layers into ``G``; each client's
    own loss kept a step (``losses``) and its buffers updated in place (``bufs``)."""

    def __init__(self, plan: list[_Op], jobs: list[ClientJob], table: BatchTable,
                 W: torch.Tensor, bufs: list[dict[str, torch.Tensor]]) -> None:
        self.plan, self.jobs, self.table, self.W, self.bufs = plan, jobs, table, W, bufs
        self.G = torch.zeros_like(W)
        self.losses: list[list[torch.Tensor]] = [[] for _ in jobs]
        self.every = torch.arange(len(jobs), device=W.device)
        self.dropout = any(o.kind == "dropout" for o in plan)

    def __call__(self, t: int) -> torch.Tensor:
        W, G, m, table = self.W, self.G, len(self.jobs), self.table
        groups: dict[int, list[int]] = {}
        for k in range(m):
            if t < table.steps[k]:
                groups.setdefault(len(table.batches[k][t]), []).append(k)
        active = sum(len(g) for g in groups.values())
        # _step writes every parameter's slice of its rows once a step (no
        # accumulation), so G needs zeroing only where some rows are not written
        # this step: a finished client's, or clients split by batch size
        if len(groups) != 1 or active != m:
            G.zero_()
        for n, ks in groups.items():
            whole = len(ks) == m
            rows = self.every if whole else torch.tensor(ks, device=W.device)
            idx = table.table[rows, t, :n]
            Gr = G if whole else torch.zeros(len(ks), W.shape[1], dtype=W.dtype,
                                             device=W.device)
            # the seed of step t's dropout masks, as the sequential trainer reseeds
            seeds = ([derive_seed(self.jobs[k].gen_seed, t, -1, Purpose.DROPOUT) for k in ks]
                     if self.dropout else None)
            lsm, Y = _step(self.plan, W if whole else W[rows], table.src_x[idx],
                           table.src_y[idx], Gr, seeds, [self.bufs[k] for k in ks])
            if not whole:
                G[rows] = Gr
            for r, k in enumerate(ks):
                # the client's own loss: nll_loss of its rows, the sequential bits
                self.losses[k].append(F.nll_loss(lsm[r], Y[r]).detach())
        return G


@register("backend", "lockstep")
def _lockstep(trainer: LocalSGD, method: LocalMethod, x: torch.Tensor | None = None,
              y: torch.Tensor | None = None, *, threads: int = 1, keep_heap: bool = True,
              chunk: Annotated[int, Range(ge=0)] = 0) -> LockstepBackend:
    """``chunk``: clients per chunk (0: cache-sized)."""
    return LockstepBackend(trainer, method, chunk=chunk or None, x=x, y=y)
