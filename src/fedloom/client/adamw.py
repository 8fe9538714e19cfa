"""``client.transforms: [{name: adamw}]``: local AdamW as a term of the local step.

The LLM fine-tuning benchmarks (FlowerTune, pfl-research) train the adapters with
AdamW locally. fedloom's local step is ``W ← W − η·D`` after a chain of direction
terms (:mod:`fedloom.client.transforms`); AdamW (Loshchilov & Hutter 2019, as
``torch.optim.AdamW``) is such a term:

    m ← β₁·m + (1 − β₁)·D,  v ← β₂·v + (1 − β₂)·D²
    D ← m / (1 − β₁ᵗ) / (√(v / (1 − β₂ᵗ)) + ε) + λ·W

so that ``η·D`` is AdamW's step with ``η = client.lr`` (decoupled weight decay
``λ``: ``W·(1 − ηλ)`` as torch's). Its moments restart every round with the local
run (a fresh optimizer a round, as a Flower client that builds its trainer in
``fit``). It runs after the method's own terms (FedProx's pull, SCAFFOLD's shift and
``client.weight_decay``, which is L2 inside the moments) and before
``client.momentum``, which should stay 0 with it. Elementwise: the same term on
``[d]`` (sequential) and ``[m, d]`` (vmap, lock-step) directions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from fedloom.client.transforms import StepContext
from fedloom.registry import Range, register

__all__ = ["AdamW", "adamw"]


@dataclass(frozen=True)
class AdamW:
    """AdamW's direction (see the module docstring); state ``(m, v)``."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.01

    def init(self, W: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros_like(W), torch.zeros_like(W)

    def update(self, D: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
               ctx: StepContext) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        m, v = state
        t = ctx.step + 1
        m.lerp_(D, 1 - self.beta1)  # torch.optim.AdamW's own update of the moments
        v.mul_(self.beta2).addcmul_(D, D, value=1 - self.beta2)
        # torch's order: m̂ / (√v / √(1 − β₂ᵗ) + ε), the step's bias correction on m
        denom = (v.sqrt() / (1 - self.beta2**t) ** 0.5).add_(self.eps)
        out = (m / (1 - self.beta1**t)).div_(denom)
        if self.weight_decay:
            out.add_(ctx.W, alpha=self.weight_decay)
        return out, (m, v)


@register("transform", "adamw")
def adamw(beta1: Annotated[float, Range(ge=0, lt=1)] = 0.9,
          beta2: Annotated[float, Range(ge=0, lt=1)] = 0.999,
          eps: Annotated[float, Range(gt=0)] = 1e-8,
          weight_decay: Annotated[float, Range(ge=0)] = 0.01) -> AdamW:
    """Local AdamW (torch.optim.AdamW's defaults); ``client.lr`` is its step size."""
    # client.transforms' options are not checked against Range when the config loads
    # (a list of mappings): the factory says it, in one line
    for key, v, ok in (("beta1", beta1, 0 <= beta1 < 1), ("beta2", beta2, 0 <= beta2 < 1),
                       ("eps", eps, eps > 0), ("weight_decay", weight_decay, weight_decay >= 0)):
        if not ok:
            bound = {"eps": "> 0", "weight_decay": ">= 0"}.get(key, "in [0, 1)")
            raise ValueError(f"adamw: {key} must be {bound}, got {v}")
    return AdamW(beta1, beta2, eps, weight_decay)
