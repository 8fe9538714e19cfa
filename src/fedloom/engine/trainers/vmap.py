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

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn import functional as F

from fedloom.buffers import has_batch_statistics
from fedloom.capabilities import BackendCaps, model_vmap
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.client.transforms import StepContext, jobs_chain
from fedloom.config import BackendConfig
from fedloom.engine.trainers.backends import InProcess
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["VmapBackend", "vmap_supported"]


def vmap_supported(module: nn.Module) -> bool:
    """Models with recurrent layers, and models that say so (``fedloom_vmap =
    False``, :func:`~fedloom.capabilities.model_vmap`: a causal LM with gradient
    checkpointing, whose layers call ``requires_grad_`` inside the forward, which
    torch.func refuses), are left to the sequential backend."""
    return (model_vmap(module)
            and not any(isinstance(m, nn.RNNBase) for m in module.modules()))


class VmapBackend(InProcess):
    name = "vmap"
    capabilities = BackendCaps()  # trains on the samples each job carries

    def __init__(self, trainer: LocalSGD, method: LocalMethod, chunk: int | None = None,
                 x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> None:
        self.trainer = trainer
        self.method = method
        # The whole training data, when given: batches are then gathered from it in
        # one indexing op per step (jobs carry ``data_index``).
        self.x, self.y = x, y
        d = trainer.layout.size
        self.chunk = chunk or max(1, (8 << 20) // (4 * d))
        # Mixed precision (client.amp) trains on the sequential path.
        self.enabled = (type(method) is LocalMethod and vmap_supported(trainer.module)
                        and trainer.amp == "none"
                        # a random train-mode forward (dropout) cannot draw each
                        # client's masks from its own stream under vmap
                        and not trainer.random_forward)

    def train_cohort(self, jobs: Sequence[ClientJob]) -> list[ClientResult | None]:
        if not self.enabled:
            return [self.method.run(self.trainer, j) for j in jobs]
        out: list[ClientResult | None] = []
        for s in range(0, len(jobs), self.chunk):
            part = list(jobs[s : s + self.chunk])
            if any(j.steps.probe for j in part):
                out += [self.trainer.run(j) for j in part]
            else:
                out += self._train(part)
        return out

    def _train(self, jobs: list[ClientJob]) -> list[ClientResult]:
        tr = self.trainer
        # The trainer's train-mode copy: functional_call swaps in each client's
        # parameters and buffers.
        fm = tr._flat_module()
        m = len(jobs)
        w_global = torch.stack([j.w for j in jobs])
        W = torch.stack([j.start for j in jobs]).clone()
        start_loss = [tr.full_loss(j.w, j.x, j.y, buffers=j.buffers) if j.steps.start_loss else None
                      for j in jobs]
        sched = self._schedule(jobs, W.device)
        # The direction's terms, as the sequential trainer's (fedloom.client.transforms).
        direction = jobs_chain(jobs, W, weight_decay=tr.weight_decay, prox_mu=tr.prox_mu,
                               momentum=tr.momentum, extra=tr.transforms)
        dstate = direction.init(W)
        # Each client's buffers (BatchNorm statistics) stacked [m, ...]: a train-mode
        # forward under vmap updates its own row in place.
        bufs = {n: torch.stack([(j.buffers or fm.init_buffers)[n] for j in jobs]).to(W.device)
                for n in fm.buffers}
        one_fn = grad_and_value(_masked_loss(fm.module, tr.layout))
        step_fn, batch_stats = vmap(one_fn), has_batch_statistics(fm.module)
        loss_sum = torch.zeros(m, dtype=torch.float64, device=W.device)
        lr = torch.tensor([j.lr for j in jobs], dtype=W.dtype, device=W.device)
        for t in range(sched.T):
            X, Y, M, active = self._step_batch(sched, jobs, t, W.dtype)
            G, L = _grads(one_fn, step_fn, W, bufs, X, Y, M, active, batch_stats)
            loss_sum += L.detach().to(torch.float64) * active.to(torch.float64)
            with torch.no_grad():
                live = [t < s for s in sched.steps]
                G, dstate = direction.update(G, dstate, StepContext(t, W, w_global, live=live))
                # A finished client is masked out of the update (its buffer is never used
                # again, so it need not be frozen).
                # In place: a fresh [m, d] tensor every step costs page faults.
                W.addcmul_((lr * active)[:, None], G, value=-1.0)
        steps = sched.steps
        return [ClientResult(j.client, (j.w - W[k]).contiguous(), int(j.y.shape[0]),
                             float(loss_sum[k]) / max(1, steps[k]), steps[k], start_loss[k],
                             buffers={b: v[k].clone() for b, v in bufs.items()})
                for k, j in enumerate(jobs)]

    def _schedule(self, jobs: list[ClientJob], dev: torch.device) -> _Schedule:
        """Every client's batches, as the sequential trainer draws them, padded into
        one ``[m, T, B]`` table of sample positions with its masks."""
        tr, m = self.trainer, len(jobs)
        batches = [tr.job_batches(j) for j in jobs]
        steps = [len(b) for b in batches]
        T = max(steps)
        B = max(len(i) for b in batches for i in b)
        # Every step's batch of every client as rows of one source tensor: the
        # whole data (positions via data_index) or the chunk's samples stacked.
        if self.x is not None and all(j.data.index is not None for j in jobs):
            # x and y are set together; all() above: every job has its data_index
            src_x, src_y = self.x, cast(torch.Tensor, self.y)
            owners = cast("list[torch.Tensor]", [j.data.index for j in jobs])
        else:
            src_x = torch.cat([j.x for j in jobs])
            src_y = torch.cat([j.y for j in jobs])
            offs = torch.tensor([0, *[int(j.y.shape[0]) for j in jobs]]).cumsum(0)
            owners = [torch.arange(int(offs[k]), int(offs[k + 1])) for k in range(m)]
        local = torch.full((m, T, B), -1, dtype=torch.long)
        for k, b in enumerate(batches):
            for t, idx in enumerate(b):
                local[k, t, : len(idx)] = idx
        # Batch positions and masks on the run's device (one copy, not one a step).
        gidx = torch.stack([owners[k].to(dev)[local[k].clamp_min(0).to(dev)]
                            for k in range(m)])  # [m, T, B]
        active = torch.tensor([[1.0 if t < steps[k] else 0.0 for t in range(T)]
                               for k in range(m)], device=dev)
        return _Schedule(batches, steps, T, src_x, src_y, gidx, (local >= 0).to(dev), active)

    def _step_batch(self, sched: _Schedule, jobs: list[ClientJob], t: int, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Step ``t``'s stacked batches ``X, Y``, their sample mask and which clients
        still step (padding rows gather a real sample, masked out)."""
        It = sched.gidx[:, t]
        X, Y = sched.src_x[It], sched.src_y[It]
        M = sched.mask[:, t].to(dtype)
        active = sched.active[:, t].to(dtype)
        tr = self.trainer
        if tr.augment is not None:  # each client's real rows, as LocalSGD.batch draws them
            X = X.clone()
            for k in range(len(jobs)):
                if t < sched.steps[k]:
                    n = len(sched.batches[k][t])
                    X[k, :n] = tr.batch(X[k, :n], torch.arange(n, device=X.device),
                                        jobs[k].gen_seed, t)
        return X, Y, M, active


@dataclass
class _Schedule:
    """A chunk's batches: per client, its batches and step count; the padded table
    of sample positions into ``src_x``/``src_y`` ``[m, T, B]``, its sample mask
    and ``active`` ``[m, T]`` (1 while a client still steps)."""

    batches: list[list[torch.Tensor]]
    steps: list[int]
    T: int
    src_x: torch.Tensor
    src_y: torch.Tensor
    gidx: torch.Tensor
    mask: torch.Tensor
    active: torch.Tensor


def _masked_loss(module: nn.Module, layout: Layout) -> Callable[..., torch.Tensor]:
    """One client's masked mean cross-entropy of flat parameters ``w`` and buffers ``b``."""
    names = [t.name for t in layout.tensors]
    shapes = [t.shape for t in layout.tensors]
    sizes = [t.numel for t in layout.tensors]

    def loss_fn(w: torch.Tensor, b: dict[str, torch.Tensor], x: torch.Tensor,
                y: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        params = {n: p.view(s) for n, p, s in zip(names, torch.split(w, sizes), shapes,
                                                  strict=True)}
        logits = functional_call(module, {**params, **b}, (x,))
        ce = F.cross_entropy(logits, y, reduction="none")
        if ce.ndim > 1:  # next tokens [B, T] (a causal LM): a sample's mean over its tokens
            ce = ce.flatten(1).mean(1)
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
def _vmap(trainer: LocalSGD, method: LocalMethod, cfg: BackendConfig | None = None,
          x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> VmapBackend:
    return VmapBackend(trainer, method, chunk=(cfg.chunk or None) if cfg is not None else None,
                       x=x, y=y)
