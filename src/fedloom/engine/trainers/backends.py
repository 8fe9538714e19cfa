"""Backends train a cohort; every backend gives the same results.

A backend receives fully specified :class:`~fedloom.client.ClientJob` objects
(start model, learning rate, data, generator seed) and returns one
:class:`~fedloom.client.ClientResult` per job, in job order, or ``None`` for a
job whose client was dropped (a worker died and ``backend.options.on_failure`` is
``drop``). Since every random stream is derived from ``(seed, round, client,
purpose)``, the order in which a backend runs the jobs, or where, cannot
change the results.

A factory registered under kind ``backend`` is called as
``factory(trainer, method, cfg, x, y)`` with the run's
:class:`~fedloom.config.BackendConfig` and the whole training data; backends
that ship work to other processes send ``x`` and ``y`` once and each job's
``data_index`` instead of its samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, Protocol

import torch

from fedloom.capabilities import BackendCaps, LoopCaps, method_caps
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.config import ConfigError
from fedloom.job import JobData
from fedloom.registry import register

__all__ = ["KILL_ENV", "Backend", "InProcess", "ResultSink", "SequentialBackend",
           "balanced_groups", "kill_spec", "light_job", "maybe_die", "take_rows", "with_data"]

# Fault injection for tests of worker death (process and ray backends): with
# ``FEDLOOM_KILL_ONCE=<client>:<marker file>`` in the environment when the backend
# is built, the first worker task that holds that client kills its own process
# (SIGKILL) unless the marker file exists, and creates it first — so exactly one
# worker dies.
KILL_ENV = "FEDLOOM_KILL_ONCE"


def kill_spec() -> str | None:
    """``FEDLOOM_KILL_ONCE`` as a backend reads it when it is built: None when unset,
    else checked here, in the run's own process (a malformed one failed inside a
    worker, as an error that named no variable); :class:`ConfigError` naming it and
    the form it takes otherwise."""
    import os

    spec = os.environ.get(KILL_ENV)
    if not spec:
        return None
    client, sep, marker = spec.partition(":")
    if not (sep and client.isascii() and client.isdigit() and marker):
        raise ConfigError(f"{KILL_ENV}={spec!r}: expected CLIENT:MARKER_FILE (a client id "
                          "≥ 0, then the file whose absence lets one worker die, e.g. "
                          f"4:/tmp/killed); unset {KILL_ENV} outside tests of worker death")
    return spec


def maybe_die(spec: str | None, jobs: Sequence[ClientJob]) -> None:
    """Kill this process when ``spec`` (:func:`kill_spec`) names a client of ``jobs``
    and its marker file is not there yet; the marker is created first, new
    (``O_EXCL``: never a file a link there points to), so exactly one worker dies."""
    if not spec:
        return
    import os

    client, _, marker = spec.partition(":")
    if any(j.client == int(client) for j in jobs):
        try:
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                             0o644))
        except FileExistsError:  # another worker died already (or a link stands there)
            return
        os.kill(os.getpid(), 9)


class Backend(Protocol):
    """``capabilities``: a :class:`~fedloom.capabilities.BackendCaps` (``ships_indices``:
    jobs carry ``data_index`` and the backend gathers the samples itself; ``streams``,
    ``writes_rows``, ``shared_rows``: what it does with a :class:`ResultSink`), read by
    :func:`~fedloom.capabilities.backend_caps`; ``close()`` stops what it started
    (workers, a pool) when the run ends, and does nothing where it started nothing.
    A plug-in without ``close()`` or ``name`` is read as before they were here
    (:func:`~fedloom.capabilities.backend_close`, :func:`~fedloom.capabilities.backend_name`)."""

    name: str

    @property
    def capabilities(self) -> BackendCaps: ...

    def train_cohort(self, jobs: Sequence[ClientJob]) -> list[ClientResult | None]: ...

    def close(self) -> None: ...


class ResultSink(Protocol):
    """What a backend that streams (``BackendCaps.streams``) hands each result to, its
    ``train_cohort(jobs, on_result=sink)``: the engine's early uplink
    (:class:`~fedloom.engine.stages.uplink.EarlyUplink`). Called as ``sink(position,
    result)``, or ``sink(position, result, sent)`` with what the client's worker did
    of its uplink."""

    @property
    def rows(self) -> torch.Tensor | None:
        """The server's ``[m, d]`` rows, into which a backend that writes rows puts
        each update (``BackendCaps.writes_rows``); None: it keeps its own."""
        ...

    @property
    def client_side(self) -> Callable[[torch.Tensor, int], Any] | None:
        """What a worker may do of each client's uplink, ``client_side(update,
        client)`` (:class:`~fedloom.engine.stages.uplink.ClientSide`); None: nothing."""
        ...

    def __call__(self, i: int, res: ClientResult, sent: Any = None) -> None: ...


class InProcess:
    """A backend that trains in this process: nothing to start before
    ``backend: auto`` times it (:meth:`warm_up`), nothing to stop (:meth:`close`)."""

    def warm_up(self) -> None:
        return None

    def close(self) -> None:
        return None


class SequentialBackend(InProcess):
    """Clients one after another in this process.

    With ``on_result`` (the engine's early uplink), each client's result is handed
    over as soon as it is trained, and a method that trains with one call of the
    trainer's ``run`` (plain local SGD) writes its update straight into the
    server's row ``on_result.rows[i]``: the identity's payload is then read in
    place (no copy, no serialisation, no checksum pass over it), and the other
    compressors encode while the update is still in the cache. The same bits as
    without (the tests compare the runs' models and metrics)."""

    name = "sequential"
    # trains on the samples each job carries; hands each result to ``on_result`` as it
    # is trained and writes the updates into ``on_result.rows`` (this process's
    # memory: not shared)
    capabilities = BackendCaps(streams=True, writes_rows=True, shared_rows=False)

    def __init__(self, trainer: LocalSGD, method: LocalMethod) -> None:
        self.trainer = trainer
        self.method = method

    def train_cohort(self, jobs: Sequence[ClientJob], on_result: ResultSink | None = None
                     ) -> list[ClientResult | None]:
        if on_result is None:
            return [self.method.run(self.trainer, job) for job in jobs]
        rows = on_result.rows
        if not (type(self.method).run is LocalMethod.run and isinstance(rows, torch.Tensor)
                and rows.shape[0] >= len(jobs)):
            rows = None  # each update a vector of its own
        out: list[ClientResult | None] = []
        for i, job in enumerate(jobs):
            with self.trainer.updates_into(rows[i]) if rows is not None else nullcontext():
                res = self.method.run(self.trainer, job)
            out.append(res)
            hand_over(on_result, i, res)
        return out


def hand_over(on_result: Callable[..., None] | None, i: int, res: ClientResult | None,
              sent: Any = None) -> None:
    """Pass cohort position ``i``'s result to a backend caller's ``on_result`` as it
    comes (nothing for a failed client or without ``on_result``), with what its
    worker did of its uplink where it did any (``sent``, a
    :class:`~fedloom.engine.stages.uplink.Sent`)."""
    if res is None or on_result is None:
        return
    if sent is None:
        on_result(i, res)
    else:  # the worker did the client's own uplink work
        on_result(i, res, sent)


@register("backend", "sequential")
def _sequential(trainer: LocalSGD, method: LocalMethod, x: torch.Tensor | None = None,
                y: torch.Tensor | None = None, *, threads: int = 1,
                keep_heap: bool = True) -> SequentialBackend:
    return SequentialBackend(trainer, method)


def method_reason(caps: LoopCaps, method: LocalMethod) -> str | None:
    """Why a batched trainer of capabilities ``caps`` does not run ``method``'s
    local work itself (None: it does): plain local SGD always, a method whose
    work is the loop with its terms (``MethodCaps.batched``) where ``caps.methods``."""
    if type(method) is LocalMethod:
        return None
    if not method_caps(method).batched:
        return f"local method {method.name} has a local loop of its own"
    if not caps.methods:
        return f"local method {method.name} (the backend's loop.methods capability)"
    return None


# ------------------------------------------------------------ shipping helpers
_EMPTY = torch.empty(0)


def light_job(job: ClientJob, shared_model: bool = False) -> ClientJob:
    """The job without its samples (``data_index`` names them) for shipping, and
    without its model where the receiver holds it (``shared_model``: ``w`` is
    ``None``; the process backend's workers read the round's model from shared
    memory)."""
    if shared_model:
        job = dataclasses.replace(job, w=None)  # type: ignore[arg-type]
    if job.data.index is None:
        return job
    return dataclasses.replace(job, data=JobData(_EMPTY, _EMPTY, job.data.index))


def take_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]``; a view of ``t`` where ``idx`` is a run of consecutive rows (a
    client that owns a block of the data: no copy of its samples a round)."""
    n = int(idx.numel())
    if n and idx.dim() == 1 and idx.dtype in (torch.int64, torch.int32):
        a = int(idx[0])
        if int(idx[-1]) - a == n - 1 and (n == 1 or bool((idx[1:] - idx[:-1] == 1).all())):
            if 0 <= a and a + n <= t.shape[0]:
                return t[a : a + n]
    return t[idx]


def with_data(job: ClientJob, x: torch.Tensor, y: torch.Tensor) -> ClientJob:
    """The shipped job with its samples gathered again from the whole data."""
    idx = job.data.index
    if idx is None:
        return job
    return dataclasses.replace(job, data=JobData(take_rows(x, idx), take_rows(y, idx), idx))


def balanced_groups(jobs: Sequence[ClientJob], n: int) -> list[list[int]]:
    """Split job positions into ≤ ``n`` groups of similar total work (samples ×
    epochs), largest first onto the least loaded group (LPT); positions within
    a group stay in job order."""
    n = max(1, min(n, len(jobs)))
    load = [0] * n
    groups: list[list[int]] = [[] for _ in range(n)]
    sizes = [(int(j.y.shape[0]) if j.data.index is None else int(j.data.index.numel()))
             * (j.steps.epochs or 1) for j in jobs]
    for i in sorted(range(len(jobs)), key=lambda i: -sizes[i]):
        g = min(range(n), key=load.__getitem__)
        groups[g].append(i)
        load[g] += sizes[i]
    return [sorted(g) for g in groups if g]
