"""The one local-training step loop over ``W[m, d]``, and what the trainers around it share.

:func:`step_loop` is every trainer's loop: at step ``t`` a gradient function
gives ``G`` (``[d]`` for the sequential trainer's one client, ``[m, d]`` for
vmap's and lock-step's; ``None``: no direction this step), the chain of
:mod:`fedloom.client.transforms` turns it into ``D`` and

    W ← W − η·D          (every client steps, one η: ``sub_``, as torch.optim.SGD)
    W ← W − (η ⊙ live)·D (otherwise: a finished client moves by η = 0, bit for bit)

The trainers differ only by their gradient function: autograd on the
sequential trainer's flat module (:class:`fedloom.client.sgd.LocalSGD`),
``vmap`` of ``grad_and_value`` (:mod:`fedloom.engine.trainers.vmap`), and
lock-step's batched layers (:mod:`fedloom.engine.trainers.lockstep`). The batched
trainers also share how a cohort is stacked (:func:`stack_models`,
:func:`start_buffers`, :func:`start_losses`), its batch table
(:func:`batch_table`) and its results (:func:`pack_results`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from fedloom.capabilities import LoopCaps
from fedloom.client.transforms import StepContext, split_terms
from fedloom.job import ClientJob, ClientResult
from fedloom.transforms import Chain

if TYPE_CHECKING:
    from fedloom.client.sgd import LocalSGD

__all__ = ["BatchTable", "batch_table", "jobs_reason", "pack_results", "stack_models",
           "start_buffers", "start_losses", "step_loop"]

# Step t's gradient (None: the step moves nothing through the chain).
Grads = Callable[[int], "torch.Tensor | None"]


def step_loop(W: torch.Tensor, W0: torch.Tensor, direction: Chain[StepContext], grads: Grads,
              steps: Sequence[int], lrs: Sequence[float], *, exact: bool = True) -> None:
    """Run every client's local steps on ``W`` in place (the module docstring).

    ``steps``: each client's number of steps; ``lrs``: each one's η; ``exact``:
    the one-η step is ``sub_`` (a fused multiply-add, the sequential trainer's
    bits); ``False`` (vmap) always takes the masked ``addcmul_``.
    """
    state = direction.init(W)
    lr_col: torch.Tensor | None = None
    for t in range(max(steps, default=0)):
        G = grads(t)
        if G is None:
            continue
        live = [t < s for s in steps]
        with torch.no_grad():
            # (a finished client's momentum buffer is never used again)
            D, state = direction.update(G, state, StepContext(t, W, W0, live=live))
            if exact and all(live) and len(set(lrs)) == 1:
                W.sub_(D, alpha=lrs[0])
                continue
            if lr_col is None:
                lr_col = torch.tensor(list(lrs), dtype=W.dtype, device=W.device)[:, None]
            keep = torch.tensor([1.0 if a else 0.0 for a in live], dtype=W.dtype,
                                device=W.device)[:, None]
            # In place: a fresh [m, d] tensor every step costs page faults.
            W.addcmul_(lr_col * keep, D, value=-1.0)


def jobs_reason(caps: LoopCaps, jobs: Sequence[ClientJob]) -> str | None:
    """Why a batched trainer of capabilities ``caps`` does not run these jobs
    (None: it does)."""
    mus = set()
    for j in jobs:
        if j.steps.probe and not caps.probe:
            return "a job asks for the smoothness probe"
        terms = split_terms(j.transforms)
        if terms.objective is not None and not caps.objective:
            return "a job carries a local method's objective"
        mus.add(terms.prox)
    if len(mus) > 1 and not caps.mixed_prox:
        return "the jobs of one batch differ in their prox weight"
    return None


def stack_models(jobs: Sequence[ClientJob]) -> tuple[torch.Tensor, torch.Tensor]:
    """``W0`` (the models received, the prox anchors) and ``W`` (where each
    client's steps start), one row a client."""
    return torch.stack([j.w for j in jobs]), torch.stack([j.start for j in jobs])


def start_losses(trainer: LocalSGD, jobs: Sequence[ClientJob]) -> list[float | None]:
    """``F_k(w)`` for the jobs that ask for it (an evaluation, with their buffers)."""
    return [trainer.full_loss(j.w, j.x, j.y, buffers=j.buffers) if j.steps.start_loss
            else None for j in jobs]


def start_buffers(trainer: LocalSGD, jobs: Sequence[ClientJob]) -> list[dict[str, torch.Tensor]]:
    """Each client's own copy of the buffers it starts from — the job's, else the
    module's initial ones, as the sequential trainer loads them — which its
    train-mode forwards update in place and its result carries."""
    fm = trainer._flat_module()
    if not fm.buffers:
        return [{} for _ in jobs]
    out = []
    for j in jobs:
        start = j.buffers if j.buffers else fm.init_buffers
        out.append({n: torch.empty_like(v).copy_(start.get(n, fm.init_buffers[n]))
                    for n, v in fm.buffers.items()})
    return out


@dataclass(frozen=True)
class BatchTable:
    """A cohort's batches: per client its index batches and step count; the source
    rows ``src_x``/``src_y`` and ``table`` ``[m, T, B]``, every step's batch of
    every client as positions into them (unused cells: −1); ``first`` ``[m]``,
    each client's first sample (what a padded cell may gather)."""

    batches: list[list[torch.Tensor]]
    steps: list[int]
    src_x: torch.Tensor
    src_y: torch.Tensor
    table: torch.Tensor
    first: torch.Tensor


def batch_table(trainer: LocalSGD, jobs: Sequence[ClientJob], x: torch.Tensor | None,
                y: torch.Tensor | None, dev: torch.device) -> BatchTable:
    """Every client's batches, as the sequential trainer draws them, in one table
    on ``dev`` (one copy, not one a step). The source rows are the whole data
    ``x, y`` (positions via ``job.data.index``) or the jobs' samples stacked."""
    batches = [trainer.job_batches(j) for j in jobs]
    m = len(jobs)
    if x is not None and all(j.data.index is not None for j in jobs):
        # x and y are set together; all() above: every job has its index
        src_x, src_y = x, cast(torch.Tensor, y)
        owners = cast("list[torch.Tensor]", [j.data.index for j in jobs])
    else:
        src_x = torch.cat([j.x for j in jobs])
        src_y = torch.cat([j.y for j in jobs])
        offs = [0]
        for j in jobs:
            offs.append(offs[-1] + int(j.y.shape[0]))
        owners = [torch.arange(offs[k], offs[k + 1]) for k in range(m)]
    T = max(len(b) for b in batches)
    B = max(len(i) for b in batches for i in b)
    table = torch.full((m, T, B), -1, dtype=torch.long)
    for k, b in enumerate(batches):
        own = owners[k].cpu()
        for t, i in enumerate(b):
            table[k, t, : len(i)] = own[i]
    first = torch.stack([owners[k][0].cpu() for k in range(m)])
    return BatchTable(batches, [len(b) for b in batches], src_x, src_y, table.to(dev),
                      first.to(dev))


def pack_results(jobs: Sequence[ClientJob], W: torch.Tensor, losses: Sequence[float],
                 steps: Sequence[int], start_loss: Sequence[float | None],
                 buffers: Sequence[dict[str, torch.Tensor]]) -> list[ClientResult]:
    """Each client's result: the update ``w − W[k]``, its mean batch loss, steps,
    start loss and the buffers its training ended with."""
    return [ClientResult(j.client, (j.w - W[k]).contiguous(), int(j.y.shape[0]), losses[k],
                         steps[k], start_loss[k], buffers=buffers[k])
            for k, j in enumerate(jobs)]
