"""``backend: auto``: time the first cohort on every backend that applies, keep the fastest.

The candidates, in this order (which also breaks a tie): ``sequential``;
``lockstep`` where it trains the run itself (:func:`lockstep_reason`);
``vmap`` on a GPU, where it applies (on a CPU it was never the fastest: section 1
of the benchmarks); ``process`` and ``process+lockstep`` (``backend.options.workers``
workers, default one per core or GPU, each running ``sequential`` or
``lockstep`` on its share) where there are at least two workers and two clients
per worker. Each candidate first trains the cohort's first client alone (its
one-time set-up: a worker's first job, lock-step's buffers; a process pool is
started before that), then the whole first cohort, timed; the choice is
:func:`choose` of those times, logged with the table, and kept in
:attr:`AutoBackend.name`. The first cohort's results are ``sequential``'s (every
backend gives them: bit for bit in float64, to float32 rounding otherwise), so
what a run computes does not depend on which backend won. The pools not chosen
are shut down; from the second round on, the chosen backend runs as it does when
named (a chosen ``process`` backend hands each result over as it arrives, for the
uplink work and the rows written in place). Why measure rather than rule:
lock-step was taken without timing until ``process+lockstep`` measured 11–23 %
faster on two idle cores (docs/explanation/backends.md, auto).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Protocol

import torch

from fedloom.capabilities import BackendCaps, backend_caps
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.engine.trainers.backends import Backend, ResultSink, SequentialBackend
from fedloom.engine.trainers.lockstep import LockstepBackend, job_reason, shape_reason
from fedloom.engine.trainers.vmap import VmapBackend
from fedloom.registry import Range, register

__all__ = ["CANDIDATES", "AutoBackend", "choose", "lockstep_reason"]

# Every backend auto may time, in the order it times them and breaks ties.
CANDIDATES = ("sequential", "lockstep", "vmap", "process", "process+lockstep")

log = logging.getLogger("fedloom")


class Candidate(Backend, Protocol):
    """A backend auto may time (each is a built-in): the protocol's members, and
    ``warm_up()``, which starts what it would start on first use (a pool's workers)."""

    def warm_up(self) -> None: ...


# (backend, jobs) -> (its results, seconds): how a candidate is timed (a test injects one)
Measure = Callable[[Candidate, Sequence[ClientJob]], "tuple[list[ClientResult | None], float]"]


def lockstep_reason(ls: LockstepBackend, jobs: Sequence[ClientJob]) -> str | None:
    """Why ``lockstep`` is not a candidate for a run whose first cohort is ``jobs``
    (None: it is)."""
    if ls.reason is not None:
        return ls.reason
    if not jobs:
        return "an empty cohort"
    assert ls.plan is not None
    return job_reason(jobs) or shape_reason(ls.plan, tuple(jobs[0].x.shape[1:]))


def choose(times: Mapping[str, float]) -> str:
    """The fastest of the timed candidates; of equal times, the first in
    :data:`CANDIDATES` (so the same times always give the same choice)."""
    if not times:
        raise ValueError("backend auto: no candidate was timed")
    rank = {name: i for i, name in enumerate(CANDIDATES)}
    return min(times, key=lambda n: (times[n], rank.get(n, len(rank)), n))


def timed(backend: Candidate, jobs: Sequence[ClientJob]
          ) -> tuple[list[ClientResult | None], float]:
    """The default :data:`Measure`: start a pool's workers and train the first job
    alone (set-up, untimed), then the whole cohort, timed."""
    backend.warm_up()
    backend.train_cohort(list(jobs[:1]))
    t = time.perf_counter()
    out = backend.train_cohort(jobs)
    return out, time.perf_counter() - t


class AutoBackend:
    """See the module docstring."""

    def __init__(self, trainer: LocalSGD, method: LocalMethod, x: torch.Tensor | None = None,
                 y: torch.Tensor | None = None, workers: int = 0,
                 measure: Measure | None = None, keep_heap: bool = True) -> None:
        self.trainer, self.method, self.x, self.y = trainer, method, x, y
        self.keep_heap = keep_heap
        # On CUDA the process candidates have one worker per GPU (one GPU: not tried).
        gpus = torch.cuda.device_count() if x is not None and x.device.type == "cuda" else 0
        self.workers = workers or gpus or os.cpu_count() or 1
        self.seq = SequentialBackend(trainer, method)
        self.vmap = VmapBackend(trainer, method, x=x, y=y)
        self.lockstep = LockstepBackend(trainer, method, x=x, y=y)
        self.measure: Measure = measure or timed
        self.chosen: Candidate | None = None
        self.name = "auto"
        self.times: dict[str, float] = {}

    def candidates(self, jobs: Sequence[ClientJob]) -> dict[str, Callable[[], Candidate]]:
        """The candidates that apply to a first cohort ``jobs``, in :data:`CANDIDATES`
        order, each as a function that builds it (a process pool starts on first use)."""
        p = next(self.trainer.module.parameters(), None)
        device = p.device if p is not None else torch.device("cpu")
        out: dict[str, Callable[[], Candidate]] = {"sequential": lambda: self.seq}
        why = lockstep_reason(self.lockstep, jobs)
        if why is None:
            out["lockstep"] = lambda: self.lockstep
        else:
            log.info("backend auto: lockstep not a candidate (%s)", why)
        if device.type == "cuda" and self.vmap.enabled:
            out["vmap"] = lambda: self.vmap
        if (self.workers > 1 and len(jobs) >= 2 * self.workers and self.x is not None
                and self.y is not None):  # x and y are set together
            from fedloom.engine.trainers.parallel import ProcessBackend

            x, y = self.x, self.y
            out["process"] = lambda: ProcessBackend(self.trainer, self.method, x, y,
                                                    workers=self.workers,
                                                    keep_heap=self.keep_heap)
            if why is None:
                out["process+lockstep"] = lambda: ProcessBackend(
                    self.trainer, self.method, x, y, workers=self.workers, inner="lockstep",
                    keep_heap=self.keep_heap)
        return out

    @property
    def capabilities(self) -> BackendCaps:
        """The chosen backend's streaming, rows and worker threads (none before the
        choice: the first cohort's results are the sequential run's). Jobs carry
        their samples: the in-process candidates train on them, and a chosen process
        backend drops them before shipping a job."""
        if self.chosen is None:
            return BackendCaps()
        return dataclasses.replace(backend_caps(self.chosen), ships_indices=False)

    def train_cohort(self, jobs: Sequence[ClientJob],
                     on_result: ResultSink | None = None) -> list[ClientResult | None]:
        if self.chosen is not None:
            if on_result is not None and self.capabilities.streams:
                # a backend that streams takes on_result (sequential, process)
                return self.chosen.train_cohort(jobs, on_result=on_result)  # type: ignore[call-arg]
            return self.chosen.train_cohort(jobs)
        built: dict[str, Candidate] = {}
        out: list[ClientResult | None] = []
        for name, make in self.candidates(jobs).items():
            built[name] = make()
            res, self.times[name] = self.measure(built[name], jobs)
            if name == "sequential":
                out = res  # the first cohort's results, whichever backend wins
        self.name = choose(self.times)
        self.chosen = built[self.name]
        for name, b in built.items():
            if name != self.name:
                b.close()
        best = self.times[self.name]
        log.info("backend auto: the first cohort (%d clients) on each candidate:\n%s",
                 len(jobs), "\n".join(
                     f"  {k:<17} {v:8.3f} s  {v / best:5.2f}×"
                     f"{'  <- chosen' if k == self.name else ''}"
                     for k, v in self.times.items()))
        log.info("backend auto: using %s", self.name)
        return out

    def close(self) -> None:
        if self.chosen is not None:
            self.chosen.close()


@register("backend", "auto")
def _auto(trainer: LocalSGD, method: LocalMethod, x: torch.Tensor | None = None,
          y: torch.Tensor | None = None, *, threads: int = 1, keep_heap: bool = True,
          workers: Annotated[int, Range(ge=0)] = 0) -> AutoBackend:
    """``workers``: the process candidates' workers (0: one per core or GPU)."""
    return AutoBackend(trainer, method, x, y, workers=workers, keep_heap=keep_heap)
