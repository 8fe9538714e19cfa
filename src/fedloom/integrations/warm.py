"""A warm ClientApp for Flower deployments: one long-lived worker per SuperNode.

Flower 1.42 runs every message a SuperNode receives in a fresh ``flwr-clientapp``
process, in both isolation modes. A ClientApp that trains with torch therefore
pays, per message, the import of torch and the building of its data and model
(docs/deploy.md, "Round time", has the measured costs) before any training.

:func:`warm_client_app` returns a thin ClientApp for Flower to load instead. It
imports only Flower and the standard library, and hands each message, with its
``Context``, over an authenticated ``AF_UNIX`` socket to a worker process that
stays up between messages (one per SuperNode, app and source version) and runs
the real ClientApp (``target``, ``"module:attr"``). What crosses is Flower's own
serialization of the Message and Context, so the results are the same
(tests/test_flower_deploy.py, tests/test_warm.py) and no state lives only in the
worker; a dead worker costs one retry. Measured (benchmarks/deploy.md, 4 MNIST
SuperNodes on one 2-core machine): a deployed round 11.8–12.9 s with the relay
against 22.2–25.5 s without. ``warm = false`` in the run config runs ``target``
in Flower's process instead. POSIX only. The relay, its safety and lifetime:
docs/deploy.md (The warm ClientApp in detail).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

try:
    from flwr.app import Context, Message
    from flwr.clientapp import ClientApp
    from flwr.common import serde
    from flwr.proto.message_pb2 import Context as ProtoContext
    from flwr.proto.message_pb2 import Message as ProtoMessage
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict
except ImportError as e:  # pragma: no cover (the extra is missing)
    raise ImportError("fedloom.integrations.warm needs Flower: pip install 'fedloom[flower]'"
                      ) from e

__all__ = ["WarmClientApp", "WorkerError", "stop_worker", "warm_client_app", "worker_stats"]

log = logging.getLogger("fedloom")

PROTOCOL = 1
KEY_BYTES = 32


class WorkerError(RuntimeError):
    """The worker could not be started or reached, or its target raised."""


# ----------------------------------------------------------------- addressing
def warm_dir() -> Path:
    """The directory of sockets, keys and logs (created 0700; refused when it is
    another user's or others may enter it)."""
    root = os.environ.get("FEDLOOM_WARM_DIR") or str(
        Path(tempfile.gettempdir()) / f"fedloom-warm-{os.getuid()}")
    d = Path(root)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = d.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise WorkerError(f"FEDLOOM_WARM_DIR: {d} must belong to this user and be closed to "
                          f"others (mode {st.st_mode & 0o777:o}); chmod 700 it or choose another")
    return d


def _auth_key(d: Path) -> bytes:
    """The directory's shared key: made once, atomically (link fails if another
    process made it first; then theirs is read)."""
    path = d / "key"
    if not path.exists():
        tmp = d / f"key.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
        tmp.unlink()
    key = path.read_bytes()
    if len(key) != KEY_BYTES:
        raise WorkerError(f"{path}: not a key ({len(key)} bytes); delete it to make a new one")
    return key


def _package_files(top: str) -> list[Path]:
    """The files of top-level package/module ``top`` as found on ``sys.path``
    (without importing it)."""
    for entry in sys.path:
        base = Path(entry or ".")
        if (base / top).is_dir():
            return sorted(p for p in (base / top).rglob("*")
                          if p.is_file() and "__pycache__" not in p.parts)
        if (base / f"{top}.py").is_file():
            return [base / f"{top}.py"]
    return []


def worker_key(target: str, node_id: int) -> str:
    """The worker for this SuperNode, target, interpreter, path and sources."""
    import fedloom  # lazy package: no torch

    h = hashlib.sha256()
    h.update(json.dumps([PROTOCOL, target, int(node_id), sys.executable, sys.path]).encode())
    tops = {"fedloom", target.split(":")[0].split(".")[0]}
    for top in sorted(tops):
        files = (sorted(Path(fedloom.__file__).parent.rglob("*.py")) if top == "fedloom"
                 else _package_files(top))
        for p in files:
            st = p.stat()
            h.update(f"{p}\0{st.st_mtime_ns}\0{st.st_size}\n".encode())
    return h.hexdigest()[:24]


# -------------------------------------------------------------------- framing
def _send(conn: Any, header: dict[str, Any], *blobs: bytes) -> None:
    conn.send_bytes(json.dumps(header).encode())
    for b in blobs:
        conn.send_bytes(b)


def _recv_header(conn: Any) -> dict[str, Any]:
    try:
        h = json.loads(conn.recv_bytes(1 << 20).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"header: not JSON ({e})") from None
    if not isinstance(h, dict) or h.get("v") != PROTOCOL:
        raise ValueError(f"header: protocol {h.get('v') if isinstance(h, dict) else h!r}, "
                         f"this side speaks {PROTOCOL}")
    return h


# ---------------------------------------------------------------------- relay
class WarmClientApp(ClientApp):
    """The relay ClientApp of :func:`warm_client_app` (see the module doc)."""

    def __init__(self, target: str, *, idle_s: float = 600.0, start_timeout_s: float = 600.0,
                 warm: bool | None = None) -> None:
        super().__init__()
        if ":" not in target:
            raise ValueError(f"target: {target!r} is not 'module:attr'")
        self.target = target
        self.idle_s = float(idle_s)
        self.start_timeout_s = float(start_timeout_s)
        self.warm = warm
        self._local: ClientApp | None = None

    # Flower calls the app with (message, context); every message type and action
    # goes to the target, so the relay registers no handlers of its own.
    def __call__(self, message: Message, context: Context) -> Message:
        if not self._is_warm(context):
            return self._local_app()(message, context)
        reply, state = self._call_worker(message, context)
        context.state = state  # what Flower stores for this node's next message
        return reply

    def _is_warm(self, context: Context) -> bool:
        if self.warm is not None:
            return self.warm
        v = context.run_config.get("warm", True)
        if isinstance(v, str):
            if v.lower() not in ("true", "false", "1", "0", "on", "off"):
                raise ValueError(f"run_config.warm: {v!r} is not a boolean")
            return v.lower() in ("true", "1", "on")
        return bool(v)

    def _local_app(self) -> ClientApp:
        if self._local is None:
            self._local = _load_target(self.target)
        return self._local

    def _call_worker(self, message: Message, context: Context) -> tuple[Message, Any]:
        msg_b = serde.message_to_proto(message).SerializeToString()
        ctx_b = serde.context_to_proto(context).SerializeToString()
        header = {"v": PROTOCOL, "op": "call", "target": self.target,
                  "task": _task_identity()}
        for attempt in (1, 2):
            conn = _connect(self.target, context.node_id, self.idle_s, self.start_timeout_s)
            try:
                with conn:
                    _send(conn, header, msg_b, ctx_b)
                    h = _recv_header(conn)
                    if not h.get("ok"):
                        raise WorkerError(f"worker: {h.get('error', 'failed')}")
                    reply_b, state_b = conn.recv_bytes(), conn.recv_bytes()
            except (EOFError, ConnectionError, OSError) as e:
                # The worker died mid-message (killed, out of memory): the message
                # and state are unchanged, so one fresh worker may run it again.
                if attempt == 2:
                    raise WorkerError(f"worker: lost twice in a row ({type(e).__name__}: {e}); "
                                      f"see {_paths(self.target, context.node_id)[2]}") from e
                log.warning("warm: worker lost (%s: %s); starting a new one",
                            type(e).__name__, e)
                continue
            reply = serde.message_from_proto(ProtoMessage.FromString(reply_b))
            state = serde.recorddict_from_proto(ProtoRecordDict.FromString(state_b))
            return reply, state
        raise AssertionError("unreachable")


def warm_client_app(target: str, *, idle_s: float = 600.0, start_timeout_s: float = 600.0,
                    warm: bool | None = None) -> WarmClientApp:
    """A ClientApp that runs ``target`` (``"module:attr"``, a ClientApp) in a worker
    that outlives each message (see the module doc).

    Args:
        target: the real ClientApp, importable in the worker (Flower's app directory
            and this process's ``sys.path`` are passed on).
        idle_s: the worker exits after this many seconds without a message.
        start_timeout_s: how long the first message waits for a new worker to listen.
        warm: ``False`` runs ``target`` in this process (Flower's behaviour); ``None``
            reads ``warm`` from the run config (default true).
    """
    return WarmClientApp(target, idle_s=idle_s, start_timeout_s=start_timeout_s, warm=warm)


def _task_identity() -> dict[str, int] | None:
    from flwr.supercore.task_identity import TaskIdentity

    got = {k: getattr(TaskIdentity, f"_{k}") for k in ("task_id", "run_id", "node_id")}
    return got if all(v is not None for v in got.values()) else None


def _paths(target: str, node_id: int) -> tuple[Path, Path, Path]:
    d = warm_dir()
    key = worker_key(target, node_id)
    return d / f"{key}.sock", d / f"{key}.lock", d / f"{key}.log"


def _no_follow(path: str, flags: int) -> int:
    """``open()``'s opener for the files appended to in place (the lock, the log):
    never through a link (``ELOOP``), so a link left in the directory cannot make the
    relay write into what it points to."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _try_connect(sock: Path, authkey: bytes) -> Any | None:
    from multiprocessing.connection import Client

    try:
        return Client(str(sock), family="AF_UNIX", authkey=authkey)
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except (ConnectionError, EOFError):  # a worker that died during the handshake
        return None


def _connect(target: str, node_id: int, idle_s: float, start_timeout_s: float) -> Any:
    """A connection to this node's worker, started first when there is none."""
    import fcntl

    sock, lock, logf = _paths(target, node_id)
    authkey = _auth_key(sock.parent)
    conn = _try_connect(sock, authkey)
    if conn is not None:
        return conn
    # One relay starts the worker; the others wait on the lock, then connect.
    with open(lock, "a", opener=_no_follow) as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)
        conn = _try_connect(sock, authkey)
        if conn is not None:
            return conn
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()  # a dead worker's socket
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        with open(logf, "ab", opener=_no_follow) as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fedloom.integrations.warm", "--socket", str(sock),
                 "--idle-s", str(idle_s), "--watch-pid", str(os.getppid())],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                start_new_session=True, close_fds=True)
        end = time.monotonic() + start_timeout_s
        while time.monotonic() < end:
            conn = _try_connect(sock, authkey)
            if conn is not None:
                return conn
            if proc.poll() is not None:
                tail = logf.read_text(errors="replace").strip().splitlines()[-1:] or ["-"]
                raise WorkerError(f"worker: exited with {proc.returncode} before listening "
                                  f"({tail[0]}); log {logf}")
            time.sleep(0.05)
        proc.kill()
        raise WorkerError(f"worker: not listening after {start_timeout_s:g} s; log {logf}")


