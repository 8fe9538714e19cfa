"""The ``process`` backend: a cohort split over single-thread worker processes.

Each worker is started once per run (``spawn``, so no thread pool or lock of
the parent is inherited) with the trainer, the local method and the whole
training data; a round then ships only the jobs without their samples
(:func:`~fedloom.engine.trainers.backends.light_job`) and gets the results back. The
cohort is split into ``workers`` groups of similar work
(:func:`~fedloom.engine.trainers.backends.balanced_groups`); each worker runs its
group with the ``inner`` backend (``sequential``, ``vmap`` or ``lockstep``), so
lock-step training and process parallelism compose.

Same results: a worker runs the same code on the same jobs, with the same
derived generators. Workers use one thread unless ``backend.threads`` says
otherwise (:func:`fedloom.device.worker_threads`):
float64 runs give the sequential backend's ``model_sha256``; float32 runs give
the bits of the sequential backend run at one thread, and differ from it at
two threads by exactly what the thread count changes in a matrix product's
summation order (measured on the tiny test config: 3e-8 after 3 rounds, both
ways). Both are tested.

On CUDA, ``backend.options.workers: 0`` starts one worker per visible GPU. A worker that
dies is replaced; only its group is run again (``backend.options.on_failure: retry``) or
its clients dropped for the round (``drop``). GPUs and dead workers in detail:
docs/explanation/backends.md (process).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import pickle
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from multiprocessing.connection import wait
from typing import Annotated, Any, Literal

import torch
import torch.multiprocessing as tmp

from fedloom.capabilities import BackendCaps
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.device import (
    configure,
    keep_freed_heap,
    storage_use_count,
    to_device,
    to_host,
    worker_threads,
)
from fedloom.engine.trainers.backends import (
    ResultSink,
    SequentialBackend,
    balanced_groups,
    hand_over,
    kill_spec,
    light_job,
    maybe_die,
    with_data,
)
from fedloom.registry import Range, register
from fedloom.spawning import check_main_guard

__all__ = ["ProcessBackend", "make_inner", "run_group"]

log = logging.getLogger("fedloom")

_WORKER: dict[str, Any] = {}


def make_inner(trainer: LocalSGD, method: LocalMethod, inner: str, chunk: int = 0,
               x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> Any:
    """The in-process backend a worker runs its share of the cohort with (``x``, ``y``:
    the worker's copy of the training data, which lockstep indexes directly)."""
    if inner == "vmap":
        from fedloom.engine.trainers.vmap import VmapBackend

        return VmapBackend(trainer, method, chunk=chunk or None)
    if inner == "lockstep":
        from fedloom.engine.trainers.lockstep import LockstepBackend

        return LockstepBackend(trainer, method, chunk=chunk or None, x=x, y=y)
    return SequentialBackend(trainer, method)


# What a worker is set up from (:func:`_init_worker`'s arguments before ``device``).
_InitArgs = tuple[LocalSGD, LocalMethod, torch.Tensor, torch.Tensor, str, int, "str | None", int,
                  bool]


def _init_worker(trainer: LocalSGD, method: LocalMethod, x: torch.Tensor, y: torch.Tensor,
                 inner: str, chunk: int, kill_once: str | None, threads: int = 0,
                 keep_heap: bool = True, device: str = "cpu") -> None:
    worker_threads(threads)
    if keep_heap:  # a worker's steps reuse the heap (no page faults every step)
        keep_freed_heap()
    dev = torch.device(device)
    if dev.type == "cuda":
        configure(dev)
        trainer = dataclasses.replace(trainer, module=trainer.module.to(dev))
        x, y = x.to(dev), y.to(dev)
    _WORKER.update(backend=make_inner(trainer, method, inner, chunk, x, y), x=x, y=y,
                   kill_once=kill_once, device=dev)


def run_group(backend: Any, x: torch.Tensor, y: torch.Tensor,
              jobs: Sequence[ClientJob]) -> list[ClientResult | None]:
    """Train shipped jobs with ``backend`` after gathering their samples again."""
    return backend.train_cohort([with_data(j, x, y) for j in jobs])


def _train_group(blob: bytes, out: torch.Tensor, rows: list[int],
                 part: Callable[[int, bytes, Any], None] | None = None,
                 client_side: Callable[[torch.Tensor, int], Any] | None = None) -> bytes | None:
    # Jobs and the small part of the results travel as plain pickles; the dense
    # updates are written into ``out``, a tensor in shared memory that the parent
    # allocated (one handle per worker instead of one pickled copy per update).
    jobs = pickle.loads(blob)
    w = _WORKER.get("w")
    if w is not None:  # the round's model, read from shared memory (see ProcessBackend)
        jobs = [dataclasses.replace(j, w=w) if j.w is None else j for j in jobs]
    dev = _WORKER.get("device", torch.device("cpu"))
    backend = _WORKER["backend"]
    kill = _WORKER.get("kill_once")
    if part is not None and isinstance(backend, SequentialBackend):
        # Streamed: each client's result goes to the parent as soon as it is trained,
        # so the parent's per-client uplink work overlaps the others' training. The
        # sequential backend trains each job on its own, so one job at a time is the
        # same computation as the whole group.
        # A method that trains with one call of the trainer's ``run`` (plain local SGD)
        # has it write the update straight into the client's row: no vector and copy.
        direct = type(backend.method).run is LocalMethod.run and dev.type == "cpu"
        for row, job in zip(rows, jobs, strict=True):
            maybe_die(kill, [job])  # at that client's turn: the ones before it were sent
            with backend.trainer.updates_into(out[row]) if direct else nullcontext():
                res = run_group(backend, _WORKER["x"], _WORKER["y"], to_device([job], dev))[0]
            # the client's own uplink work (its norm, its encode), where the update is
            sent = (client_side(res.update, res.client)
                    if client_side is not None and res is not None else None)
            part(row, _host_blob(res, out, row), sent)
        return None
    maybe_die(kill, jobs)
    results = run_group(backend, _WORKER["x"], _WORKER["y"], to_device(jobs, dev))
    sents = ([client_side(res.update, res.client) if res is not None else None
              for res in results] if client_side is not None else None)
    for row, res in zip(rows, results, strict=True):
        _to_shared(res, out, row)
    return pickle.dumps((to_host(results), sents), protocol=pickle.HIGHEST_PROTOCOL)


def _to_shared(res: ClientResult | None, out: torch.Tensor, row: int) -> None:
    if res is not None and res.update.shape == out.shape[1:]:
        if res.update.data_ptr() != out[row].data_ptr():  # not written there already
            out[row].copy_(res.update)
        # None, not an empty tensor: a tensor in a pickle goes through torch's
        # serialisation (about 0.5 ms a client in the parent's load)
        res.update = None  # type: ignore[assignment]


def _host_blob(res: ClientResult | None, out: torch.Tensor, row: int) -> bytes:
    _to_shared(res, out, row)
    return pickle.dumps(to_host(res), protocol=pickle.HIGHEST_PROTOCOL)


class _RemoteTraceback(Exception):
    """The worker's traceback, attached as the cause of the error it raised."""


def _error_reply(seq: int, e: BaseException) -> tuple[str, int, Any]:
    tb = "".join(traceback.format_exception(e))
    try:
        pickle.dumps(e)
        return ("error", seq, (e, tb))
    except Exception:  # an exception that does not pickle still reaches the parent
        return ("error", seq, (RuntimeError(f"{type(e).__name__}: {e}"), tb))


def _worker_main(conn: Any, initargs: _InitArgs, device: str = "cpu") -> None:
    """A worker: set up once, then answer ``(seq, jobs, buffer, rows, stream)``
    requests with ``("ok", seq, results)`` until ``None`` or the parent is gone
    (``stream``: one ``("part", seq, (row, result, sent))`` a client as it is
    trained, then ``("ok", seq, None)``; ``sent``: what ``stream``, when it is a
    :class:`~fedloom.engine.stages.uplink.ClientSide`, did of the client's uplink)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        _init_worker(*initargs, device=device)
    except BaseException as e:
        conn.send(_error_reply(-1, e))
        return
    conn.send(("ready", -1, os.getpid()))
    out: torch.Tensor | None = None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the parent is gone
        if msg is None:
            return
        seq, blob, new_out, new_w, rows, stream = msg
        if new_out is not None:  # the buffer is sent only when it changes
            out = new_out
        if new_w is not None:  # so is the model's: False when jobs carry their own
            _WORKER["w"] = new_w if isinstance(new_w, torch.Tensor) else None

        def part(row: int, res: bytes, sent: Any, seq: int = seq) -> None:
            conn.send(("part", seq, (row, res, sent)))

        try:
            assert out is not None
            # stream: False, True, or the client side of the uplink to run (ClientSide)
            side = None if isinstance(stream, bool) else stream
            reply: tuple[str, int, Any] = ("ok", seq, _train_group(
                blob, out, rows, part if stream else None, side))
        except BaseException as e:
            reply = _error_reply(seq, e)
        conn.send(reply)


class _Worker:
    """One worker process and the parent's end of its pipe."""

    def __init__(self, initargs: _InitArgs, device: str = "cpu") -> None:
        ctx = tmp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        # daemon: never outlives the parent, whatever way the parent ends
        self.proc = ctx.Process(target=_worker_main, args=(child, initargs, device),
                                daemon=True, name="fedloom-worker")
        self.proc.start()
        child.close()
        self.ready = False
        self.buf_id = -1  # which of the parent's buffers this worker holds
        self.w_id = -1    # which of the parent's model buffers it holds (0: none)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def stop(self, wait_s: float = 0.0) -> None:
        """Ask it to exit (an idle worker does at once), then terminate it after
        ``wait_s`` seconds (a busy one: its work is abandoned)."""
        if wait_s and self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(wait_s)
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(5)
        if self.proc.is_alive():  # pragma: no cover (a worker that ignores SIGTERM)
            self.proc.kill()
            self.proc.join()
        self.conn.close()


@dataclasses.dataclass
class _SharedBuffers:
    """The shared-memory tensors the workers hold a handle to, each with the id a
    worker compares with its own to know whether its handle is current: the rows the
    updates are written into and the round's model."""

    rows: torch.Tensor | None = None
    rows_refs: int = 0  # the rows' storage use count with no row handed out
    rows_id: int = 0
    w: torch.Tensor | None = None  # the round's model
    w_id: int = 0


@dataclasses.dataclass
class _GroupRound:
    """One call's groups in flight: what is left to send, which worker holds which
    group, each group's deaths, and the results so far."""

    jobs: Sequence[ClientJob]
    buf: torch.Tensor
    seq: int
    on_result: ResultSink | None
    shared_w: bool
    side: Any  # the client side of the uplink for the workers to do, or None
    todo: deque[list[int]]
    out: list[ClientResult | None]
    deaths: list[int]
    gid: dict[int, int]  # id(group) -> its position in deaths
    busy: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # worker -> group


class ProcessBackend:
    """``workers`` single-thread processes, each training a share of the cohort."""

    name = "process"

    def __init__(self, trainer: LocalSGD, method: LocalMethod, x: torch.Tensor, y: torch.Tensor,
                 workers: int = 0, inner: str = "sequential", chunk: int = 0,
                 on_failure: str = "retry", max_retries: int = 2, threads: int = 0,
                 keep_heap: bool = True) -> None:
        # Before anything: a script without the __main__ guard would start the run again
        # in every worker (fedloom.spawning), seen here only as dead workers.
        check_main_guard("backend process")
        # The run's device is where its data is; on CUDA, one worker per visible GPU.
        self.gpus = torch.cuda.device_count() if x.device.type == "cuda" else 0
        self.workers = workers or self.gpus or os.cpu_count() or 1
        self.worker_threads = threads or 1
        self.inner = inner
        self.on_failure, self.max_retries = on_failure, max_retries
        self.d = trainer.layout.size
        # the trained tensors' dtype (a frozen base may hold another: model.options.base_dtype)
        self.dtype = dict(trainer.module.named_parameters())[trainer.layout.tensors[0].name].dtype
        self._shared = _SharedBuffers()
        self._seq = 0
        # Tensors sent at start-up go through shared memory (torch's reducers), from
        # the host: a worker moves them to its own GPU.
        if x.device.type != "cpu":
            trainer = dataclasses.replace(trainer, module=copy.deepcopy(trainer.module).cpu())
        self._initargs = (trainer, method, x.cpu(), y.cpu(), inner, chunk,
                          kill_spec(), threads, keep_heap)
        # Started on first use: a run that fails validation after the backend is
        # built (a bad compressor option) spawns nothing.
        self._pool: list[_Worker] = []

    # ----------------------------------------------------------------- workers
    def _workers(self) -> list[_Worker]:
        while len(self._pool) < self.workers:
            self._pool.append(_Worker(self._initargs, self._device(len(self._pool))))
        return self._pool

    def _device(self, i: int) -> str:
        """Worker ``i``'s device: ``cuda:(i mod GPUs)`` for a CUDA run, else the CPU."""
        return f"cuda:{i % self.gpus}" if self.gpus else "cpu"

    def _replace(self, i: int) -> _Worker:
        old = self._pool[i]
        old.stop()
        self._pool[i] = _Worker(self._initargs, self._device(i))
        return self._pool[i]

    def worker_pids(self) -> list[int]:
        """The process ids of the workers started so far."""
        return [w.pid for w in self._pool if w.pid is not None]

    def _recv(self, w: _Worker) -> tuple[str, int, Any] | None:
        """The worker's next message, or ``None`` if it died (pipe closed)."""
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            return None
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "error" and msg[1] in (-1, self._seq):
            exc, tb = msg[2]
            raise exc from _RemoteTraceback(f"\n'''\n{tb}'''")
        return msg

    @property
    def capabilities(self) -> BackendCaps:
        """Jobs carry ``data_index`` (the workers hold the data). :meth:`train_cohort`
        hands each result to ``on_result`` as it arrives (``streams``: one client at a
        time from sequential workers, a group at a time from lock-step and vmap ones,
        which train their group together), and writes the updates into
        ``on_result.rows`` when those are in shared memory (``writes_rows``: the
        server's rows, no copy of them in the parent)."""
        return BackendCaps(ships_indices=True, streams=True, writes_rows=True,
                           worker_threads=self.worker_threads)

    def _writable(self, rows: torch.Tensor, m: int) -> bool:
        return (self.gpus == 0 and rows.device.type == "cpu" and rows.is_shared()
                and rows.dtype == self.dtype and rows.ndim == 2 and rows.shape[0] >= m
                and rows.shape[1] == self.d and rows.is_contiguous())

    # ------------------------------------------------------------------ rounds
    def train_cohort(self, jobs: Sequence[ClientJob], on_result: ResultSink | None = None
                     ) -> list[ClientResult | None]:
        """Train ``jobs``; with ``on_result``, each client's result is also passed
        to ``on_result(position, result)`` as it arrives, while the workers still
        train the others. A client whose worker died may be passed again (its group
        run again: the same result) or end up ``None`` in the returned list
        (``on_failure: drop``): the list is what counts."""
        # The updates are handed out as rows of the shared buffer, not copies of them
        # (a copy of every update a round, done serially in this process, cost as much
        # as the uplink). A buffer some of whose rows are still referenced (a caller
        # that keeps last round's results) is left to them and a new one is made.
        stream, sh = on_result, self._shared
        rows = stream.rows if stream is not None else None
        if isinstance(rows, torch.Tensor) and self._writable(rows, len(jobs)):
            # The caller's rows (the server's, in shared memory): each update is written
            # where the server reads it. They are the caller's to keep or overwrite.
            buf = rows
            # a new buffer, or more of it: the workers' handle is their view of it
            if (sh.rows is None or sh.rows.data_ptr() != rows.data_ptr()
                    or sh.rows.shape != rows.shape):
                sh.rows, sh.rows_refs = rows, -1
                sh.rows_id += 1
        else:
            if (sh.rows is None or sh.rows.shape[0] < len(jobs) or sh.rows_refs < 0
                    or storage_use_count(sh.rows) > sh.rows_refs):
                sh.rows = torch.empty((len(jobs), self.d), dtype=self.dtype).share_memory_()
                sh.rows_refs = storage_use_count(sh.rows)
                sh.rows_id += 1
            buf = sh.rows
        self._seq += 1
        try:
            return self._run_groups(jobs, buf, self._seq, stream)
        except BaseException:
            # A worker's error, retries exhausted or Ctrl-C: the round is abandoned,
            # and so are the workers still busy with it (a later call starts anew).
            self.close()
            raise

    def _run_groups(self, jobs: Sequence[ClientJob], buf: torch.Tensor, seq: int,
                    on_result: ResultSink | None = None) -> list[ClientResult | None]:
        groups = balanced_groups(jobs, self.workers)
        out: list[ClientResult | None] = [None] * len(jobs)
        shared_w = self._share_model(jobs)
        # the client side of each client's uplink, for the workers to do (on the host)
        side = on_result.client_side if on_result is not None and self.gpus == 0 else None
        pool = self._workers()
        rnd = _GroupRound(jobs, buf, seq, on_result, shared_w, side, deque(groups), out,
                          [0] * len(groups), {id(g): n for n, g in enumerate(groups)})
        while rnd.todo or rnd.busy:
            self._send_groups(rnd)
            if not rnd.busy:
                continue
            busy = rnd.busy
            ready = wait([pool[i].conn for i in busy] + [pool[i].proc.sentinel for i in busy])
            for i in list(busy):
                w = pool[i]
                if w.conn not in ready and w.proc.sentinel not in ready:
                    continue
                msg = self._recv(w) if w.conn.poll() else None
                if msg is not None:
                    self._take_reply(rnd, i, msg)
                    continue  # "ready", or a late reply to an abandoned round
                if w.proc.is_alive() and not w.conn.closed:
                    continue  # the sentinel is not set; nothing to read yet
                self._lost_group(rnd, i)
        return out

    def _send_groups(self, rnd: _GroupRound) -> None:
        """Send the groups left to the idle workers (replacing a dead one)."""
        pool, jobs, sh = self._pool, rnd.jobs, self._shared
        for i in range(len(pool)):
            if not rnd.todo:
                break
            if i in rnd.busy:
                continue
            w = pool[i]
            if not w.proc.is_alive():  # died while idle (between rounds): nothing lost
                log.warning("backend process: worker %s found dead (exit code %s) before "
                            "round work was sent; replaced", w.pid, w.proc.exitcode)
                w = self._replace(i)
            g = rnd.todo.popleft()
            blob = pickle.dumps([to_host(light_job(jobs[j], rnd.shared_w)) for j in g],
                                protocol=pickle.HIGHEST_PROTOCOL)
            w_id = sh.w_id if rnd.shared_w else 0
            new_w = (None if w.w_id == w_id else sh.w if rnd.shared_w else False)
            try:
                w.conn.send((rnd.seq, blob, rnd.buf if w.buf_id != sh.rows_id else None,
                             new_w, g,
                             rnd.side if rnd.side is not None else rnd.on_result is not None))
            except OSError:  # it died just now, before taking the group
                self._replace(i)
                rnd.todo.appendleft(g)
                continue
            w.buf_id, w.w_id = sh.rows_id, w_id
            rnd.busy[i] = g

    def _take_reply(self, rnd: _GroupRound, i: int, msg: tuple[str, int, Any]) -> None:
        """Worker ``i``'s message: a streamed result, or its group done."""
        if msg[0] == "part" and msg[1] == rnd.seq:
            j, blob, sent = msg[2]
            rnd.out[j] = self._from_shared(pickle.loads(blob), rnd.buf, j)
            hand_over(rnd.on_result, j, rnd.out[j], sent)
        elif msg[0] == "ok" and msg[1] == rnd.seq:
            g = rnd.busy.pop(i)
            if msg[2] is not None:  # not streamed: the group's results at once
                results, sents = pickle.loads(msg[2])
                for n, (j, res) in enumerate(zip(g, results, strict=True)):
                    rnd.out[j] = self._from_shared(res, rnd.buf, j)
                    hand_over(rnd.on_result, j, rnd.out[j],
                              sents[n] if sents is not None else None)

    def _lost_group(self, rnd: _GroupRound, i: int) -> None:
        """Worker ``i`` died holding its group: only that group is affected (the
        results it streamed before dying included): it is run again or dropped."""
        g = rnd.busy.pop(i)
        for j in g:
            rnd.out[j] = None
        code = self._pool[i].proc.exitcode
        self._replace(i)
        n = rnd.gid[id(g)]
        rnd.deaths[n] += 1
        clients = [rnd.jobs[j].client for j in g]
        if self.on_failure == "drop":
            log.warning("backend process: worker died (exit code %s); clients %s "
                        "dropped for the round", code, clients)
        elif rnd.deaths[n] > self.max_retries:
            raise RuntimeError(f"backend: a worker process died (exit code {code}) "
                               f"running clients {clients}; {self.max_retries} "
                               "retries exhausted")
        else:
            log.warning("backend process: worker died (exit code %s); clients %s "
                        "run again", code, clients)
            rnd.todo.append(g)

    def _from_shared(self, res: ClientResult | None, buf: torch.Tensor,
                     j: int) -> ClientResult | None:
        if res is not None and res.update is None:
            res.update = buf[j]  # valid while the caller holds it
        return res

    def _share_model(self, jobs: Sequence[ClientJob]) -> bool:
        """Whether the jobs' model goes through shared memory this round: when they all
        carry the same host tensor (a synchronous round's broadcast), it is copied
        once into a buffer the workers hold (sent to them once, like the rows), and
        the jobs travel without it. Pickled, it was one copy a group written to the
        pipe by this process and read back by each worker, a round (6.5 MB each on
        the CIFAR-10 shape). Jobs with models of their own (stale ones under
        asynchronous aggregation) carry them as before."""
        if self.gpus or not jobs:
            return False
        w = jobs[0].w
        if (not isinstance(w, torch.Tensor) or w.device.type != "cpu" or w.ndim != 1
                or any(j.w is not w for j in jobs)):
            return False
        sh = self._shared
        if sh.w is None or sh.w.shape != w.shape or sh.w.dtype != w.dtype:
            sh.w = torch.empty_like(w).share_memory_()
            sh.w_id += 1
        # no worker reads it now: a round's workers are done before the next is sent
        sh.w.copy_(w)
        return True

    def warm_up(self) -> None:
        """Start every worker now (spawn, imports, the data), not inside a timed round."""
        for i in range(len(self._workers())):
            w = self._pool[i]
            while not w.ready:
                if self._recv(w) is None:  # died while starting: start another
                    w = self._replace(i)

    def close(self) -> None:
        for w in self._pool:
            w.stop(wait_s=1.0)
        self._pool = []

    def __del__(self) -> None:  # pragma: no cover (interpreter shutdown order varies)
        try:
            for w in self._pool:
                if w.proc.is_alive():
                    w.proc.terminate()
        except Exception:
            pass


@register("backend", "process")
def _process(trainer: LocalSGD, method: LocalMethod, x: torch.Tensor, y: torch.Tensor, *,
             threads: int = 1, keep_heap: bool = True,
             workers: Annotated[int, Range(ge=0)] = 0,
             inner: Literal["sequential", "vmap", "lockstep"] = "sequential",
             chunk: Annotated[int, Range(ge=0)] = 0,
             on_failure: Literal["retry", "drop"] = "retry",
             max_retries: Annotated[int, Range(ge=0)] = 2) -> ProcessBackend:
    """``workers`` single-thread processes (0: every core), each running ``inner`` on its
    share of the cohort (``chunk``: its clients per chunk); work whose worker died is run
    again up to ``max_retries`` times (``on_failure: retry``) or dropped (``drop``)."""
    return ProcessBackend(trainer, method, x, y, workers=workers, inner=inner,
                          chunk=chunk, on_failure=on_failure,
                          max_retries=max_retries, threads=threads,
                          keep_heap=keep_heap)
