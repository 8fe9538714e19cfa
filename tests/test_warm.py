"""The warm ClientApp (fedloom.integrations.warm): a relay hands each message to a
worker that stays up between messages. The worker's replies and Context.state
must be the bytes the target gives when Flower calls it directly; a killed worker
is replaced and the message runs again; faults and bad peers are one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.common import serde
from flwr.supercore.task_identity import TaskIdentity

from fedloom.integrations import warm

# under `pytest -n`: this file's tests on one worker, in order, so that they share the
# module's warm directory and the worker its first test started (each worker started
# imports torch and builds the experiment: a second or more of CPU time)
pytestmark = pytest.mark.xdist_group("warm")

TARGET = "_warm_app:app"
NODE = 7
# SA-PEF Top-k: the residual lives in Context.state, so the state has to make the
# round trip through the worker for round r + 1 to be right.
CFG = {"name": "warm", "seed": 3, "rounds": 3,
       "data": {"name": "digits", "num_clients": 3,
                "partition": {"name": "dirichlet", "options": {"alpha": 1.0}}},
       "model": {"name": "mlp", "options": {"hidden": [16]}}, "cohort": {"size": 3},
       "client": {"lr": 0.1, "batch_size": 16, "epochs": 1},
       "aggregator": {"name": "fedavg"}, "server": {"lr": 1.0},
       "compression": {"name": "topk", "options": {"ratio": 0.05}, "feedback": "sapef",
                       "alpha": 0.85},
       "checkpoint": {"every": 0}}


@pytest.fixture(scope="module")
def warm_dir():
    # a short path: AF_UNIX socket paths are limited to about 100 bytes
    d = Path(tempfile.mkdtemp(prefix="fw"))
    old = os.environ.get("FEDLOOM_WARM_DIR")
    os.environ["FEDLOOM_WARM_DIR"] = str(d)
    yield d
    for sock in d.glob("*.sock"):  # stop every worker this module started
        try:
            from multiprocessing.connection import Client

            with Client(str(sock), family="AF_UNIX", authkey=(d / "key").read_bytes()) as c:
                warm._send(c, {"v": warm.PROTOCOL, "op": "stop"})
                warm._recv_header(c)
        except (OSError, EOFError):
            pass
    if old is None:
        os.environ.pop("FEDLOOM_WARM_DIR", None)
    else:
        os.environ["FEDLOOM_WARM_DIR"] = old
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(autouse=True)
def _task_identity(monkeypatch):
    # what Flower's flwr-clientapp process sets before it calls the app
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", NODE)
    monkeypatch.setattr(TaskIdentity, "_task_id", 11)


def _layout():
    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment
    from fedloom.integrations.flower.cache import _experiment

    exp: Experiment = _experiment(load_config(CFG))
    return exp.layout


def _message(w, k: int, r: int) -> Message:
    from fedloom.integrations.flower import to_arrays

    conf = ConfigRecord({"server-round": r + 1, "fedloom-round": r, "client-id": k, "lr": 0.1})
    m = Message(RecordDict({"arrays": to_arrays(_layout(), w), "config": conf}),
                dst_node_id=NODE, message_type=MessageType.TRAIN)
    m.metadata.__dict__["_message_id"] = f"m{k}-{r}"  # as Flower sets it on arrival
    return m


def _context(**run_config) -> Context:
    return Context(run_id=1, node_id=NODE, node_config={"partition-id": 0},
                   state=RecordDict(), run_config={"fedloom": json.dumps(CFG), **run_config})


def _bytes(reply: Message, ctx: Context) -> tuple[bytes, bytes]:
    """The reply's content and the context's state, serialized as Flower would."""
    return (serde.recorddict_to_proto(reply.content).SerializeToString(),
            serde.recorddict_to_proto(ctx.state).SerializeToString())


def _run(app, rounds: int, **run_config) -> list[tuple[bytes, bytes]]:
    """Client 0 over ``rounds`` rounds; the state carries over as on a SuperNode."""
    ctx = _context(**run_config)
    w = torch.linspace(-0.1, 0.1, _layout().size)
    out = []
    for r in range(rounds):
        reply = app(_message(w, 0, r), ctx)
        assert not reply.has_error(), reply.error
        assert reply.metadata.reply_to_message_id == f"m0-{r}"
        out.append(_bytes(reply, ctx))
        w = w * 0.9
    return out


def test_worker_gives_the_targets_bytes_and_stays_warm(warm_dir):
    """Three rounds through the worker: every reply and every Context.state are the
    bytes of the target called in this process; one worker served all three and
    built the experiment and the client's slice once."""
    from _warm_app import app as direct

    ref = _run(direct, 3)
    assert ref[1][1] != ref[0][1]  # the SA-PEF residual changes: the state matters
    got = _run(warm.warm_client_app(TARGET), 3)
    assert got == ref
    stats = warm.worker_stats(TARGET, NODE)
    assert stats is not None and stats["served"] == 3 and stats["failed"] == 0
    assert stats["loads"] == {"experiment": 1, "client_data": 1}
    assert stats["pid"] != os.getpid()


