"""APFL: adaptive personalized federated learning (Deng, Kamani, Mahdavi 2020).

"Adaptive Personalized Federated Learning" (arXiv 2003.13461), Algorithm 1.
Client ``k`` keeps a personal model ``v_k`` and a mixing weight ``α_k ∈ [0, 1]``;
its personalised model is ``v̄_k = α_k v_k + (1 − α_k) w``. Each local step,
on one batch ξ and at the current iterates,

    w_k ← w_k − η ∇f(w_k; ξ)                       (the copy of the global model)
    v_k ← v_k − η α_k ∇f(v̄; ξ),   v̄ = α_k v_k + (1 − α_k) w_k
    α_k ← clip_[0,1]( α_k − η_α ⟨v_k − w_k, ∇f(v̄; ξ)⟩ )   (``adaptive``)

(η_α = ``alpha_lr``, default η) with every right-hand side at the step's start.
The update sent is ``w − w_k`` of the global copy — the same local SGD as FedAvg's, so
APFL composes with any aggregator, compressor and feedback policy — and ``v_k``,
``α_k`` stay in the per-client store. Evaluation: each client's
``v̄_k = α_k v_k + (1 − α_k) w`` with the current global ``w`` (``personal_acc_*``).

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

from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.params import Layout, functional_forward
from fedloom.registry import register
from fedloom.state import FieldSpec

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
        lr = job.lr
        a_lr = self.alpha_lr if self.alpha_lr is not None else lr
        batches = trainer.job_batches(job)
        module, layout = trainer.module, trainer.layout
        template = job.buffers or trainer._flat_module().init_buffers
        bufs_w = {n: t.clone() for n, t in template.items()}
        bufs_v = {n: t.clone() for n, t in template.items()}
        loss_sum = 0.0
        was = module.training
        module.train()
        try:
            for step, idx in enumerate(batches):
                xb, yb = trainer.batch(job.x, idx, job.gen_seed, step), job.y[idx]
                loss_w, g_w = _grad(module, layout, w, xb, yb, bufs_w)
                v_bar = a * v + (1 - a) * w
                _, g_bar = _grad(module, layout, v_bar, xb, yb, bufs_v)
                loss_sum += loss_w
                d_alpha = float(torch.dot((v - w).reshape(-1), g_bar.reshape(-1)))
                w = w - lr * g_w
                v = v - lr * a * g_bar
                if self.adaptive:
                    a = min(1.0, max(0.0, a - a_lr * d_alpha))
        finally:
            module.train(was)
        res = ClientResult(job.client, (job.w - w).contiguous(), int(job.y.shape[0]),
                           loss_sum / max(1, len(batches)), len(batches), buffers=bufs_w)
        res.state = {"personal": v, "mix": torch.tensor([a], dtype=w.dtype),
                     "personal_set": torch.ones(1, dtype=w.dtype)}
        res.extra["apfl_alpha"] = a
        return res


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


