"""The ``vmap`` backend: a cohort trains in lock-step with ``torch.func``.

The clients' flat parameter vectors are stacked along a client dimension
``W ∈ R^{m×d}``; one step computes every client's gradient at once with
``vmap(grad_and_value(loss))`` over ``functional_call``, then applies the same
SGD rule as :class:`~fedloom.client.sgd.LocalSGD` (momentum, weight decay,
FedProx, SCAFFOLD's shift, FLARE's penalty) as one batched update.

Each client uses exactly the sequential backend's batches, padded to the largest
and masked (a finished client is masked out, not dropped). Measured against
``sequential``: client updates agree to 6e-17 in float64 and final models to
1e-12; float32 models to about 2e-7 relative (summation order), so compressed
runs that tie at Top-k agree in distribution, not bit for bit. Other local
methods, smoothness probes, models ``vmap`` cannot trace and models whose
train-mode forward is random (dropout) run on the sequential path (asking for
``vmap`` by name with dropout is refused). Chunks, padding, BatchNorm in train
mode and their measurements: docs/explanation/backends.md (vmap).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn import functional as F

from fedloom.buffers import has_batch_statistics
from fedloom.capabilities import BackendCaps, LoopCaps, model_vmap
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
from fedloom.params import Layout
from fedloom.registry import Range, register

__all__ = ["VmapBackend", "vmap_supported"]

log = logging.getLogger("fedloom")

_LOOP = LoopCaps()  # plain local SGD, no probe, no objective, one prox weight


def vmap_supported(module: nn.Module) -> bool:
    """Models with recurrent layers, and models that say so (``fedloom_vmap =
    False``, :func:`~fedloom.capabilities.model_vmap`: a causal LM with gradient
    checkpointing, whose layers call ``requires_grad_`` inside the forward, which
    torch.func refuses), are left to the sequential backend."""
    return (model_vmap(module)
            and not any(isinstance(m, nn.RNNBase) for m in module.modules()))


class VmapBackend(InProcess):
    name = "vmap"
    # Trains on the samples each job carries. Plain local SGD only: vmap's float32
    # sums differ from the sequential path's (module docstring), and a local method's
    # results on vmap are the sequential path's, which the method's runs reproduce.
    capabilities = BackendCaps(loop=_LOOP)

    def __init__(self, trainer: LocalSGD, method: LocalMethod, chunk: int | None = None,
                 x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> None:
        self.trainer = trainer
        self.method = method
        # The whole training data, when given: batches are then gathered from it in
        # one indexing op per step (jobs carry ``data_index``).
        self.x, self.y = x, y
        d = trainer.layout.size
        self.chunk = chunk or max(1, (8 << 20) // (4 * d))
        self.reason = (method_reason(_LOOP, method)
                       or (None if vmap_supported(trainer.module)
                           else "the model (recurrent layers, or fedloom_vmap = False)")
                       # Mixed precision (client.amp) trains on the sequential path.
                       or (f"client.amp {trainer.amp}" if trainer.amp != "none" else None)
                       # a random train-mode forward (dropout) cannot draw each
                       # client's masks from its own stream under vmap
                       or ("the train-mode forward draws random numbers"
                           if trainer.random_forward else None))
        self.enabled = self.reason is None
        self._noted: set[str] = set()

    def _sequential(self, jobs: Sequence[ClientJob], why: str) -> list[ClientResult | None]:
        if why not in self._noted:  # one line per reason, not one per round
            self._noted.add(why)
            log.info("backend vmap: %s; training on the sequential path", why)
        return [self.method.run(self.trainer, j) for j in jobs]

    def train_cohort(self, jobs: Sequence[ClientJob]) -> list[ClientResult | None]:
        if self.reason is not None:
            return self._sequential(jobs, self.reason)
        out: list[ClientResult | None] = []
        for s in range(0, len(jobs), self.chunk):
            part = list(jobs[s : s + self.chunk])
            why = jobs_reason(_LOOP, part)
            out += self._sequential(part, why) if why is not None else self._train(part)
        return out

    def _train(self, jobs: list[ClientJob]) -> list[ClientResult]:
        tr = self.trainer
        # The trainer's train-mode copy: functional_call swaps in each client's
        # parameters and buffers (_VmapGradients).
        fm = tr._flat_module()
        m = len(jobs)
        w_global, W = stack_models(jobs)
        start_loss = start_losses(tr, jobs)
        table = batch_table(tr, jobs, self.x, self.y, W.device)
        # The direction's terms, as the sequential trainer's (fedloom.client.transforms).
        direction = jobs_chain(jobs, W, weight_decay=tr.weight_decay, prox_mu=tr.prox_mu,
                               momentum=tr.momentum, extra=tr.transforms)
        # Each client's buffers (BatchNorm statistics) stacked [m, ...]: a train-mode
        # forward under vmap updates its own row in place.
        own = start_buffers(tr, jobs)
        bufs = {n: torch.stack([b[n] for b in own]) for n in fm.buffers}
        grads = _VmapGradients(tr, jobs, table, W, bufs)
        step_loop(W, w_global, direction, grads, table.steps, [j.lr for j in jobs],
                  exact=False)
        steps = table.steps
        return pack_results(jobs, W, [float(grads.loss_sum[k]) / max(1, steps[k])
                                      for k in range(m)], steps, start_loss,
                            [{b: v[k].clone() for b, v in bufs.items()} for k in range(m)])


class _VmapGradients:
    """vmap's gradient function of :func:`~fedloom.client.loop.step_loop`: step
    ``t``'s stacked batches (a padded cell gathers the client's first sample and
    is masked out; a finished client is masked out, not dropped), every client's
    gradient at once; each client's losses summed in ``loss_sum``."""

    def __init__(self, tr: LocalSGD, jobs: list[ClientJob], table: BatchTable,
                 W: torch.Tensor, bufs: dict[str, torch.Tensor]) -> None:
        self.tr, self.jobs, self.table, self.W, self.bufs = tr, jobs, table, W, bufs
        fm = tr._flat_module()
        self.one_fn = grad_and_value(_masked_loss(fm.module, tr.layout))
        self.step_fn, self.batch_stats = vmap(self.one_fn), has_batch_statistics(fm.module)
        dev, m, steps = W.device, len(jobs), table.steps
        T = max(steps)
        self.mask = table.table >= 0
        self.gidx = torch.where(self.mask, table.table, table.first[:, None, None])
        self.active = torch.tensor([[1.0 if t < steps[k] else 0.0 for t in range(T)]
                                    for k in range(m)], device=dev)
        self.loss_sum = torch.zeros(m, dtype=torch.float64, device=dev)

    def __call__(self, t: int) -> torch.Tensor:
        dtype, table = self.W.dtype, self.table
        It = self.gidx[:, t]
        X, Y = table.src_x[It], table.src_y[It]
        M = self.mask[:, t].to(dtype)
        active = self.active[:, t].to(dtype)
        if self.tr.augment is not None:  # each client's real rows, as LocalSGD.batch draws them
            X = X.clone()
            for k in range(len(self.jobs)):
                if t < table.steps[k]:
                    n = len(table.batches[k][t])
                    X[k, :n] = self.tr.batch(X[k, :n], torch.arange(n, device=X.device),
                                             self.jobs[k].gen_seed, t)
        G, L = _grads(self.one_fn, self.step_fn, self.W, self.bufs, X, Y, M, active,
                      self.batch_stats)
        self.loss_sum += L.detach().to(torch.float64) * active.to(torch.float64)
        return G