def test_a_killed_worker_is_replaced_and_the_message_runs_again(warm_dir):
    """Killed between messages, or dying in the middle of one: the relay starts a
    new worker and the result is unchanged (the state lives in Flower's Context)."""
    from _warm_app import app as direct

    ref = _run(direct, 2)
    app = warm.warm_client_app(TARGET)
    assert _run(app, 1) == ref[:1]
    pid = warm.worker_stats(TARGET, NODE)["pid"]
    os.kill(pid, signal.SIGKILL)
    assert _run(app, 2) == ref
    pid2 = warm.worker_stats(TARGET, NODE)["pid"]
    assert pid2 != pid
    flag = warm_dir / "die-once"
    flag.touch()
    assert _run(app, 2, **{"die-once": str(flag)}) == ref  # round 0 died, then ran again
    assert not flag.exists()
    assert warm.worker_stats(TARGET, NODE)["pid"] not in (pid, pid2)


def test_the_targets_error_is_one_line_and_the_worker_goes_on(warm_dir):
    app = warm.warm_client_app(TARGET)
    _run(app, 1)
    before = warm.worker_stats(TARGET, NODE)
    with pytest.raises(warm.WorkerError, match=r"^worker: ValueError: asked to fail$"):
        _run(app, 1, **{"raise": True})
    after = warm.worker_stats(TARGET, NODE)
    assert after["pid"] == before["pid"] and after["failed"] == before["failed"] + 1
    _run(app, 1)


def test_wrong_key_and_garbage_are_refused_and_the_worker_goes_on(warm_dir):
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    app = warm.warm_client_app(TARGET)
    _run(app, 1)
    sock = warm._paths(TARGET, NODE)[0]
    with pytest.raises(AuthenticationError):
        Client(str(sock), family="AF_UNIX", authkey=b"x" * warm.KEY_BYTES)
    key = (warm_dir / "key").read_bytes()
    with Client(str(sock), family="AF_UNIX", authkey=key) as c:
        c.send_bytes(b"\xff not json")
        assert "header: not JSON" in warm._recv_header(c)["error"]
    with Client(str(sock), family="AF_UNIX", authkey=key) as c:
        warm._send(c, {"v": warm.PROTOCOL, "op": "call", "target": TARGET},
                   b"not a protobuf message", b"")
        h = warm._recv_header(c)
        assert not h["ok"] and "DecodeError" in h["error"]
    with Client(str(sock), family="AF_UNIX", authkey=key) as c:
        warm._send(c, {"v": 99, "op": "stats"})
        assert "protocol 99" in warm._recv_header(c)["error"]
    assert (st := warm.worker_stats(TARGET, NODE)) is not None and st["served"] >= 1
    assert (warm_dir / "key").stat().st_mode & 0o777 == 0o600


