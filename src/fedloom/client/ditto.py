"""Ditto: fair and robust federated learning through personalization.

Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through
Personalization" (ICML 2021), Algorithm 1. Each sampled client

1. trains the global model as usual (its update goes to any aggregator,
   CRAFT included: the CRAFT paper's "CRAFT inside Ditto");
2. trains its personal model ``v_k`` from where it left it, on
   ``F_k(v) + (λ/2)‖v − w‖²`` (gradient ``∇F_k(v_k) + λ(v_k − w)``), with the
   same local settings (steps, batch size, lr).

``v_k`` lives in the per-client store (field ``personal``, with a one-entry
flag field ``personal_set``); a client's personal model starts as the global
model it first receives. Clients are evaluated on their personal models
(``personal_acc_*`` metrics; a client never sampled is evaluated on ``w``).
The personal batches come from their own derived stream.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.registry import register
from fedloom.rng import derive_seed
from fedloom.state import FieldSpec

__all__ = ["Ditto"]


class Ditto(LocalMethod):
    name = "ditto"
    personal = True

    def __init__(self, lam: float = 1.0) -> None:
        if lam < 0:
            raise ValueError(f"client.method.options.lam: must be >= 0, got {lam}")
        self.lam = lam

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {"personal": FieldSpec(d), "personal_set": FieldSpec(1)}

    def personal_models(self, rows: Mapping[str, torch.Tensor], w: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        return rows["personal"], rows["personal_set"][:, 0] > 0

    def run(self, trainer: LocalSGD, job: ClientJob) -> ClientResult:
        res = trainer.run(job)
        started = bool(job.state["personal_set"][0] > 0)
        v0 = job.state["personal"] if started else job.w
        gen = torch.Generator()
        gen.manual_seed(derive_seed(job.gen_seed, job.round, job.client, "ditto-personal"))
        # From the round's buffers too; those the personal pass ends with are not
        # kept (clients are evaluated with the global or, model.buffers=local, their own).
        v, loss, _ = trainer.descend(v0, job.w, job.x, job.y, job.lr, gen, prox_mu=self.lam,
                                     buffers=job.buffers)
        res.state = {"personal": v.to(job.w.dtype), "personal_set": torch.ones(1, dtype=v.dtype)}
        res.extra["personal_loss"] = loss
        return res


@register("method", "ditto")
def _ditto(lam: float = 1.0) -> Ditto:
    """Ditto: each client also trains a personal model on ``F_k(v) + (λ/2)‖v − w‖²`` (``lam`` = λ).

    Reference:
        paper: Li, Hu, Beirami & Smith, "Ditto: Fair and Robust Federated Learning Through
            Personalization", ICML 2021, Algorithm 1.
        code: none checked.
        departures: the personal model starts as the first global model the client receives and
            trains with the same local settings as the global pass.
    """
    return Ditto(lam=lam)
