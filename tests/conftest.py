from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import signal
import subprocess
import sys
import threading
from typing import Any

# Ray (backend=ray, Flower's simulation) on loopback only: without this Ray
# advertises the machine's first non-loopback address. Set before ray is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")


def _worker_threads() -> int | None:
    """Under ``pytest -n N``: the cores per pytest worker (at least 1), else None.

    Each worker otherwise takes torch's default of one intra-op thread per core, so
    ``-n auto`` runs cores² threads on the cores; on the test configs' small tensors
    the threads then mostly wait on one another (measured on 2 busy cores: a tiny
    3-round run 0.6 s at 2 threads against 0.1 s at 1)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers <= 0:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // workers)


# Set before torch is imported, so that the subprocesses a test starts (a CLI run
# compared with an in-process one) take the same count; an explicit setting wins.
if (_THREADS := _worker_threads()) is not None:
    os.environ.setdefault("OMP_NUM_THREADS", str(_THREADS))

import pytest  # noqa: E402
import torch  # noqa: E402

if _THREADS is not None and os.environ["OMP_NUM_THREADS"] == str(_THREADS):
    torch.set_num_threads(_THREADS)  # in case a plug-in imported torch first

# A tiny experiment: digits (1797 samples), 10 clients, 3 rounds, a small MLP.
TINY: dict[str, Any] = {
    "name": "tiny",
    "seed": 3,
    "rounds": 3,
    "data": {
        "name": "digits",
        "num_clients": 10,
        "partition": {"name": "dirichlet", "options": {"alpha": 0.5, "min_samples": 20}},
    },
    "model": {"name": "mlp", "options": {"hidden": [16]}},
    "cohort": {"size": 4},
    "client": {"lr": 0.1, "batch_size": 16, "epochs": 1},
    "eval": {"every": 1},
    "checkpoint": {"every": 1},
}


# The devices a device-agnostic test runs on: the CPU always, CUDA when there is
# one (marked `cuda`, so `pytest -m cuda` selects the GPU variants; skipped without).
devices = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]),
]


@pytest.fixture(params=devices)
def device(request: pytest.FixtureRequest) -> str:
    """Each available device in turn (see ``devices``)."""
    return request.param


@pytest.fixture
def tiny() -> dict[str, Any]:
    return copy.deepcopy(TINY)


@pytest.fixture
def early_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, Any]]:
    """Every call of the early uplink (:class:`fedloom.engine.stages.uplink.EarlyUplink`)
    while the test runs, as ``(cohort position, what the worker sent or None)``;
    each call is then made as usual."""
    from fedloom.engine.stages.uplink import EarlyUplink

    calls: list[tuple[int, Any]] = []
    call = EarlyUplink.__call__

    def spy(self: EarlyUplink, i: int, res: Any, sent: Any = None) -> None:
        calls.append((i, sent))
        call(self, i, res, sent)

    monkeypatch.setattr(EarlyUplink, "__call__", spy)
    return calls


def stop_and_resume(config, overrides, out, stop_after=2):
    """Run, stop after round ``stop_after`` (a KeyboardInterrupt from a callback), resume;
    return (uninterrupted result, resumed result)."""
    import fedloom

    ref = fedloom.run(config, overrides)

    def stop(state, metrics):
        if state.next_round == stop_after:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fedloom.run(config, overrides, out=out, callbacks=[stop])
    return ref, fedloom.run(config, overrides, out=out, resume=True)


def round_with_a_nan_client(exp, position=1, index=3):
    """One round of ``exp`` where the client at cohort position ``position`` sends a NaN
    at coordinate ``index``; return (new state, metrics) after checking the round
    rejected and counted that one client and applied a finite model."""
    inner = exp.backend

    class Poisoned:
        def train_cohort(self, jobs):
            res = inner.train_cohort(jobs)
            res[position].update[index] = float("nan")
            return res

    exp.backend = Poisoned()
    new, m = exp.round(exp.init())
    assert m["rejected_updates"] == 1
    assert m["rejected_clients"] == [int(exp.sample_cohort(0)[position])]
    assert m["rejected_rounds"] == 0 and torch.isfinite(new.w).all()
    return new, m


_CLI_LOCK = threading.Lock()
_SUBPROCESS_RUN = subprocess.run


def cli_in_process(cmd, env=None, cwd=None, **kwargs):
    """A stand-in for ``subprocess.run`` of ``python -m fedloom.cli ARGS``: the same
    command through ``fedloom.cli.main`` in this process, one at a time, in ``cwd``,
    with one intra-op thread when ``env`` sets ``OMP_NUM_THREADS=1`` (as a sweep's runs
    do), and fedloom's log lines on stderr as the command writes them. Returns what
    ``subprocess.run(..., capture_output=True, text=True)`` would. Patched in as
    ``subprocess.run``, any other command runs as before."""
    from fedloom import cli

    if list(cmd[:3]) != [sys.executable, "-m", "fedloom.cli"]:
        return _SUBPROCESS_RUN(cmd, env=env, cwd=cwd, **kwargs)
    out, err = io.StringIO(), io.StringIO()
    log = logging.StreamHandler(err)
    log.setFormatter(logging.Formatter("fedloom: %(message)s"))  # cli.main's basicConfig
    root = logging.getLogger()
    with _CLI_LOCK, contextlib.chdir(cwd or os.getcwd()):
        threads = torch.get_num_threads()
        if env and env.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        root.addHandler(log)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = cli.main(list(cmd[3:]))
                except SystemExit as e:  # argparse's exits
                    rc = e.code if isinstance(e.code, int) else 1
        finally:
            root.removeHandler(log)
            torch.set_num_threads(threads)
    return subprocess.CompletedProcess(list(cmd), rc, out.getvalue(), err.getvalue())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dist loadgroup``: the ``xdist_group`` suffix on each marked test's id, where
    pytest-xdist's own could not put it. pytest-xdist (3.8) writes the suffixed id to
    ``item._nodeid``, which pytest 9 no longer reads (the id is ``item._id``), so every
    group was silently ignored: the "ray" tests ran on both workers at once, two Ray
    clusters on the two cores, and test_ray.py's module cluster was started twice."""
    if not getattr(config.option, "loadgroup", False):
        return
    try:
        from _pytest.nodeid import NodeId
    except ImportError:  # pytest before 9: pytest-xdist's suffix works
        return
    for item in items:
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                 for m in item.iter_markers("xdist_group")}
        if names and "@" not in item.nodeid and hasattr(item, "_id"):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(names))}")


