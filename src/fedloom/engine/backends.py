"""Backends train a cohort; every backend gives the same results.

A backend receives fully specified :class:`~fedloom.client.ClientJob` objects
(start model, learning rate, data, generator seed) and returns one
:class:`~fedloom.client.ClientResult` per job, in job order. Since every
random stream is derived from ``(seed, round, client, purpose)``, the order in
which a backend runs the jobs cannot change the results.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.registry import register

__all__ = ["Backend", "SequentialBackend"]


class Backend(Protocol):
    name: str

    def train_cohort(self, jobs: Sequence[ClientJob]) -> list[ClientResult]: ...


class SequentialBackend:
    """Clients one after another in this process."""

    name = "sequential"

    def __init__(self, trainer: LocalSGD, method: LocalMethod) -> None:
        self.trainer = trainer
        self.method = method

    def train_cohort(self, jobs: Sequence[ClientJob]) -> list[ClientResult]:
        return [self.method.run(self.trainer, job) for job in jobs]


@register("backend", "sequential")
def _sequential(trainer: LocalSGD, method: LocalMethod) -> SequentialBackend:
    return SequentialBackend(trainer, method)
