"""FedPer: a shared body, a personal head (Arivazhagan et al. 2019).

Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with
Personalization Layers" (arXiv 1912.00818, 2019). Each client keeps its own
head ``h_k`` (the layer groups ``personal``, by default the last one:
:mod:`fedloom.client.layers`) and shares the body ``b``. A sampled client

1. starts local training from ``(b, h_k)`` — the received body with its own
   head (the received head, the server's, while it has none yet);
2. trains every parameter with the client's settings (FedPer's local step);
3. keeps the trained head as ``h_k`` and sends the body's update only: the
   head coordinates of ``g_k = w − w_k`` are sent as zeros, so the server's
   head never moves and any aggregator (CRAFT included), compressor and
   feedback policy sees a zero head group (CRAFT solves that group to zero).

Personal model for evaluation: the global body with the client's head
(``personal_acc_*``); a client never sampled has no head and is reported with
the global model (``unsampled_acc_*``). LG-FedAvg (:mod:`fedloom.client.lg_fedavg`)
is the same method with ``personal`` naming the body's groups.

Checked against FL-bench's FedPer (KarhouTam/FL-bench, src/client/fedper.py) with
the rule written out with ``torch.optim.SGD`` in tests/test_personalised.py: the same
body and head, max difference 6.9e-18. The check in full: docs/explanation/methods.md
(FedPer in detail).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedloom.client.layers import head_groups, head_mask
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.params import Layout
from fedloom.registry import register
from fedloom.state import FieldSpec

__all__ = ["FedPer", "PersonalHead"]


class PersonalHead(LocalMethod):
    """The body/head bookkeeping FedPer, FedRep and LG-FedAvg share."""

    personal = True

    def __init__(self, layout: Layout, personal: Sequence[str] | None = None) -> None:
        self.layout = layout
        self.groups = head_groups(layout, personal, "client.method.options.personal")
        self.mask = head_mask(layout, self.groups)
        self.index = self.mask.nonzero().squeeze(1)

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {"head": FieldSpec(int(self.index.numel())), "head_set": FieldSpec(1)}

    def start(self, job: ClientJob) -> torch.Tensor:
        """``(b, h_k)``: the received model with the client's head, once it has one."""
        if not bool(job.state["head_set"][0] > 0):
            return job.w
        x0 = job.w.clone()
        x0[self.index.to(x0.device)] = job.state["head"].to(x0.dtype)
        return x0

    def finish(self, job: ClientJob, res: ClientResult, w_k: torch.Tensor) -> ClientResult:
        """Keep the trained head, send the body's update only."""
        idx = self.index.to(res.update.device)
        res.update = res.update.clone()
        res.update[idx] = 0
        res.state = {"head": w_k[idx.to(w_k.device)].clone(),
                     "head_set": torch.ones(1, dtype=w_k.dtype)}
        return res

    def personal_models(self, rows: Mapping[str, torch.Tensor], w: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        have = rows["head_set"][:, 0] > 0
        models = w.unsqueeze(0).repeat(have.shape[0], 1)
        idx = self.index.to(w.device)
        heads = rows["head"].to(w.device, w.dtype)
        models[:, idx] = torch.where(have.to(w.device).unsqueeze(1), heads, models[:, idx])
        return models, have


class FedPer(PersonalHead):
    name = "fedper"

    def run(self, trainer: LocalSGD, job: ClientJob) -> ClientResult:
        res = trainer.run(job.with_start(self.start(job)))
        return self.finish(job, res, job.w - res.update)


@register("method", "fedper")
def _fedper(layout: Layout, personal: Sequence[str] | None = None) -> FedPer:
    """FedPer: the layer groups ``personal`` (default: the last) stay on the client.

    Reference:
        paper: Arivazhagan et al., "Federated Learning with Personalization Layers",
            arXiv 1912.00818, 2019.
        code: KarhouTam/FL-bench, src/client/fedper.py (checked: one round, max
            difference 6.9e-18 in float64, tests/test_personalised.py).
        departures: the server's head is the initial one for ever (the head's update is
            sent as zeros rather than left out, so every aggregator and compressor applies).
    """
    return FedPer(layout, personal)