# The strategies' node_timeout in the Flower simulations: a ceiling, not a wait. The
# client-id ask ends when every node has answered (the nodes are ready: Ray's actors
# started, each node's app loaded), so this bounds only a start that never ends and
# its expiry says what it waited for. On 2 cores kept busy by other processes that
# start took longer than the strategies' default of 120 s (issue #59).
FLOWER_NODE_TIMEOUT_S = 900.0


def flower_simulation(server_app, client_app, num_supernodes: int) -> None:
    """Flower's ``run_simulation`` on Ray with 2 CPUs, one per client, no dashboard.

    Ray is started here, in the calling thread, before Flower starts its own
    threads (Flower's backend uses a Ray that is already up, as its
    ``init_ray`` says): Ray forks its head processes with a ``preexec_fn``, and a
    fork made while another thread holds an OpenSSL lock left the child
    waiting on that lock for ever (seen once, in ``SSL_CTX_free`` after the fork).
    The runtime environment is Flower's own (the driver's ``sys.path`` for the
    workers)."""
    import ray
    from flwr.simulation import run_simulation

    if not ray.is_initialized():
        pythonpath = os.pathsep.join(sys.path)
        if os.environ.get("PYTHONPATH"):
            pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
        ray.init(num_cpus=2, include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    try:
        run_simulation(server_app=server_app, client_app=client_app,
                       num_supernodes=num_supernodes,
                       backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                       "init_args": {"num_cpus": 2,
                                                     "include_dashboard": False}})
    finally:
        if ray.is_initialized():
            ray.shutdown()


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise TimeoutError in this (the main) thread after ``seconds``: an input that
    is not refused (10**12 rounds run, a runaway expansion) fails the test instead of
    stalling the suite."""
    def stop(signum, frame):
        raise TimeoutError(f"not refused within {seconds} s")

    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
