"""``backend: auto``: lock-step where it applies on CPU; otherwise time the first cohort on
every backend that applies and keep the fastest.

**The lock-step rule.** On a CPU run whose first cohort has at least
:data:`LOCKSTEP_MIN_COHORT` clients and that the ``lockstep`` backend trains
itself (a supported chain, plain SGD/FedProx, the jobs and sample shapes it
takes: :func:`lockstep_reason`), ``auto`` uses ``lockstep`` without timing
anything: it gives ``sequential``'s results (bit for bit in float64) and was
faster from two clients on wherever it was measured, while timing a first
cohort measures its cold start as much as the backends (see
:class:`fedloom.config.BackendConfig`). Measured (local training of the first
m clients, lockstep and sequential interleaved, medians of 5, one thread, the
2-core machine shared with other jobs at load 13–15): the reference MLP
(784-200-10, 600 samples, batch 32) 1.07× sequential at m = 1, 1.14× at 2,
1.26–1.31× at 3–4, 1.40× at 8; the CNN of ``benchmarks/lockstep_cnn.py``
(``cnn`` 8/16 channels, 3×32×32, 50 images, batch 10) 0.91× at m = 1,
1.02–1.14× at 2–8 — a CNN's step is its convolutions, which lock-step runs
client by client as sequential does. Hence :data:`LOCKSTEP_MIN_COHORT` = 2.
Not measured against ``process`` (whose workers split the cores): the rule
prefers lockstep's in-process, bit-identical results there. Where the rule does not apply, one line
in the log says why and the timing below decides.

Candidates: ``sequential``; ``vmap`` where it applies (plain local SGD, no
recurrent layers); ``lockstep`` where it applies (plain local SGD on a chain of
Linear/Conv2d/pooling/GroupNorm/ReLU/Dropout/Flatten layers,
:mod:`fedloom.engine.lockstep`); ``process`` with
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
