"""FedSA-LoRA: the adapters' ``A`` shared, their ``B`` personal (Guo et al. 2025).

Guo, Zeng, Wang, Fan, Wang, Qu, "Selective Aggregation for Low-Rank Adaptation in
Federated Learning" (ICLR 2025): in LoRA's ``(α/r) B A``, the ``A`` matrices learn
what the clients share and the ``B`` matrices what is particular to each, so only
the ``A`` matrices are aggregated and each client keeps its ``B``. It is FedPer's
rule (:mod:`fedloom.client.fedper`) with the personal part chosen by tensor, not by
layer group (a projection's ``A`` and ``B`` are one group): a sampled client

1. starts from the received ``A`` with its own ``B`` (the received ``B``, the
   server's, while it has none yet);
2. trains both with the client's settings;
3. keeps the trained ``B`` and sends ``A``'s update only (``B``'s coordinates as
   zeros, so any aggregator, compressor and feedback policy applies; the server's
   ``B`` never moves from its zero start).

Personal model for evaluation: client ``k``'s ``(A, B_k)``, the global ``A`` with
its own ``B``, on its own test split
(:meth:`fedloom.engine.stages.evaluation.Evaluator.personal`): ``personal_acc_*`` (token
accuracy) and, the model being a causal LM, ``personal_ppl_*``; a client never sampled
is reported apart (``unsampled_acc_*``, ``unsampled_ppl_*``). The perplexity, the
clients never sampled and the global model's figures: docs/explanation/methods.md
(FedSA-LoRA in detail).
"""

from __future__ import annotations

from typing import Literal

import torch

from fedloom.client.fedper import FedPer
from fedloom.params import Layout
from fedloom.registry import register

__all__ = ["FedSALoRA"]


class FedSALoRA(FedPer):
    """FedPer's bookkeeping with the personal coordinates the adapters' ``B`` (or ``A``)."""

    name = "fedsa_lora"

    def __init__(self, layout: Layout, keep: Literal["B", "A"] = "B") -> None:
        if keep not in ("A", "B"):
            raise ValueError(f"client.method.options.keep: must be 'B' or 'A', got {keep!r}")
        tag = f".lora_{keep}."
        mine = [t for t in layout if tag in t.name]
        other = ".lora_A." if keep == "B" else ".lora_B."
        if not mine or not any(other in t.name for t in layout):
            raise ValueError(
                "client.method: fedsa_lora needs LoRA adapters with both A and B trained "
                "(model.name: hf_causal_lm, model.options.lora.r > 0, "
                "model.options.lora.train: both); "
                f"the model's trainable tensors: {', '.join(layout.names[:4])}"
                + (" …" if len(layout.names) > 4 else ""))
        # not PersonalHead.__init__: the personal part is a set of tensors, not of groups
        self.layout = layout
        self.groups = [g for g in layout.groups if any(tag in n for n in g.tensors)]
        self.mask = torch.zeros(layout.size)
        for t in mine:
            self.mask[t.slice] = 1
        self.index = self.mask.nonzero().squeeze(1)


@register("method", "fedsa_lora")
def _fedsa_lora(layout: Layout, keep: Literal["B", "A"] = "B") -> FedSALoRA:
    """FedSA-LoRA: the adapters' ``A`` aggregated, each client's ``B`` kept
    (``keep: A``, the other way round, is the paper's ablation).

    Reference:
        paper: Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated
            Learning", ICLR 2025 (arXiv 2410.01463).
        code: Pengxin-Guo/FedSA-LoRA, federatedscope/llm/yamls/fedsa-lora.yaml (checked:
            FederatedScope's personalization.local_param: ['lora_B'], i.e. the tensors
            named lora_B stay local and every other trainable tensor is averaged; A and
            B both train, federate.freeze_A: False); federatedscope/llm/trainer/trainer.py
            (checked: a client's evaluation, LLMTrainer._hook_on_fit_end, is of its own
            model, its lora_B kept local, on its own split: {split}_avg_loss, the mean
            token loss of its batches weighted by batch size, as personal_ppl_*'s log
            here with windows of equal length).
        departures: B's update is sent as zeros rather than left out (FedPer's
            departure: every aggregator and compressor applies; an identity payload
            still counts B's zeros in uplink_bytes, a sparse one does not); local
            training is fedloom's SGD (the paper's code uses AdamW); a client never
            sampled is evaluated with the initial B and counted apart
            (unsampled_ppl_*), not in personal_ppl_*.
    """
    return FedSALoRA(layout, keep)