def test_warm_false_runs_the_target_here_and_starts_no_worker(warm_dir, monkeypatch):
    from _warm_app import app as direct

    monkeypatch.setenv("FEDLOOM_WARM_DIR", str(warm_dir / "other"))
    for app in (warm.warm_client_app(TARGET, warm=False), warm.warm_client_app(TARGET)):
        assert _run(app, 1, warm="false") == _run(direct, 1)
    assert warm.worker_stats(TARGET, NODE) is None
    assert not list((warm_dir / "other").glob("*.sock"))
    with pytest.raises(ValueError, match=r"run_config\.warm: 'maybe'"):
        _run(warm.warm_client_app(TARGET), 1, warm="maybe")
    with pytest.raises(ValueError, match="target: 'nocolon'"):
        warm.warm_client_app("nocolon")


def test_a_warm_dir_open_to_others_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "open"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    monkeypatch.setenv("FEDLOOM_WARM_DIR", str(d))
    with pytest.raises(warm.WorkerError, match=r"^FEDLOOM_WARM_DIR: .*closed to others"):
        warm.warm_dir()
    d.chmod(0o700)
    assert warm.warm_dir() == d


def test_an_edited_source_file_selects_a_new_worker(tmp_path, monkeypatch):
    """The worker is keyed by the target's package files (and fedloom's): an edit
    starts a fresh worker instead of serving stale code; another node or target
    gets its own."""
    pkg = tmp_path / "wpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "app.py").write_text("app = None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    k1 = warm.worker_key("wpkg.app:app", 1)
    assert warm.worker_key("wpkg.app:app", 1) == k1
    assert warm.worker_key("wpkg.app:app", 2) != k1
    assert warm.worker_key("wpkg.other:app", 1) != k1
    (pkg / "app.py").write_text("app = 1\n")  # another size
    assert warm.worker_key("wpkg.app:app", 1) != k1
    k2 = warm.worker_key("wpkg.app:app", 1)
    os.utime(pkg / "app.py", ns=(1, 1))  # same size, another mtime
    assert warm.worker_key("wpkg.app:app", 1) != k2


def test_an_idle_worker_exits_and_removes_its_socket(warm_dir):
    """No message for idle_s: the worker exits (a stats request loads no target and
    so no torch, which keeps this quick)."""
    conn = warm._connect("idle_target:app", NODE, idle_s=0.3, start_timeout_s=600)
    with conn:
        warm._send(conn, {"v": warm.PROTOCOL, "op": "stats"})
        pid = warm._recv_header(conn)["pid"]
    sock = warm._paths("idle_target:app", NODE)[0]
    # generous bounds (a loaded machine delays the watchdog's 0.075 s ticks), each named
    end = time.monotonic() + 60
    while time.monotonic() < end and sock.exists():
        time.sleep(0.1)
    assert not sock.exists(), f"worker {pid}: socket still there 60 s after its idle 0.3 s"
    end = time.monotonic() + 60
    while time.monotonic() < end and _running(pid):
        time.sleep(0.1)
    assert not _running(pid), f"worker {pid} still running 60 s after its idle time"


def test_stop_worker_stops_it_and_says_when_none_runs(warm_dir):
    warm._connect("stop_target:app", NODE, idle_s=600, start_timeout_s=600).close()
    pid = warm.worker_stats("stop_target:app", NODE)["pid"]
    assert warm.stop_worker("stop_target:app", NODE)
    end = time.monotonic() + 60
    while time.monotonic() < end and _running(pid):
        time.sleep(0.1)
    assert not _running(pid), f"worker {pid} still running 60 s after it was asked to stop"
    assert not warm._paths("stop_target:app", NODE)[0].exists()
    assert not warm.stop_worker("stop_target:app", NODE)
    assert warm.worker_stats("stop_target:app", NODE) is None


def _running(pid: int) -> bool:
    """Alive and not a zombie (this process started the worker and may not have
    reaped it yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_relay_imports_no_torch():
    """What Flower's per-message process loads (the example's ClientApp module) stays
    free of torch, and the lazy package still hands out every public name."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    code = ("import sys; sys.path.insert(0, 'examples/flower'); "
            "import fedloom, fedloom_flower.client_app; print('torch' in sys.modules); "
            "[getattr(fedloom, n) for n in fedloom.__all__]; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, timeout=600, check=True).stdout.split()
    assert out == ["False", "True"]
