"""``backend: auto``: time the first cohort on every backend that applies, keep the fastest.

Candidates: ``sequential``; ``vmap`` where it applies (plain local SGD, no
recurrent layers); ``lockstep`` where it applies (plain local SGD on a chain of
Linear/ReLU/Flatten layers, :mod:`fedloom.engine.lockstep`); ``process`` with
``backend.workers`` workers (default: the cores; on a CUDA run, the GPUs) where
there is more than one and the cohort has at least two clients per worker. The
first cohort's results come from the sequential backend; the other runs of the
same jobs only measure (every backend gives the same results, see their
tests). The process pool is started before it is timed and shut down when it
is not chosen. The choice and the times are logged and the choice is kept in
:attr:`AutoBackend.name`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.config import BackendConfig
from fedloom.engine.backends import SequentialBackend
from fedloom.engine.lockstep import LockstepBackend
from fedloom.engine.vmap import VmapBackend
from fedloom.registry import register

__all__ = ["AutoBackend"]


class AutoBackend:
    """See the module docstring."""

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
        if self.workers > 1 and len(jobs) >= 2 * self.workers and self.x is not None:
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
        logging.getLogger("fedloom").info(
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
