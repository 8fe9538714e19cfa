"""The ``ray`` backend: a cohort's training spread over Ray workers.

``ray.init()`` starts a local instance unless ``backend.options.address`` names a cluster
(or Ray is already initialised). The data, trainer and local method go to the
object store once per run; a round submits one task per group of clients
carrying only the jobs, and the server step stays on the driver. A task whose
worker dies is re-run with the same jobs and seeds (``on_failure: retry``) or its
clients dropped (``drop``); a half-finished update never reaches the server. A
task reserves ``backend.threads`` CPUs and ``backend.options.gpus_per_worker`` GPUs.
Failures, resources and fault injection in detail: docs/deploy.md (The Ray
backend in detail).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
import torch

from fedloom.capabilities import BackendCaps
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.config import ConfigError
from fedloom.device import configure, keep_freed_heap, to_device, to_host, worker_threads
from fedloom.engine.trainers.backends import (
    ResultSink,
    balanced_groups,
    hand_over,
    kill_spec,
    light_job,
    maybe_die,
)
from fedloom.registry import Range, register

__all__ = ["RayBackend"]

def _train_group(setup: dict[str, Any], x_np: np.ndarray, y_np: np.ndarray,
                 jobs: list[ClientJob], side: Any = None
                 ) -> tuple[list[ClientResult | None], list[Any] | None]:
    """Train ``jobs``; with ``side`` (a :class:`~fedloom.engine.stages.uplink.ClientSide`),
    also each client's own part of the uplink, where its update is: its norm and,
    with a pure compressor, its payload."""
    import warnings

    from fedloom.engine.trainers.parallel import make_inner, run_group

    worker_threads(setup.get("threads", 0))
    if setup.get("keep_heap", True):  # the task's steps reuse the heap (once a process)
        keep_freed_heap()
    maybe_die(setup.get("kill_once"), jobs)
    with warnings.catch_warnings():
        # The arrays are read-only views of Ray's shared object store (no copy);
        # batches are gathered from them, never written.
        warnings.simplefilter("ignore", UserWarning)
        x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)
    trainer = setup["trainer"]
    if setup.get("gpus", 0) > 0 and torch.cuda.is_available():
        # Ray made the task's GPU the only visible one: cuda:0 here.
        dev = torch.device("cuda", 0)
        configure(dev)
        trainer = dataclasses.replace(trainer, module=trainer.module.to(dev))
        x, y, jobs = x.to(dev), y.to(dev), to_device(jobs, dev)
    backend = make_inner(trainer, setup["method"], setup["inner"], setup["chunk"], x, y)
    results = to_host(run_group(backend, x, y, jobs))
    sents = ([side(res.update, res.client) if res is not None else None for res in results]
             if side is not None else None)
    return results, sents


def _check_address(address: str) -> str:
    """The host of ``backend.options.address`` ("" for a local instance, "auto" as is),
    after checking that something listens there (Ray itself retries for minutes)."""
    if address in ("", "auto"):
        return address
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(f"backend.options.address: expected HOST:PORT, ray://HOST:PORT or auto, "
                          f"got {address!r}")
    import socket

    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ConfigError(f"backend.options.address: cannot reach the Ray cluster at {hostport} "
                          f"({e.strerror or e})") from None
    return host


@dataclasses.dataclass(frozen=True)
class RayOptions:
    """The ray backend's options (its factory's) and the run's threads and keep_heap."""

    workers: int = 0
    inner: str = "sequential"
    chunk: int = 0
    address: str = ""
    on_failure: str = "retry"
    max_retries: int = 2
    threads: int = 1
    gpus_per_worker: float = 0.0
    keep_heap: bool = True


