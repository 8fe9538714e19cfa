"""Local methods: how a client trains and what state it keeps across rounds.

A method holds settings; its state lives in the per-client store (``fields``,
one ``[N, size]`` buffer each) and in a small server-side dict. Each round the
engine gathers the cohort's rows into ``job.state``, calls :meth:`prepare`
(server side, cheap), runs :meth:`run` in the backend, scatters the returned
rows of the **accepted** clients back, and calls :meth:`server_update`. A
client that is not sampled, or whose update was rejected, keeps its rows.

``sgd`` is plain local SGD (FedAvg's and FedProx's local solver); SCAFFOLD and
Ditto live in their own files.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedloom.capabilities import MethodCaps
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.registry import register
from fedloom.state import FieldSpec

__all__ = ["LocalMethod"]


class LocalMethod:
    """Plain local SGD, and the base of the other methods.

    ``capabilities``: a :class:`~fedloom.capabilities.MethodCaps`, read from the
    method's factory as well (before the run is built: ``model_buffers``, the buffer
    policy a method is, sets ``model.buffers``); :meth:`check_trainer` refuses trainer
    settings the method cannot run with when the run is built.
    """

    name = "sgd"
    personal = False  # True when clients keep personal models to evaluate
    capabilities = MethodCaps()

    def check_trainer(self, trainer: LocalSGD) -> None:
        """Raise a one-line ``ValueError`` on trainer settings this method cannot run
        with (APFL's and MOON's); called once, when the run is built. By default,
        every setting is fine."""
        return None

    def fields(self, d: int) -> dict[str, FieldSpec]:
        return {}

    def init_server(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}

    def personal_models(self, rows: Mapping[str, torch.Tensor], w: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """From this method's rows of some clients (its own field names, ``[n, ...]``
        each) and the global model ``w``: their personal models ``[n, d]`` and which
        of them have one yet (``[n]`` bool). ``None``: the method keeps no personal
        model (``personal`` is False). A client without one is reported apart
        (``unsampled_acc_*``, the global model's accuracy on it)."""
        return None

    def adjust_model(self, w: torch.Tensor, server: Mapping[str, torch.Tensor]
                     ) -> torch.Tensor:
        """The global model after an applied server step and :meth:`server_update`
        (FedDyn's ``− h/α``); by default ``w`` itself."""
        return w

    def prepare(self, job: ClientJob, server: Mapping[str, torch.Tensor]) -> ClientJob:
        return job

    def run(self, trainer: LocalSGD, job: ClientJob) -> ClientResult:
        return self.complete(trainer, job, trainer.run(job))

    def complete(self, trainer: LocalSGD, job: ClientJob, res: ClientResult) -> ClientResult:
        """The method's work after its local steps (the new state rows from the
        update): a batched trainer that ran the job's steps (``capabilities.batched``)
        calls it on the result; by default the result as it is."""
        return res

    def server_update(
        self,
        server: dict[str, torch.Tensor],
        old: Mapping[str, torch.Tensor],
        new: Mapping[str, torch.Tensor],
        num_clients: int,
    ) -> dict[str, torch.Tensor]:
        """``old``/``new``: the accepted clients' rows before and after the round."""
        return server


@register("method", "sgd")
def _sgd() -> LocalMethod:
    """Local SGD (FedAvg's local solver; FedProx with ``client.prox_mu``).

    Reference:
        paper: McMahan et al., AISTATS 2017 (FedAvg); Li et al., "Federated Optimization in
            Heterogeneous Networks", MLSys 2020 (FedProx).
        code: none needed.
        departures: none.
    """
    return LocalMethod()
