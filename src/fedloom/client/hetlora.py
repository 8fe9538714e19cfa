"""HetLoRA's local side: each client fine-tunes the adapters at its own rank.

Cho, Liu, Joshi, Wang, "Heterogeneous LoRA for Federated Fine-tuning of On-Device
Foundation Models" (EMNLP 2024): clients of different capacity hold LoRA adapters of
different ranks ``r_k ≤ r``. A client of rank ``r_k`` receives the global adapters
truncated to their first ``r_k`` terms (``A[:r_k]``, ``B[:, :r_k]``, so its change of
a projection is ``(α/r) Σ_{i<r_k} b_i a_iᵀ``), trains them, and sends them; the server
zero-pads each client's adapters to rank ``r`` and averages them (the ``hetlora``
aggregator, :mod:`fedloom.aggregate.lora`).

Here the adapters are the model's rank-``r`` tensors and a client's rank is a
truncation of them: local training starts from the received model with the rows
``r_k:`` of every ``A`` and the columns ``r_k:`` of every ``B`` set to zero, and
those coordinates never move (why: docs/explanation/methods.md, HetLoRA in detail).
The client sends the update of the coordinates it holds and zeros for the
others, so any aggregator, compressor and feedback policy applies:

- with ``aggregator.name: hetlora`` (``pad: zero``, the default) the server forms
  the zero-padded weighted mean of the clients' adapters, HetLoRA's aggregation;
- with any other aggregator a client's zeros read as "no change" of the terms it
  does not hold (the global value is kept for it), not as zero-padding.

Client ``c``'s rank is ``ranks[c % len(ranks)]`` (a fixed capacity per device, as in
the paper's setting; by default ``(r/4, r/2, r)``); the aggregator reads the same
``ranks``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.client.transforms import Mask, with_term
from fedloom.params import Layout, lora_default_ranks
from fedloom.registry import register

__all__ = ["HetLoRA", "check_ranks"]


def check_ranks(layout: Layout, ranks: Sequence[int] | None, field: str) -> tuple[int, ...]:
    """The clients' ranks, each a whole number from 1 to the adapters' rank (one-line
    ``ValueError`` naming ``field`` otherwise, or when the model has no LoRA pair);
    ``None``: :func:`fedloom.params.lora_default_ranks`."""
    pairs = layout.lora_pairs()
    if not pairs:
        raise ValueError(f"{field}: heterogeneous ranks need LoRA adapters with A and B "
                         "trained (model.name: hf_causal_lm, model.options.lora.r > 0, "
                         "model.options.lora.train: both)")
    top = min(p[1] for p in pairs)
    if ranks is None:
        return lora_default_ranks(top)
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks:
        raise ValueError(f"{field}: a non-empty list of ranks, got {ranks!r}")
    out = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= top:
            raise ValueError(f"{field}: each rank a whole number from 1 to the adapters' "
                             f"rank {top}, got {r!r}")
        out.append(int(r))
    return tuple(out)


class HetLoRA(LocalMethod):
    """Local training at the client's rank; see the module docstring."""

    name = "hetlora"

    def __init__(self, layout: Layout, ranks: Sequence[int] | None = None) -> None:
        self.ranks = check_ranks(layout, ranks, "client.method.options.ranks")
        top = min(p[1] for p in layout.lora_pairs())
        # one mask per distinct rank below the adapters' (a client at full rank is
        # plain local training)
        self.cut = {r: layout.lora_rank_cut(r) for r in set(self.ranks) if r < top}

    def rank(self, client: int) -> int:
        return self.ranks[client % len(self.ranks)]

    def run(self, trainer: LocalSGD, job: ClientJob) -> ClientResult:
        cut = self.cut.get(self.rank(job.client))
        if cut is None:
            return trainer.run(job)
        cut = cut.to(job.w.device)
        start = job.w.clone()
        start[cut] = 0
        keep = (~cut).to(job.w.dtype)
        for t in job.transforms:
            if isinstance(t, Mask):  # coordinates another term already holds
                keep = keep * t.mask
        job = dataclasses.replace(job, transforms=with_term(job.transforms, Mask(keep)))
        res = trainer.run(job.with_start(start))
        # w − w_k on the truncated terms is w itself (w_k holds zeros there): what the
        # client sends for them is nothing, i.e. zeros
        res.update.masked_fill_(cut, 0)  # the trainer's update is a fresh vector
        return res


@register("method", "hetlora")
def _hetlora(layout: Layout, ranks: Sequence[int] | None = None) -> HetLoRA:
    """HetLoRA: client ``c`` trains the first ``ranks[c % len(ranks)]`` terms of the
    adapters and sends them (pair it with ``aggregator.name: hetlora`` and the same
    ``ranks`` for the paper's zero-padded mean; not given: ``(r/4, r/2, r)`` of the
    adapters' rank ``r``, for both).

    Reference:
        paper: Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device
            Foundation Models", EMNLP 2024.
        code: ATP-1010/FederatedLLM, fed_utils/model_aggregation.py (checked: its
            HetLoRA baseline zero-pads each client's rank-r_k A and B to the largest
            rank and takes the sample-weighted mean; the clients' adapters are the
            global ones truncated; tests/test_hetlora.py writes that rule out).
        departures: no rank self-pruning (the paper's clients may shrink their rank
            during training) and no sparsity-weighted aggregation (the paper's weights
            by the norm of each client's product; the public baseline above weighs by
            samples, as here); a client sends zeros for the terms it does not hold, so
            an identity payload counts them in uplink_bytes (a sparse one does not).
    """
    return HetLoRA(layout, ranks)