class RayBackend:
    """Client training in Ray tasks; see the module docstring."""

    name = "ray"

    def __init__(self, trainer: LocalSGD, method: LocalMethod, x: torch.Tensor, y: torch.Tensor,
                 cfg: RayOptions) -> None:
        host = _check_address(cfg.address)
        kill_once = kill_spec()  # checked before a cluster is started
        if host in ("", "127.0.0.1", "localhost", "::1") and "ray" not in sys.modules:
            # A local instance (or one on loopback) stays on loopback: Ray otherwise
            # advertises the machine's first non-loopback address. Read at import.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        try:
            import ray
        except ImportError:
            raise ConfigError("backend.name: 'ray' needs Ray: pip install 'fedloom[ray]'") from None
        self.ray = ray
        self.started = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if cfg.address:
                kwargs["address"] = cfg.address
            else:
                kwargs["num_cpus"] = cfg.workers or os.cpu_count() or 1
            try:
                ray.init(**kwargs)
            except ConnectionError as e:
                raise ConfigError(f"backend.options.address: cannot join the Ray cluster at "
                                  f"{cfg.address!r}: {str(e).splitlines()[0]}") from None
            self.started = True
        resources = ray.cluster_resources()
        self.workers = cfg.workers or max(1, int(resources.get("CPU", 1)))
        retries = cfg.max_retries if cfg.on_failure == "retry" else 0
        self.on_failure = cfg.on_failure
        self.worker_threads = cfg.threads or 1
        gpus = self.gpus = cfg.gpus_per_worker
        if gpus > resources.get("GPU", 0):
            self.close()
            raise ConfigError(f"backend.options.gpus_per_worker: {gpus:g} asked for, the Ray "
                              f"cluster has {resources.get('GPU', 0):g} GPUs")
        if self.worker_threads > resources.get("CPU", 0):
            self.close()
            raise ConfigError(f"backend.threads: {self.worker_threads} CPUs a task, the Ray "
                              f"cluster has {resources.get('CPU', 0):g}")
        if x.device.type != "cpu":  # workers get host tensors and move them themselves
            trainer = dataclasses.replace(trainer, module=copy.deepcopy(trainer.module).cpu())
        # Put once: every task refers to these objects instead of carrying them.
        self._setup = ray.put({"trainer": trainer, "method": method, "inner": cfg.inner,
                               "chunk": cfg.chunk, "kill_once": kill_once,
                               "threads": cfg.threads, "gpus": gpus,
                               "keep_heap": cfg.keep_heap})
        # NumPy arrays: a task reads them from the shared object store without a copy
        # (a pickled tensor would be copied into every task).
        self._x = ray.put(x.cpu().numpy())
        self._y = ray.put(y.cpu().numpy())
        self._task = ray.remote(num_cpus=self.worker_threads, num_gpus=gpus,
                                max_retries=retries, retry_exceptions=False)(_train_group)

    @property
    def capabilities(self) -> BackendCaps:
        """Jobs carry ``data_index`` (the tasks read the data from the object store);
        :meth:`train_cohort` hands each group's results to ``on_result`` as its task
        returns (``streams``: in the order the tasks finish), with what the task did
        of each client's uplink (:class:`~fedloom.engine.stages.uplink.ClientSide`)."""
        return BackendCaps(ships_indices=True, streams=True,
                           worker_threads=self.worker_threads)

    def train_cohort(self, jobs: Sequence[ClientJob], on_result: ResultSink | None = None
                     ) -> list[ClientResult | None]:
        """Train ``jobs``; with ``on_result``, each group's results are also passed to
        ``on_result(position, result[, sent])`` as its task returns, and the tasks do
        each client's own part of the uplink (``on_result.client_side``, on the host).
        The returned list is what counts (a dropped group's clients are ``None``)."""
        ray = self.ray
        groups = balanced_groups(jobs, self.workers)
        side = on_result.client_side if on_result is not None and not self.gpus else None
        refs = [self._task.remote(self._setup, self._x, self._y,
                                  [to_host(light_job(jobs[i])) for i in g], side)
                for g in groups]
        group_of = dict(zip(refs, groups, strict=True))
        out: list[ClientResult | None] = [None] * len(jobs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            g = group_of[done[0]]
            try:
                results, sents = ray.get(done[0])
            except (ray.exceptions.WorkerCrashedError, ray.exceptions.RayTaskError,
                    ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError) as e:
                if self.on_failure == "retry":
                    raise RuntimeError(f"backend: a Ray task failed after "
                                       f"{type(e).__name__}; retries exhausted") from e
                continue  # its clients are dropped for this round
            for n, (i, res) in enumerate(zip(g, results, strict=True)):
                out[i] = res
                hand_over(on_result, i, res, sents[n] if sents is not None else None)
        return out

    def close(self) -> None:
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()


@register("backend", "ray")
def _ray(trainer: LocalSGD, method: LocalMethod, x: torch.Tensor, y: torch.Tensor, *,
         threads: int = 1, keep_heap: bool = True, workers: Annotated[int, Range(ge=0)] = 0,
         inner: Literal["sequential", "vmap", "lockstep"] = "sequential",
         chunk: Annotated[int, Range(ge=0)] = 0, address: str = "",
         on_failure: Literal["retry", "drop"] = "retry",
         max_retries: Annotated[int, Range(ge=0)] = 2,
         gpus_per_worker: Annotated[float, Range(ge=0)] = 0.0) -> RayBackend:
    """Ray tasks (``address`` joins a cluster; empty starts a local one with ``workers``
    CPUs, 0: every core), each running ``inner`` (``chunk``: clients per chunk) and
    reserving ``gpus_per_worker`` GPUs; ``on_failure``, ``max_retries`` as process's."""
    return RayBackend(trainer, method, x, y, RayOptions(
        workers=workers, inner=inner, chunk=chunk, address=address, on_failure=on_failure,
        max_retries=max_retries, threads=threads, gpus_per_worker=gpus_per_worker,
        keep_heap=keep_heap))