def _ask(target: str, node_id: int, op: str) -> dict[str, Any] | None:
    """Send ``op`` to this node's running worker for ``target``; its answer, ``{}``
    when it went away without one, None when none is running (none is started)."""
    sock, _, _ = _paths(target, node_id)
    conn = _try_connect(sock, _auth_key(sock.parent))
    if conn is None:
        return None
    with conn:
        _send(conn, {"v": PROTOCOL, "op": op})
        try:
            return _recv_header(conn)
        except (EOFError, OSError):
            return {}


def worker_stats(target: str, node_id: int) -> dict[str, Any] | None:
    """What this node's worker for ``target`` has done (pid, messages served, the
    fedloom ClientApp's load counters), or None when none is running."""
    return _ask(target, node_id, "stats")


def stop_worker(target: str, node_id: int) -> bool:
    """Ask this node's worker for ``target`` to exit; False when none was running."""
    return _ask(target, node_id, "stop") is not None


# --------------------------------------------------------------------- worker
def _load_target(target: str) -> ClientApp:
    mod, _, attr = target.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, ClientApp):
        raise TypeError(f"target: {target} is a {type(obj).__name__}, not a ClientApp")
    return obj


class _Worker:
    def __init__(self, sock: Path, idle_s: float, watch_pid: int | None) -> None:
        self.sock, self.idle_s, self.watch_pid = sock, idle_s, watch_pid
        self.apps: dict[str, ClientApp] = {}
        self.served = 0
        self.failed = 0
        self.busy = False
        self.last = time.monotonic()
        self.inode: int | None = None

    def cleanup(self) -> None:
        # only our own socket: a newer worker may have bound the same path
        with contextlib.suppress(OSError):
            if self.inode is not None and self.sock.stat().st_ino == self.inode:
                self.sock.unlink()

    def watchdog(self) -> None:
        while True:
            time.sleep(min(1.0, max(self.idle_s / 4, 0.05)))
            if self.busy:
                continue
            gone = False
            if self.watch_pid:
                try:
                    os.kill(self.watch_pid, 0)
                except ProcessLookupError:
                    gone = True
                except PermissionError:
                    pass
            if gone or time.monotonic() - self.last > self.idle_s:
                log.info("warm worker %d: %s; exiting after %d messages (%d failed)",
                         os.getpid(), "parent gone" if gone else f"idle {self.idle_s:g} s",
                         self.served, self.failed)
                self.cleanup()
                os._exit(0)

    def handle(self, conn: Any) -> bool:
        """One request; False when asked to stop."""
        try:
            h = _recv_header(conn)
        except ValueError as e:
            _send(conn, {"v": PROTOCOL, "ok": False, "error": str(e)})
            return True
        op = h.get("op")
        if op == "stats":
            fl = sys.modules.get("fedloom.integrations.flower.cache")
            _send(conn, {"v": PROTOCOL, "ok": True, "pid": os.getpid(), "served": self.served,
                         "failed": self.failed, "targets": sorted(self.apps),
                         "loads": dict(fl.LOADS) if fl is not None else {}})
            return True
        if op == "stop":
            _send(conn, {"v": PROTOCOL, "ok": True})
            return False
        if op != "call":
            _send(conn, {"v": PROTOCOL, "ok": False, "error": f"op: {op!r} is not known"})
            return True
        msg_b, ctx_b = conn.recv_bytes(), conn.recv_bytes()
        try:
            target = str(h["target"])
            if target not in self.apps:
                self.apps[target] = _load_target(target)
            message = serde.message_from_proto(ProtoMessage.FromString(msg_b))
            context = serde.context_from_proto(ProtoContext.FromString(ctx_b))
            _set_task_identity(h.get("task"))
            t0 = time.perf_counter()
            reply = self.apps[target](message, context)
            log.info("warm worker: %s message %s ran in %.2f s", message.metadata.message_type,
                     message.metadata.message_id[:8], time.perf_counter() - t0)
            out = (serde.message_to_proto(reply).SerializeToString(),
                   serde.recorddict_to_proto(context.state).SerializeToString())
        except Exception as e:  # the target's error goes back to Flower as the relay's
            self.failed += 1
            log.exception("warm worker: message failed")
            why = f"{type(e).__name__}: {e}".splitlines()[0]
            _send(conn, {"v": PROTOCOL, "ok": False, "error": why})
            return True
        self.served += 1
        _send(conn, {"v": PROTOCOL, "ok": True}, *out)
        return True

    def serve(self) -> None:
        from multiprocessing import AuthenticationError
        from multiprocessing.connection import Listener

        authkey = _auth_key(self.sock.parent)
        listener = Listener(str(self.sock), family="AF_UNIX", authkey=authkey)
        self.inode = self.sock.stat().st_ino
        def on_term(*_: Any) -> None:
            self.cleanup()
            os._exit(0)

        signal.signal(signal.SIGTERM, on_term)
        threading.Thread(target=self.watchdog, daemon=True).start()
        log.info("warm worker %d: listening on %s", os.getpid(), self.sock)
        while True:
            try:
                conn = listener.accept()
            except (OSError, EOFError, AuthenticationError) as e:  # wrong key, garbage
                log.warning("warm worker: refused a connection: %s: %s", type(e).__name__, e)
                continue
            self.busy, self.last = True, time.monotonic()
            try:
                with conn:
                    if not self.handle(conn):
                        break
            except (EOFError, OSError) as e:  # the relay went away mid-request
                log.warning("warm worker: connection lost: %s: %s", type(e).__name__, e)
            finally:
                self.busy, self.last = False, time.monotonic()
        listener.close()
        log.info("warm worker %d: stopped after %d messages (%d failed)", os.getpid(),
                 self.served, self.failed)
        self.cleanup()


def _set_task_identity(task: Any) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    if isinstance(task, dict):
        TaskIdentity.task_id = int(task["task_id"])
        TaskIdentity.run_id = int(task["run_id"])
        TaskIdentity.node_id = int(task["node_id"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedloom.integrations.warm",
                                description="the worker of fedloom's warm ClientApp")
    p.add_argument("--socket", required=True)
    p.add_argument("--idle-s", type=float, default=600.0)
    p.add_argument("--watch-pid", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    _Worker(Path(args.socket), args.idle_s, args.watch_pid or None).serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
