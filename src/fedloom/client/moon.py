"""MOON: model-contrastive federated learning (Li, He, Song, CVPR 2021).

"Model-Contrastive Federated Learning", Algorithm 1. Each local step of client
``k`` minimises

    ℓ_CE(f(x), y) + μ ℓ_con,
    ℓ_con = −log( e^{sim(z, z_glob)/τ} / (e^{sim(z, z_glob)/τ} + e^{sim(z, z_prev)/τ}) ),

averaged over the batch, where ``z`` is the representation of ``x`` under the
model being trained, ``z_glob`` under the global model the client received and
``z_prev`` under the client's own model at the end of its previous round (the
received model while it has none), ``sim`` the cosine similarity. The
representation is the input of the head — the layer group ``representation``
names (default: the last group, the classifier), flattened — read with a forward
pre-hook. ``mu = 0`` is plain local SGD bit for bit (tested). The previous model
lives in the per-client store (field ``previous``).

Checked against FL-bench's MOON (KarhouTam/FL-bench, src/client/moon.py, and
QinbinLi/MOON's loss) written out with ``torch.optim.SGD`` in tests/test_personalised.py:
the same local round, max difference 5.6e-17. Departures: no projection head (the paper
adds a 2-layer one to its ResNets; put one in the model to have it);
FL-bench's classifier input is ``relu(z)`` of a model-specific feature method, fedloom's
``z`` is whatever enters the head. Overflow, the reference models' mode and buffers, the
check: docs/explanation/methods.md (MOON in detail).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from fedloom.client.layers import head_groups
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.client.transforms import Objective
from fedloom.params import Layout, functional_forward
from fedloom.registry import register
from fedloom.state import FieldSpec

__all__ = ["MOON", "contrastive_loss"]


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor,
                     tau: float) -> torch.Tensor:
    """MOON's ``ℓ_con`` per sample (``[batch]``)."""
    s_g = F.cosine_similarity(z.flatten(1), z_glob.flatten(1)) / tau
    s_p = F.cosine_similarity(z.flatten(1), z_prev.flatten(1)) / tau
    return torch.logsumexp(torch.stack([s_g, s_p]), dim=0) - s_g


@dataclasses.dataclass
class _Objective:
    head: str
    layout: Layout
    w_glob: torch.Tensor
    w_prev: torch.Tensor
    buffers: dict[str, torch.Tensor]
    mu: float
    tau: float

    def __call__(self, module: nn.Module, xb: torch.Tensor, yb: torch.Tensor,
                 step: int) -> torch.Tensor:
        head = dict(module.named_modules())[self.head]
        seen: list[torch.Tensor] = []
        hook = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        try:
            logits = module(xb)
            with torch.no_grad():
                for w in (self.w_glob, self.w_prev):
                    copies = {n: v.clone() for n, v in self.buffers.items()}
                    functional_forward(module, self.layout, w, xb, buffers=copies or None)
        finally:
            hook.remove()
        z, z_glob, z_prev = seen
        return F.cross_entropy(logits, yb) + self.mu * contrastive_loss(
            z, z_glob, z_prev, self.tau).mean()


class MOON(LocalMethod):
    name = "moon"

    def __init__(self, layout: Layout, mu: float = 1.0, tau: float = 0.5,
                 representation: Sequence[str] | None = None) -> None:
        for key, v, low in (("mu", mu, 0.0), ("tau", tau, 0.0)):
            if isinstance(v, bool) or not isinstance(v, int | float) or v < low or (
                    key == "tau" and v == 0):
                raise ValueError(f"client.method.options.{key}: must be a number "
                                 f"{'> 0' if key == 'tau' else '>= 0'}, got {v!r}")
        if representation is not None and len(representation) != 1:
            raise ValueError("client.method.options.representation: one layer group name "
                             "(the head whose input is the representation)")
        (group,) = head_groups(layout, representation, "client.method.options.representation")
        self.layout, self.mu, self.tau, self.head = layout, float(mu), float(tau), group.name

    def check_trainer(self, trainer: LocalSGD) -> None:
        if self.head not in dict(trainer.module.named_modules()):
            raise ValueError(f"client.method.options.representation: layer group {self.head!r} "
                             "is not a module of the model (name the head's module)")
        if trainer.amp != "none":
            raise ValueError("client.amp: moon runs its objective in full precision")

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {"previous": FieldSpec(d), "previous_set": FieldSpec(1)}

    def run(self, trainer: LocalSGD, job: ClientJob) -> ClientResult:
        started = bool(job.state["previous_set"][0] > 0)
        prev = job.state["previous"].to(job.w.dtype) if started else job.w
        bufs = job.buffers or trainer._flat_module().init_buffers
        obj = _Objective(self.head, self.layout, job.w.detach(), prev.detach(),
                         {n: v.detach() for n, v in bufs.items()}, self.mu, self.tau)
        res = trainer.run(dataclasses.replace(job, transforms=(*job.transforms, Objective(obj))))
        w_k = job.w - res.update
        res.state = {"previous": w_k.clone(), "previous_set": torch.ones(1, dtype=w_k.dtype)}
        return res


@register("method", "moon")
def _moon(layout: Layout, mu: float = 1.0, tau: float = 0.5,
          representation: Sequence[str] | None = None) -> MOON:
    """MOON: cross-entropy plus ``μ`` × the model-contrastive loss at temperature ``τ``.

    Reference:
        paper: Li, He & Song, "Model-Contrastive Federated Learning", CVPR 2021, Algorithm 1
            (μ = 1 or 5, τ = 0.5).
        code: QinbinLi/MOON; KarhouTam/FL-bench, src/client/moon.py (checked: one local
            round, max difference 5.6e-17 in float64, tests/test_personalised.py).
        departures: the representation is the input of the head (no projection head unless
            the model has one); the contrastive term in its logsumexp form.
    """
    return MOON(layout, mu, tau, representation)