def _masked_loss(module: nn.Module, layout: Layout) -> Callable[..., torch.Tensor]:
    """One client's masked mean cross-entropy of flat parameters ``w`` and buffers ``b``
    (next tokens: over the batch's unpadded tokens, the sequential step's loss)."""
    names = [t.name for t in layout.tensors]
    shapes = [t.shape for t in layout.tensors]
    sizes = [t.numel for t in layout.tensors]

    def loss_fn(w: torch.Tensor, b: dict[str, torch.Tensor], x: torch.Tensor,
                y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        params = {n: p.view(s) for n, p, s in zip(names, torch.split(w, sizes), shapes,
                                                  strict=True)}
        logits = functional_call(module, {**params, **b}, (x,))
        ce = F.cross_entropy(logits, y, reduction="none")
        if ce.ndim > 1:  # next tokens [B, T] (a causal LM): the mean over the batch's tokens
            # whose target is not padding (-100, ignore_index: 0 in ce), as the sequential
            # step's F.cross_entropy; T a sample where nothing is padded
            real = (y != -100).flatten(1).sum(1).to(ce.dtype)
            return (ce.flatten(1).sum(1) * mask).sum() / (real * mask).sum().clamp_min(1)
        return (ce * mask).sum() / mask.sum().clamp_min(1)

    return loss_fn


def _grads(one_fn: Callable[..., Any], step_fn: Callable[..., Any], W: torch.Tensor,
           bufs: dict[str, torch.Tensor],
           X: torch.Tensor, Y: torch.Tensor, M: torch.Tensor, active: torch.Tensor,
           batch_stats: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every client's gradient and loss of one step. A batch-statistics layer must
    see only a client's own samples: a step with a padded batch runs client by
    client, on the unpadded batches."""
    m = W.shape[0]
    if batch_stats and not (bool(M.all()) and bool(active.all())):
        G, L = torch.zeros_like(W), torch.zeros(m, dtype=W.dtype, device=W.device)
        for k in active.nonzero().flatten().tolist():
            n = int(M[k].sum())
            G[k], L[k] = one_fn(W[k], {b: v[k] for b, v in bufs.items()},
                                X[k, :n], Y[k, :n], M[k, :n])
        return G, L
    kept = ({b: v.clone() for b, v in bufs.items()}
            if bufs and not bool(active.all()) else None)
    G, L = step_fn(W, bufs, X, Y, M)
    if kept is not None:  # a finished client's buffers stay as they ended
        done = active == 0
        for b, v in bufs.items():
            v[done] = kept[b][done]
    return G, L


@register("backend", "vmap")
def _vmap(trainer: LocalSGD, method: LocalMethod, x: torch.Tensor | None = None,
          y: torch.Tensor | None = None, *, threads: int = 1, keep_heap: bool = True,
          chunk: Annotated[int, Range(ge=0)] = 0) -> VmapBackend:
    """``chunk``: clients per chunk (0: cache-sized)."""
    return VmapBackend(trainer, method, chunk=chunk or None, x=x, y=y)
