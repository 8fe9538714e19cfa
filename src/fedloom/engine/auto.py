"""``backend: auto``: lock-step where it applies on CPU; otherwise time the first cohort on
every backend that applies and keep the fastest.

On a CPU run whose first cohort has at least :data:`LOCKSTEP_MIN_COHORT` (2)
clients and that ``lockstep`` trains itself (:func:`lockstep_reason`), ``auto``
uses ``lockstep`` without timing anything: it gives ``sequential``'s results and
was faster from two clients on wherever it was measured. Otherwise one log line
says why, and the first cohort is timed on ``sequential``, ``vmap``, ``lockstep``
and ``process`` where each applies (its results come from ``sequential``); the
choice is logged and kept in :attr:`AutoBackend.name`. The rule's measurements
and the candidates in detail: docs/explanation/backends.md (auto).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from fedloom.capabilities import BackendCaps
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.config import BackendConfig
from fedloom.engine.backends import SequentialBackend
from fedloom.engine.lockstep import LockstepBackend, job_reason, shape_reason
from fedloom.engine.vmap import VmapBackend
from fedloom.registry import register

__all__ = ["LOCKSTEP_MIN_COHORT", "AutoBackend", "lockstep_reason"]

# The smallest first cohort the rule sends to lockstep (see the module docstring).
LOCKSTEP_MIN_COHORT = 2

log = logging.getLogger("fedloom")


def lockstep_reason(ls: LockstepBackend, jobs: Sequence[ClientJob],
                    device: torch.device) -> str | None:
    """Why the lock-step rule does not pick ``lockstep`` for a run whose first cohort is
    ``jobs`` on ``device`` (None: it does)."""
    if device.type != "cpu":
        return f"the run is on {device.type}, the rule is measured on CPU"
    if ls.reason is not None:
        return ls.reason
    if len(jobs) < LOCKSTEP_MIN_COHORT:
        return f"a cohort of {len(jobs)} < {LOCKSTEP_MIN_COHORT} clients"
    assert ls.plan is not None
    return job_reason(jobs) or shape_reason(ls.plan, tuple(jobs[0].x.shape[1:]))


class AutoBackend:
    """See the module docstring."""

    # Its in-process candidates train on the samples each job carries (a chosen process
    # backend drops them before shipping a job).
    capabilities = BackendCaps()

    def __init__(self, trainer: LocalSGD, method: LocalMethod, x: torch.Tensor | None = None,
                 y: torch.Tensor | None = None, workers: int = 0) -> None:
        self.trainer, self.method, self.x, self.y = trainer, method, x, y
        # On CUDA the process candidate has one worker per GPU (one GPU: not tried).
        gpus = torch.cuda.device_count() if x is not None and x.device.type == "cuda" else 0
        self.workers = workers or gpus or os.cpu_count() or 1
        self.seq = SequentialBackend(trainer, method)
        self.vmap = VmapBackend(trainer, method, x=x, y=y)
        self.lockstep = LockstepBackend(trainer, method, x=x, y=y)
        self.chosen: Any = None
        self.name = "auto"
        self.times: dict[str, float] = {}

    def train_cohort(self, jobs: Sequence[ClientJob]) -> list[ClientResult | None]:
        if self.chosen is not None:
            return self.chosen.train_cohort(jobs)
        p = next(self.trainer.module.parameters(), None)
        why = lockstep_reason(self.lockstep, jobs,
                              p.device if p is not None else torch.device("cpu"))
        if why is None:
            self.name, self.chosen = "lockstep", self.lockstep
            log.info("backend auto: using lockstep (CPU, a supported model, a cohort of "
                     "%d >= %d clients)", len(jobs), LOCKSTEP_MIN_COHORT)
            return self.lockstep.train_cohort(jobs)
        log.info("backend auto: not lockstep (%s); timing the first cohort", why)
        t = time.perf_counter()
        out = self.seq.train_cohort(jobs)
        self.times["sequential"] = time.perf_counter() - t
        backends: dict[str, Any] = {"sequential": self.seq}
        if self.vmap.enabled:
            t = time.perf_counter()
            self.vmap.train_cohort(jobs)
            self.times["vmap"] = time.perf_counter() - t
            backends["vmap"] = self.vmap
        if self.lockstep.enabled:
            t = time.perf_counter()
            self.lockstep.train_cohort(jobs)
            self.times["lockstep"] = time.perf_counter() - t
            backends["lockstep"] = self.lockstep
        if (self.workers > 1 and len(jobs) >= 2 * self.workers and self.x is not None
                and self.y is not None):  # x and y are set together
            from fedloom.engine.parallel import ProcessBackend

            proc = ProcessBackend(self.trainer, self.method, self.x, self.y,
                                  workers=self.workers)
            proc.warm_up()
            t = time.perf_counter()
            proc.train_cohort(jobs)
            self.times["process"] = time.perf_counter() - t
            backends["process"] = proc
        self.name = min(self.times, key=self.times.__getitem__)
        self.chosen = backends[self.name]
        for name, b in backends.items():
            if name != self.name and hasattr(b, "close"):
                b.close()
        log.info(
            "backend auto: using %s (first cohort: %s)", self.name,
            ", ".join(f"{k} {v:.3f} s" for k, v in self.times.items()))
        return out

    def close(self) -> None:
        if self.chosen is not None and hasattr(self.chosen, "close"):
            self.chosen.close()


@register("backend", "auto")
def _auto(trainer: LocalSGD, method: LocalMethod, cfg: BackendConfig | None = None,
          x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> AutoBackend:
    return AutoBackend(trainer, method, x, y, workers=cfg.workers if cfg is not None else 0)
