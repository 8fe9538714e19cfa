"""FedBABU: only the body is learned federatedly; the head is fine-tuned to evaluate.

Oh, Kim, Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification" (ICLR 2022). During federated training every client trains
the body only: the head (the layer groups ``personal``, by default the last)
stays at its random initialisation — its coordinates take no step, no
momentum and no weight decay, so its update is exactly zero. Evaluation is by
fine-tuning: set ``eval.finetune_steps`` (the paper fine-tunes the whole
model for a few epochs on each client's data;
:func:`fedloom.engine.stages.evaluation.evaluate_finetuned`), reported as
``finetune_acc_*`` beside the global model's ``client_acc_*``.

Checked against FL-bench's FedBABU (KarhouTam/FL-bench, src/client/fedbabu.py:
the classifier's gradients zeroed before every step): the rule written out in
tests/test_personalised.py gives the same round (digits, a 16-unit MLP,
float64: max difference 6.9e-18; without weight decay, where FL-bench's
optimizer would still decay the head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from fedloom.capabilities import MethodCaps
from fedloom.client.layers import head_groups, head_mask
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob
from fedloom.client.transforms import Mask
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["FedBABU"]


class FedBABU(LocalMethod):
    """Plain local SGD with one more term of the step: the head's coordinates masked
    (:class:`~fedloom.client.transforms.Mask`), so every client backend runs it."""

    name = "fedbabu"
    capabilities = MethodCaps(batched=True)

    def __init__(self, layout: Layout, personal: Sequence[str] | None = None) -> None:
        groups = head_groups(layout, personal, "client.method.options.personal")
        self.body = 1 - head_mask(layout, groups)

    def prepare(self, job: ClientJob, server: Mapping[str, torch.Tensor]) -> ClientJob:
        mask = Mask(self.body.to(job.w.device, job.w.dtype))
        return dataclasses.replace(job, transforms=(*job.transforms, mask))


@register("method", "fedbabu")
def _fedbabu(layout: Layout, personal: Sequence[str] | None = None) -> FedBABU:
    """FedBABU: the head (``personal``, default the last group) frozen at its initialisation.

    Reference:
        paper: Oh, Kim & Yun, "FedBABU: Toward Enhanced Representation for Federated Image
            Classification", ICLR 2022.
        code: KarhouTam/FL-bench, src/client/fedbabu.py (checked: one round, max
            difference 6.9e-18 in float64, tests/test_personalised.py); jhoon-oh/FedBABU.
        departures: the frozen head takes no weight decay either (its gradient is masked
            after decay and prox are added); evaluation by fine-tuning is eval.finetune_steps.
    """
    return FedBABU(layout, personal)


# Read from the factory too, before the run is built (fedloom.capabilities.method_caps).
_fedbabu.capabilities = FedBABU.capabilities  # type: ignore[attr-defined]
