"""APFL: adaptive personalized federated learning (Deng, Kamani, Mahdavi 2020).

"Adaptive Personalized Federated Learning" (arXiv 2003.13461), Algorithm 1.
Client ``k`` keeps a personal model ``v_k`` and a mixing weight ``α_k ∈ [0, 1]``;
its personalised model is ``v̄_k = α_k v_k + (1 − α_k) w``. Each local step,
on one batch ξ and at the current iterates,

    w_k ← w_k − η ∇f(w_k; ξ)                       (the copy of the global model)
    v_k ← v_k − η α_k ∇f(v̄; ξ),   v̄ = α_k v_k + (1 − α_k) w_k
    α_k ← clip_[0,1]( α_k − η_α ⟨v_k − w_k, ∇f(v̄; ξ)⟩ )   (``adaptive``)

(η_α = ``alpha_lr``, default η) with every right-hand side at the step's start.
It runs on the one step loop (:func:`fedloom.client.loop.step_loop`) over ``W = [w_k; v_k]``,
the gradient function giving ``[η g_w; (ηα_k) ḡ]`` (η = 1, no terms: the rule's bits).
The update sent is ``w − w_k`` of the global copy — FedAvg's local SGD, so APFL composes
with any aggregator, compressor and feedback policy — and ``v_k``, ``α_k`` stay in the
per-client store. Evaluation (``personal_acc_*``): ``α_k v_k + (1 − α_k) w`` with the current ``w``.

Checked against the rule written out from the paper with a plain module
(tests/test_personalised.py): the global copy max difference 1.4e-17, ``v_k`` and
``α_k`` 0. Departures: FL-bench's APFL (KarhouTam/FL-bench, src/client/apfl.py) mixes
the two models' *logits* and updates α only in the first epoch, with a 0.02 α
regulariser; fedloom follows the paper's parameter mixing and updates α every step.
Scope: plain local SGD, no dropout. The scope, BatchNorm, the starting values and the
check: docs/explanation/methods.md (APFL in detail).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.nn import functional as F

from fedloom.client.loop import step_loop
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.params import Layout, functional_forward
from fedloom.registry import register
from fedloom.state import FieldSpec
from fedloom.transforms import chain

__all__ = ["APFL"]


class APFL(LocalMethod):
    name = "apfl"
    personal = True

    def __init__(self, alpha: float = 0.5, adaptive: bool = True,
                 alpha_lr: float | None = None) -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
            raise ValueError(f"client.method.options.alpha: must be in [0, 1], got {alpha!r}")
        if not isinstance(adaptive, bool):
            raise ValueError(f"client.method.options.adaptive: true or false, got {adaptive!r}")
        if alpha_lr is not None and (isinstance(alpha_lr, bool) or not isinstance(
                alpha_lr, int | float) or not alpha_lr > 0):
            raise ValueError(f"client.method.options.alpha_lr: must be > 0, got {alpha_lr!r}")
        self.alpha, self.adaptive, self.alpha_lr = float(alpha), adaptive, alpha_lr

    def check_trainer(self, trainer: LocalSGD) -> None:
        for key in ("momentum", "weight_decay", "prox_mu"):
            if getattr(trainer, key):
                raise ValueError(f"client.{key}: apfl runs plain local SGD (the paper's)")
        if trainer.amp != "none":
            raise ValueError("client.amp: apfl runs in full precision")
        if trainer.random_forward:
            raise ValueError("model: apfl needs a forward without random draws (dropout)")

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {"personal": FieldSpec(d), "mix": FieldSpec(1), "personal_set": FieldSpec(1)}

    def personal_models(self, rows: Mapping[str, torch.Tensor], w: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        a = rows["mix"].to(w.device, w.dtype)
        return a * rows["personal"].to(w.device, w.dtype) + (1 - a) * w, rows[
            "personal_set"][:, 0] > 0

    def run(self, trainer: LocalSGD, job: ClientJob) -> ClientResult:
        started = bool(job.state["personal_set"][0] > 0)
        w = job.w.detach().clone()
        v = job.state["personal"].to(w.dtype).clone() if started else w.clone()
        a = float(job.state["mix"][0]) if started else self.alpha
        a_lr = self.alpha_lr if self.alpha_lr is not None else job.lr
        # One row a model (the global copy, the personal one), each row's step already
        # scaled: η = 1 on both rows and an empty chain make W ← W − 1·D exactly
        # w − η g_w and v − (ηα) ḡ, the rule's two roundings.
        W = torch.stack([w, v])
        steps = _Steps(self, trainer, job, W, a, a_lr)
        was = trainer.module.training
        trainer.module.train()
        try:
            n = len(steps.batches)
            step_loop(W, W.clone(), chain(), steps, [n, n], [1.0, 1.0])
        finally:
            trainer.module.train(was)
        a = steps.a
        res = ClientResult(job.client, (job.w - W[0]).contiguous(), int(job.y.shape[0]),
                           steps.loss_sum / max(1, n), n, buffers=steps.bufs_w)
        res.state = {"personal": W[1].clone(), "mix": torch.tensor([a], dtype=w.dtype),
                     "personal_set": torch.ones(1, dtype=w.dtype)}
        res.extra["apfl_alpha"] = a
        return res


class _Steps:
    """APFL's gradient function for :func:`~fedloom.client.loop.step_loop` on
    ``W = [w; v]``: step ``t``'s ``[η g_w; (ηα) ḡ]`` at the step's start, and α's
    update (from ``v − w`` and ``ḡ`` at the step's start, the direction taken
    with the old α) made before the loop steps ``W``."""

    def __init__(self, method: APFL, trainer: LocalSGD, job: ClientJob, W: torch.Tensor,
                 a: float, a_lr: float) -> None:
        self.method, self.trainer, self.job, self.W = method, trainer, job, W
        self.a, self.a_lr, self.loss_sum = a, a_lr, 0.0
        self.batches = trainer.job_batches(job)
        template = job.buffers or trainer._flat_module().init_buffers
        self.bufs_w = {n: t.clone() for n, t in template.items()}
        self.bufs_v = {n: t.clone() for n, t in template.items()}

    def __call__(self, step: int) -> torch.Tensor:
        trainer, job, a, lr = self.trainer, self.job, self.a, self.job.lr
        module, layout = trainer.module, trainer.layout
        w, v = self.W[0], self.W[1]
        idx = self.batches[step]
        xb, yb = trainer.batch(job.x, idx, job.gen_seed, step), job.y[idx]
        loss_w, g_w = _grad(module, layout, w, xb, yb, self.bufs_w)
        v_bar = a * v + (1 - a) * w
        _, g_bar = _grad(module, layout, v_bar, xb, yb, self.bufs_v)
        self.loss_sum += loss_w
        d_alpha = float(torch.dot((v - w).reshape(-1), g_bar.reshape(-1)))
        # lr * a * g_bar is (lr·a)·ḡ, as the rule's v − lr * a * ḡ rounds it
        D = torch.stack([lr * g_w, lr * a * g_bar])
        if self.method.adaptive:
            self.a = min(1.0, max(0.0, a - self.a_lr * d_alpha))
        return D


def _grad(module: torch.nn.Module, layout: Layout, w: torch.Tensor, xb: torch.Tensor,
          yb: torch.Tensor, bufs: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
    wg = w.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(functional_forward(module, layout, wg, xb, buffers=bufs or None), yb)
    (g,) = torch.autograd.grad(loss, wg)
    return float(loss.detach()), g


@register("method", "apfl")
def _apfl(alpha: float = 0.5, adaptive: bool = True, alpha_lr: float | None = None) -> APFL:
    """APFL: a personal model mixed with the global one by an adaptive ``α_k``.

    Reference:
        paper: Deng, Kamani & Mahdavi, "Adaptive Personalized Federated Learning",
            arXiv 2003.13461, 2020, Algorithm 1.
        code: KarhouTam/FL-bench, src/client/apfl.py (read; it mixes logits, see the
            module docstring); checked against the paper's rule written out
            (tests/test_personalised.py, max difference 1.4e-17 in float64).
        departures: α updated every local step from the step's batch; plain SGD only.
    """
    return APFL(alpha, adaptive, alpha_lr)


