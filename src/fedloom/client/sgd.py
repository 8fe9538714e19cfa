"""Local SGD on the flat parameter vector.

The client minimises ``F_k(w') + (μ/2)‖w' − w‖²`` (FedProx, Li et al. 2020;
μ = 0 is FedAvg's local solver) with SGD, momentum and weight decay exactly as
``torch.optim.SGD`` (dampening 0, no Nesterov):

    d = ∇f(w') + wd·w' (+ μ(w' − w)),   b ← m·b + d (b = d on the first step),
    w' ← w' − η·b.

The steps are :func:`fedloom.client.loop.step_loop`, the one loop of every
trainer, with this trainer's gradient function (:class:`_Gradients`: autograd on
:class:`_FlatModule`, whose parameters are views of one flat vector ``w'``); the
direction's terms are the chain of :mod:`fedloom.client.transforms`. Where the
direction is the gradient itself each parameter steps by autograd's tensor, as
``torch.optim.SGD`` does (the same bits).

Batch order comes from a generator derived from ``(seed, round, client,
"batch")``: each epoch a fresh permutation, the last batch may be short; with
``steps`` set, epochs are chained until that many steps are done. Local steps
run in **train mode** (dropout masks from the step's derived seed,
:meth:`LocalSGD._descend`; BatchNorm's running statistics updated in place);
the start loss and the probes are evaluations, in eval mode. A job carries the
buffers to start from, the result those training ended with
(:mod:`fedloom.buffers`); buffers are never part of the update ``w − w_k``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from fedloom.buffers import buffer_names, load_buffers, module_buffers
from fedloom.client.loop import step_loop
from fedloom.client.transforms import Objective, job_chain, job_terms, split_terms
from fedloom.config import ScheduleConfig
from fedloom.job import ClientJob, ClientResult, Penalty
from fedloom.params import Layout, functional_forward, training_mode
from fedloom.rng import Purpose, derive_seed, forked_rng, reseed

__all__ = ["ClientJob", "ClientResult", "LocalSGD", "Penalty", "lr_at_round"]


def lr_at_round(base: float, sched: ScheduleConfig, round: int, rounds: int) -> float:
    """The client learning rate of round ``round`` (0-based) out of ``rounds``.

    - constant: ``η``;
    - exp: ``η γ^t`` (CRAFT's code: γ = 0.999);
    - cosine: linear warm-up ``η (t+1)/W`` for ``t < W``, then
      ``η_min + ½(η − η_min)(1 + cos(π (t − W)/(T − 1 − W)))`` (SA-PEF's code:
      W = 5, η 0.1 → 0.003).
    """
    if sched.name == "constant":
        return base
    if sched.name == "exp":
        return base * sched.gamma**round
    w = sched.warmup
    if round < w:
        return base * (round + 1) / w
    span = max(1, rounds - 1 - w)
    frac = min(1.0, (round - w) / span)
    return sched.final_lr + 0.5 * (base - sched.final_lr) * (1 + math.cos(math.pi * frac))


class _FlatModule:
    """A copy of the model whose parameters are views of one flat vector ``w``
    and whose ``.grad`` are views of one flat vector ``g``.

    ``loss.backward()`` then accumulates every parameter's gradient straight into
    ``g`` (autograd adds in place into an existing ``.grad``), so a step needs
    neither ``functional_call``'s parameter swap nor a concatenation, and an
    in-place update of ``w`` is an update of the model. The arithmetic is the
    same as differentiating through views of ``w``: the results are the same bits.
    """

    def __init__(self, module: nn.Module, layout: Layout) -> None:
        self.module = copy.deepcopy(module)
        params = dict(self.module.named_parameters())
        # the trained tensors' dtype (a frozen base may hold another: model.options.base_dtype)
        first = params[layout.tensors[0].name] if layout.tensors else next(iter(params.values()))
        # On the module's device: the run's (fedloom.device), or a worker's GPU.
        self.w = torch.zeros(layout.size, dtype=first.dtype, device=first.device)
        self.g = torch.zeros(layout.size, dtype=first.dtype, device=first.device)
        # the trained parameters and their gradients' views of g, in the same order
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        for spec in layout.tensors:
            p = params[spec.name]
            p.data = self.w[spec.slice].view(spec.shape)
            p.grad = self.g[spec.slice].view(spec.shape)
            self.params.append(p)
            self.grads.append(p.grad)
        for name, p in params.items():
            if name not in layout._by_name:  # frozen parameters are not trained
                p.requires_grad_(False)
        # Local training runs in train mode (dropout, batch statistics); the
        # buffers a train-mode forward updates in place are these tensors.
        self.module.train()
        named = dict(self.module.named_buffers())
        self.buffers = {n: named[n] for n in buffer_names(self.module)}
        self.init_buffers = module_buffers(self.module)


def _epoch_views(x: torch.Tensor, y: torch.Tensor,
                 plan: list[tuple[torch.Tensor, list[tuple[int, int]]]]
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's ``(x[indices], y[indices])``: one gather of ``x`` and ``y`` by an
    epoch's permutation, its batches slices (views) of it, instead of one gather a
    step; the same samples in the same order."""
    for perm, spans in plan:
        xp, yp = x[perm], y[perm]
        for a, b in spans:
            yield xp[a:b], yp[a:b]


_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class _LossScale:
    """fp16 loss scaling with ``torch.amp.GradScaler``'s defaults (init 2¹⁶,
    backoff ½, growth 2 after 2000 finite steps)."""

    def __init__(self) -> None:
        self.scale = 2.0**16
        self.good = 0
        self.finite = True

    def unscale(self, g: torch.Tensor) -> None:
        g.mul_(1.0 / self.scale)
        self.finite = bool(torch.isfinite(g).all())
        if not self.finite:
            self.scale *= 0.5
            self.good = 0
        else:
            self.good += 1
            if self.good == 2000:
                self.scale *= 2.0
                self.good = 0


def _amp_backward(module: nn.Module, x: torch.Tensor, y: torch.Tensor, amp: str,
                  scaler: _LossScale | None, g: torch.Tensor) -> torch.Tensor:
    """Forward and loss under autocast, backward into ``g`` (unscaled); returns the loss."""
    with torch.autocast(x.device.type, dtype=_AMP_DTYPES[amp]):
        logits = module(x)
    # The loss in float32: cross-entropy's log-sum-exp is where half precision hurts.
    loss = F.cross_entropy(logits.float(), y)
    if scaler is None:
        loss.backward()
    else:
        (loss * scaler.scale).backward()
        scaler.unscale(g)
    return loss


class _Scratch:
    """What a trainer holds between calls, never one of its settings: its flat
    module (built on first use, in each process) and the vector :meth:`LocalSGD.run`
    writes the update into (:meth:`LocalSGD.updates_into`). A pickled or copied
    trainer starts with an empty one."""

    def __init__(self) -> None:
        self.fm: _FlatModule | None = None
        self.update_out: torch.Tensor | None = None

    def __reduce__(self) -> tuple[type[_Scratch], tuple[()]]:
        return _Scratch, ()


@dataclass(frozen=True)
class LocalSGD:
    """Settings of local training (no state: momentum restarts every round).

    ``amp`` (``client.amp``): ``none`` (default), ``bf16`` or ``fp16`` runs the
    forward pass and the loss under ``torch.autocast`` on the module's device;
    the parameters, their gradient and the SGD update stay in the run's dtype
    (float32; a float64 run refuses amp: autocast leaves float64 alone). fp16
    scales the loss as ``torch.amp.GradScaler`` does, on the flat gradient:
    start at 2¹⁶, a step whose unscaled gradient is not finite is skipped and
    halves the scale, 2000 finite steps in a row double it; the scale restarts
    every round with the momentum. The start-loss, smoothness and mismatch
    probes run in full precision. ``none`` is the code path without autocast,
    bit for bit.
    """

    module: nn.Module
    layout: Layout
    batch_size: int = 32
    epochs: int = 1
    steps: int | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    prox_mu: float = 0.0
    amp: str = "none"
    # The train-mode forward draws random numbers (dropout): fedloom.buffers.random_in_train.
    # Such a model trains on the sequential path (each client's masks from its own stream).
    random_forward: bool = False
    # Training augmentation (fedloom.data.augment; data.augment): applied to every local
    # batch, its draws from (batch-order seed, step, "augment") — so (seed, round, client,
    # step) — identically on every backend.
    augment: Any = None
    # More terms of the direction (client.transforms; fedloom.client.transforms), the
    # same objects on every backend: written once on a leading client dimension.
    transforms: tuple[Any, ...] = ()
    # Its working state (_Scratch): not a setting, so not an argument, not compared,
    # not shown; dataclasses.replace gives the new trainer an empty one.
    _scratch: _Scratch = field(default_factory=_Scratch, init=False, repr=False,
                               compare=False)

    def __copy__(self) -> LocalSGD:
        # a copy is a new value with its own working state (its own flat module)
        return dataclasses.replace(self)

    def batch(self, x: torch.Tensor, idx: torch.Tensor, seed: int, step: int) -> torch.Tensor:
        """The inputs of local step ``step``: ``x[idx]``, augmented when configured."""
        return self.augmented(x[idx], seed, step)

    def augmented(self, xb: torch.Tensor, seed: int, step: int) -> torch.Tensor:
        """The batch ``xb`` of local step ``step``, augmented when configured."""
        if self.augment is None:
            return xb
        g = torch.Generator()
        g.manual_seed(derive_seed(seed, step, -1, Purpose.AUGMENT))
        out: torch.Tensor = self.augment(xb, g)
        return out

    def num_steps(self, n: int, epochs: int | None = None) -> int:
        if self.steps is not None:
            return self.steps
        return (epochs or self.epochs) * math.ceil(n / self.batch_size)

    def batch_indices(self, n: int, gen: torch.Generator, epochs: int | None = None,
                      max_steps: int | None = None) -> list[torch.Tensor]:
        """The index batches of one round: permutations chained epoch after epoch
        (the first ``max_steps`` of them when that is set)."""
        return [perm[a:b] for perm, spans in self.epoch_batches(n, gen, epochs, max_steps)
                for a, b in spans]

    def epoch_batches(self, n: int, gen: torch.Generator, epochs: int | None = None,
                      max_steps: int | None = None
                      ) -> list[tuple[torch.Tensor, list[tuple[int, int]]]]:
        """:meth:`batch_indices` by epoch: each epoch's permutation and the
        ``[start, stop)`` spans of it that are its batches (the same draws)."""
        total = self.num_steps(n, epochs)
        if max_steps is not None:
            total = min(total, max_steps)
        if n <= 0:
            # no sample to draw from: with client.steps set this loop would never end
            raise ValueError("local training: the client holds no training sample")
        out: list[tuple[torch.Tensor, list[tuple[int, int]]]] = []
        count = 0
        while count < total:
            perm = torch.randperm(n, generator=gen)
            spans: list[tuple[int, int]] = []
            for s in range(0, n, self.batch_size):
                spans.append((s, min(s + self.batch_size, n)))
                count += 1
                if count == total:
                    break
            out.append((perm, spans))
        return out

    def job_batches(self, job: ClientJob) -> list[torch.Tensor]:
        """The index batches :meth:`train` draws for ``job`` (a generator seeded with
        ``job.gen_seed``, then :meth:`batch_indices`): the batched backends and
        methods with their own loop draw through this, so a client sees the same
        samples in the same order on every path."""
        gen = torch.Generator()
        gen.manual_seed(job.gen_seed)
        return self.batch_indices(int(job.y.shape[0]), gen, job.steps.epochs,
                                  job.steps.max_steps)

    def descend(
        self,
        x0: torch.Tensor,
        anchor: torch.Tensor,
        x: torch.Tensor,
        y: torch.Tensor,
        lr: float,
        gen: torch.Generator,
        *,
        prox_mu: float | None = None,
        grad_shift: torch.Tensor | None = None,
        penalty: Penalty | None = None,
        buffers: dict[str, torch.Tensor] | None = None,
        grad_mask: torch.Tensor | None = None,
        objective: Any = None,
        epochs: int | None = None,
        max_steps: int | None = None,
        transforms: tuple[Any, ...] = (),
    ) -> tuple[torch.Tensor, float, int]:
        """Local SGD from ``x0``; the prox term pulls towards ``anchor``; ``penalty``
        regularises the first local steps (FLARE); ``buffers`` are the module
        buffers to start from (default: the module's own); ``grad_mask`` (0/1 per
        coordinate) multiplies every step's direction, so masked coordinates stay
        where they start; ``objective(module, xb, yb, step)`` returns a step's loss
        in place of the cross-entropy of ``module(xb)`` (MOON).

        Returns the final parameters, the mean batch loss and the number of steps.
        """
        terms = (*job_terms(grad_shift, penalty, prox_mu, grad_mask),
                 *((Objective(objective),) if objective is not None else ()), *transforms)
        w, loss, steps, _ = self._descend(x0, anchor, x, y, lr, gen, terms=terms, probe=False,
                                          buffers=buffers, epochs=epochs, max_steps=max_steps)
        return w.clone(), loss, steps

    def _descend(self, x0: torch.Tensor, anchor: torch.Tensor, x: torch.Tensor,
                 y: torch.Tensor, lr: float, gen: torch.Generator, *,
                 buffers: dict[str, torch.Tensor] | None = None, **kw: Any
                 ) -> tuple[torch.Tensor, float, int, float | None]:
        """The local steps in train mode, from ``buffers`` (default: the module's
        own; the trained ones are left in the flat module, :meth:`_trained_buffers`).

        Randomness in the forward (dropout masks) draws from torch's global
        generator, forked for the call: step ``t`` reseeds it with
        ``derive_seed(s, t, -1, "dropout")``, ``s`` the batch-order seed
        ``derive_seed(seed, round, client, "batch")``, so a mask depends on
        (seed, round, client, step) only — not on the backend, the order of
        clients, the process or a resume — and the caller's global generator is
        left as it was.
        """
        fm = self._flat_module()
        if fm.buffers:
            load_buffers(fm.module, buffers if buffers else fm.init_buffers)
        with forked_rng(derive_seed(gen.initial_seed(), -1, -1, Purpose.DROPOUT), fm.w.device):
            return self._local_steps(x0, anchor, x, y, lr, gen, **kw)

    def _trained_buffers(self) -> dict[str, torch.Tensor]:
        """Copies of the buffers as the last local training left them."""
        return {n: v.detach().clone() for n, v in self._flat_module().buffers.items()}

    def _train_grad(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                    seed: int) -> torch.Tensor:
        """``∇f(w)`` as a train-mode step computes it (the step's dropout seed),
        on copies of the buffers (the trained ones are not touched)."""
        fm = self._flat_module()
        wg = w.detach().clone().requires_grad_(True)
        bufs = {n: v.detach().clone() for n, v in fm.buffers.items()}
        reseed(seed, fm.w.device)
        loss = F.cross_entropy(functional_forward(fm.module, self.layout, wg, x, buffers=bufs), y)
        (g,) = torch.autograd.grad(loss, wg)
        return g

    def _local_steps(
        self, x0: torch.Tensor, anchor: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
        lr: float, gen: torch.Generator, *, terms: tuple[Any, ...], probe: bool,
        epochs: int | None = None, max_steps: int | None = None,
    ) -> tuple[torch.Tensor, float, int, float | None]:
        fm = self._flat_module()
        w = fm.w
        with torch.no_grad():
            w.copy_(x0)
        # The direction's terms, defined once for every trainer (fedloom.client.transforms).
        direction = job_chain(terms, weight_decay=self.weight_decay, prox_mu=self.prox_mu,
                              momentum=self.momentum, extra=self.transforms)
        own = split_terms(terms).objective
        plan = self.epoch_batches(int(y.shape[0]), gen, epochs, max_steps)
        grads = _Gradients(self, fm, x, y, plan, gen.initial_seed(),
                           own.loss if own is not None else None, _Probe(x0) if probe else None)
        # Where the direction is the gradient itself (an empty chain: FedAvg's local
        # SGD) and no probe reads it, each parameter steps by autograd's own tensor,
        # as torch.optim.SGD does: the copy into g was one more pass over d a step,
        # about 7 % of the CPU time of a CNN round (pfl_cnn, batch 10). The same bits:
        # w − η·g is rounded entry by entry, the same wherever the entry sits, so
        # stepping the parameters (views of w) is stepping w; a parameter the loss
        # does not reach (∇ = 0) stays as w − η·0 leaves it, -0.0 included.
        grads.direct, grads.lr = grads.plain and not direction.transforms and not probe, lr
        n = len(grads.batches)
        step_loop(w, anchor, direction, grads, [n], [lr])
        # the flat module's own vector, written over by the next training: the public
        # entry points (descend, train) hand out a copy, run() reads it once
        smooth = grads.probe.smooth if grads.probe is not None else None
        return w.detach(), grads.loss_sum / max(1, n), n, smooth

    def _gradient(self, fm: _FlatModule, xb: torch.Tensor, ys: torch.Tensor, step: int,
                  plain: bool, objective: Any, scaler: _LossScale | None) -> torch.Tensor:
        """One batch's loss, its gradient written into ``fm.g``: autograd.grad's
        tensors copied in (the plain step), or backward into ``.grad`` views of the
        zeroed ``fm.g`` (a method's objective, mixed precision)."""
        if plain:
            loss = F.cross_entropy(fm.module(xb), ys)
            grads = torch.autograd.grad(loss, fm.params, allow_unused=True)
            for gv, gr in zip(fm.grads, grads, strict=True):
                if gr is None:  # a parameter the loss does not reach: ∇ = 0
                    gv.zero_()
                else:
                    gv.copy_(gr)
            return loss
        fm.g.zero_()
        if objective is not None:
            obj_loss: torch.Tensor = objective(fm.module, xb, ys, step)
            obj_loss.backward()
            return obj_loss
        return _amp_backward(fm.module, xb, ys, self.amp, scaler, fm.g)

    def _flat_module(self) -> _FlatModule:
        # Built once per trainer (and per worker process, after unpickling).
        if self._scratch.fm is None:
            self._scratch.fm = _FlatModule(self.module, self.layout)
        return self._scratch.fm

    @contextmanager
    def updates_into(self, out: torch.Tensor) -> Iterator[None]:
        """Within the block, :meth:`run` writes the update into ``out`` (a vector of
        the update's size and dtype; otherwise a new vector, as outside) instead of a
        new vector: a ``process`` worker's row of the server's shared rows, where the
        update was a fresh 6.5 MB vector copied there (a CIFAR-10 CNN). The same bits.
        For a local method that calls :meth:`run` once a client."""
        self._scratch.update_out = out
        try:
            yield
        finally:
            self._scratch.update_out = None

    def grad(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
             buffers: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``∇f(w)`` of the mean cross-entropy on ``(x, y)`` (no regularisers), the
        module in eval mode with ``buffers`` (default: its own)."""
        wg = w.detach().clone().requires_grad_(True)
        with training_mode(self.module, False):
            logits = functional_forward(self.module, self.layout, wg, x, buffers=buffers)
        loss = F.cross_entropy(logits, y)
        (g,) = torch.autograd.grad(loss, wg)
        return g

    def train(self, job: ClientJob) -> tuple[torch.Tensor, float, int, float | None]:
        """The job's local steps from ``job.start`` (default ``w``), the prox term
        pulling towards ``w``: ``(w_k, mean batch loss, steps, smoothness probe or
        None)``. The buffers training ended with are :meth:`_trained_buffers`."""
        w_k, loss, steps, smooth = self._train(job)
        return w_k.clone(), loss, steps, smooth

    def _train(self, job: ClientJob) -> tuple[torch.Tensor, float, int, float | None]:
        """:meth:`train` with ``w_k`` the trainer's own vector (valid until it trains again)."""
        gen = torch.Generator()
        gen.manual_seed(job.gen_seed)
        return self._descend(job.start, job.w, job.x, job.y, job.lr, gen, terms=job.transforms,
                             probe=job.steps.probe, epochs=job.steps.epochs,
                             max_steps=job.steps.max_steps, buffers=job.buffers)

    def run(self, job: ClientJob) -> ClientResult:
        """Train from ``job.start`` (default ``w``); the update is measured from ``w``."""
        w_global = job.w
        start_loss = (self.full_loss(w_global, job.x, job.y, buffers=job.buffers)
                      if job.steps.start_loss else None)
        w_k, loss, steps, smooth = self._train(job)
        out = self._scratch.update_out
        if out is not None and out.shape == w_k.shape and out.dtype == w_k.dtype:
            update = torch.sub(w_global, w_k, out=out)
        else:
            update = torch.sub(w_global, w_k)  # a new vector: w_k is the trainer's own
        res = ClientResult(job.client, update, int(job.y.shape[0]), loss, steps, start_loss,
                           buffers=self._trained_buffers())
        if smooth is not None:
            res.extra["smoothness"] = smooth
        return res

    @torch.no_grad()
    def full_loss(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                  batch: int = 4096, buffers: dict[str, torch.Tensor] | None = None) -> float:
        """Mean cross-entropy of ``w`` over all of ``(x, y)`` (over every label: a
        sample's, or each next token's): an evaluation (eval mode, with ``buffers``;
        default: the module's own)."""
        total = 0.0
        with training_mode(self.module, False):
            for s in range(0, x.shape[0], batch):
                logits = functional_forward(self.module, self.layout, w, x[s : s + batch],
                                            buffers=buffers)
                total += float(F.cross_entropy(logits, y[s : s + batch], reduction="sum"))
        # per label: one a sample, or one a token of a causal LM's next tokens [N, T]
        # (a padded target, -100, cross-entropy's ignore_index, is none)
        return total / max(1, int((y != -100).sum()))


class _Gradients:
    """The sequential trainer's gradient function of :func:`~fedloom.client.loop.step_loop`:
    step ``t``'s batch (its dropout stream reseeded, augmented when configured),
    its loss summed in step order, its gradient in ``fm.g``. ``None`` for a step
    that moves nothing through the chain: a direct step (``direct``: the
    parameters stepped by η·autograd's tensors here) or an fp16 overflow (skipped,
    the scale halved). ``probe``: the smoothness probe's, where asked for."""

    def __init__(self, tr: LocalSGD, fm: _FlatModule, x: torch.Tensor, y: torch.Tensor,
                 plan: list[tuple[torch.Tensor, list[tuple[int, int]]]], seed: int,
                 objective: Any, probe: _Probe | None) -> None:
        self.tr, self.fm, self.x, self.y = tr, fm, x, y
        self.views = _epoch_views(x, y, plan)
        self.batches = [perm[a:b] for perm, spans in plan for a, b in spans]
        self.seed = seed  # the batch-order seed; step t's dropout stream from it
        self.objective, self.probe = objective, probe
        self.scaler = _LossScale() if tr.amp == "fp16" else None
        # The plain step (cross-entropy, full precision) takes the gradient as
        # autograd.grad's tensors and copies them into g (LocalSGD._gradient).
        self.plain = objective is None and tr.amp == "none"
        self.direct, self.lr = False, 0.0
        self.loss_sum = 0.0

    def __call__(self, step: int) -> torch.Tensor | None:
        xs, ys = next(self.views)
        fm, w = self.fm, self.fm.w
        reseed(derive_seed(self.seed, step, -1, Purpose.DROPOUT), w.device)
        xb = self.tr.augmented(xs, self.seed, step)
        if self.direct:
            self.loss_sum += _direct_step(fm, xb, ys, self.lr)
            return None
        loss = self.tr._gradient(fm, xb, ys, step, self.plain, self.objective, self.scaler)
        self.loss_sum += float(loss.detach())
        if self.scaler is not None and not self.scaler.finite:
            return None  # fp16 overflow: the step is skipped, the scale halved
        if self.probe is not None:
            self._measure(self.probe, step)
        return fm.g

    def _measure(self, probe: _Probe, step: int) -> None:
        """Secant estimate of L on batch 0 between the start and the first step."""
        w = self.fm.w
        if step == 1 and probe.first is not None:
            b0 = self.batches[0]
            g1 = self.tr._train_grad(w.detach(), self.tr.batch(self.x, b0, self.seed, 0),
                                     self.y[b0], derive_seed(self.seed, 0, -1, Purpose.DROPOUT))
            dx = float(torch.linalg.vector_norm(w.detach() - probe.x0))
            if dx > 0:
                probe.smooth = float(torch.linalg.vector_norm(g1 - probe.first)) / dx
        if step == 0:
            probe.first = self.fm.g.detach().clone()


@dataclass
class _Probe:
    """The smoothness probe's: the start ``x0``, the first step's gradient, the estimate."""

    x0: torch.Tensor
    first: torch.Tensor | None = None
    smooth: float | None = None


def _direct_step(fm: _FlatModule, xb: torch.Tensor, ys: torch.Tensor, lr: float) -> float:
    """One plain SGD step by autograd's own tensors (no copy into ``fm.g``; see
    ``_local_steps``); returns the batch's loss."""
    loss = F.cross_entropy(fm.module(xb), ys)
    grads = torch.autograd.grad(loss, fm.params, allow_unused=True)
    with torch.no_grad():
        for pv, gr in zip(fm.params, grads, strict=True):
            if gr is not None:
                pv.sub_(gr, alpha=lr)
    return float(loss.detach())
