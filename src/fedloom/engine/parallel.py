"""The ``process`` backend: a cohort split over single-thread worker processes.

Each worker is started once per run (``spawn``, so no thread pool or lock of
the parent is inherited) with the trainer, the local method and the whole
training data; a round then ships only the jobs without their samples
(:func:`~fedloom.engine.backends.light_job`) and gets the results back. The
cohort is split into ``workers`` groups of similar work
(:func:`~fedloom.engine.backends.balanced_groups`); each worker runs its
group with the ``inner`` backend (``sequential`` or ``vmap``), so vmap's
lock-step and process parallelism compose.

Same results: a worker runs the same code on the same jobs, with the same
derived generators. Workers use one thread (``torch.set_num_threads(1)``):
float64 runs give the sequential backend's ``model_sha256``; float32 runs give
the bits of the sequential backend run at one thread, and differ from it at
two threads by exactly what the thread count changes in a matrix product's
summation order (measured on the tiny test config: 3e-8 after 3 rounds, both
ways). Both are tested.
"""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch
import torch.multiprocessing as tmp

from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.config import BackendConfig
from fedloom.engine.backends import (
    KILL_ENV,
    SequentialBackend,
    balanced_groups,
    light_job,
    maybe_die,
    with_data,
)
from fedloom.registry import register

__all__ = ["ProcessBackend", "make_inner", "run_group"]

_WORKER: dict[str, Any] = {}


def make_inner(trainer: LocalSGD, method: LocalMethod, inner: str, chunk: int = 0) -> Any:
    """The in-process backend a worker runs its share of the cohort with."""
    if inner == "vmap":
        from fedloom.engine.vmap import VmapBackend

        return VmapBackend(trainer, method, chunk=chunk or None)
    return SequentialBackend(trainer, method)


def _init_worker(trainer: LocalSGD, method: LocalMethod, x: torch.Tensor, y: torch.Tensor,
                 inner: str, chunk: int, kill_once: str | None) -> None:
    torch.set_num_threads(1)
    _WORKER.update(backend=make_inner(trainer, method, inner, chunk), x=x, y=y,
                   kill_once=kill_once)


def run_group(backend: Any, x: torch.Tensor, y: torch.Tensor,
              jobs: Sequence[ClientJob]) -> list[ClientResult | None]:
    """Train shipped jobs with ``backend`` after gathering their samples again."""
    return backend.train_cohort([with_data(j, x, y) for j in jobs])


def _train_group(blob: bytes, out: torch.Tensor, rows: list[int]) -> bytes:
    # Jobs and the small part of the results travel as plain pickles; the dense
    # updates are written into ``out``, a tensor in shared memory that the parent
    # allocated (one handle per task instead of one pickled copy per update).
    jobs = pickle.loads(blob)
    maybe_die(_WORKER.get("kill_once"), jobs)
    results = run_group(_WORKER["backend"], _WORKER["x"], _WORKER["y"], jobs)
    for row, res in zip(rows, results, strict=True):
        if res is not None and res.update.shape == out.shape[1:]:
            out[row].copy_(res.update)
            res.update = _IN_SHARED
    return pickle.dumps(results, protocol=pickle.HIGHEST_PROTOCOL)


_IN_SHARED = torch.empty(0)  # marks an update that was written to the shared buffer


class ProcessBackend:
    """``workers`` single-thread processes, each training a share of the cohort."""

    name = "process"
    ships_indices = True  # jobs carry data_index; workers hold the data

    def __init__(self, trainer: LocalSGD, method: LocalMethod, x: torch.Tensor, y: torch.Tensor,
                 workers: int = 0, inner: str = "sequential", chunk: int = 0,
                 on_failure: str = "retry", max_retries: int = 2) -> None:
        self.workers = workers or os.cpu_count() or 1
        self.inner = inner
        self.on_failure, self.max_retries = on_failure, max_retries
        self.d = trainer.layout.size
        self.dtype = next(trainer.module.parameters()).dtype
        self._out: torch.Tensor | None = None
        # Tensors sent at start-up go through shared memory (torch's reducers).
        self._initargs = (trainer, method, x, y, inner, chunk, os.environ.get(KILL_ENV))
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=tmp.get_context("spawn"),
                                   initializer=_init_worker, initargs=self._initargs)

    def train_cohort(self, jobs: Sequence[ClientJob]) -> list[ClientResult | None]:
        groups = balanced_groups(jobs, self.workers)
        if self._out is None or self._out.shape[0] < len(jobs):
            self._out = torch.empty((len(jobs), self.d), dtype=self.dtype).share_memory_()
        buf = self._out
        out: list[ClientResult | None] = [None] * len(jobs)
        pending, attempt = groups, 0
        while pending:
            futures = [self._pool.submit(_train_group, pickle.dumps(
                [light_job(jobs[i]) for i in g], protocol=pickle.HIGHEST_PROTOCOL), buf, g)
                for g in pending]
            failed = []
            for g, fut in zip(pending, futures, strict=True):
                try:
                    got = pickle.loads(fut.result())
                except BrokenProcessPool:
                    failed.append(g)  # a worker died: the whole pool is gone
                    continue
                for i, res in zip(g, got, strict=True):
                    if res is not None and res.update.numel() == 0 and self.d > 0:
                        res.update = buf[i].clone()  # the buffer is reused next round
                    out[i] = res
            if not failed:
                break
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
            attempt += 1
            if self.on_failure == "drop" or attempt > self.max_retries:
                if self.on_failure == "retry":
                    raise RuntimeError(f"backend: a worker process died; {self.max_retries} "
                                       "retries exhausted")
                break  # the failed groups' clients stay None: dropped for the round
            pending = failed
        return out

    def warm_up(self) -> None:
        """Start every worker now (spawn, imports, the data), not inside a timed round."""
        list(self._pool.map(time.sleep, [0.05] * self.workers))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __del__(self) -> None:  # pragma: no cover (interpreter shutdown order varies)
        try:
            self._pool.shutdown(wait=False, cancel_futures=True)
        except Exception:
            pass


@register("backend", "process")
def _process(trainer: LocalSGD, method: LocalMethod, cfg: BackendConfig,
             x: torch.Tensor, y: torch.Tensor) -> ProcessBackend:
    return ProcessBackend(trainer, method, x, y, workers=cfg.workers, inner=cfg.inner,
                          chunk=cfg.chunk, on_failure=cfg.on_failure,
                          max_retries=cfg.max_retries)
