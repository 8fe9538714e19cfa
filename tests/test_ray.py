"""The Ray backend: same bits as sequential, and a worker that dies mid-round.

A local Ray instance (2 CPUs, loopback) is started for this module and shut
down after it; the tests skip where Ray is not installed (``fedloom[ray]``).
"""

from __future__ import annotations

import dataclasses

import pytest

import fedloom
from conftest import TINY

# under `pytest -n`: every test of this file on one worker, with the other Ray/Flower
# simulations, so two Ray clusters never compete for the two cores
pytestmark = pytest.mark.xdist_group("ray")

ray = pytest.importorskip("ray")

EF = ["compression.name=topk", "compression.options.ratio=0.1", "compression.feedback=sapef"]


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    assert [n["NodeManagerAddress"] for n in ray.nodes()] == ["127.0.0.1"]
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def sequential():
    return fedloom.run(TINY, ["dtype=float64", *EF])


def test_ray_same_model_sha256(sequential):
    res = fedloom.run(TINY, ["dtype=float64", "backend=ray", "backend.options.workers=2", *EF])
    assert res.summary["model_sha256"] == sequential.summary["model_sha256"]
    assert ray.is_initialized()  # joined the fixture's instance, left it running


def test_dead_worker_is_retried(sequential, tmp_path, monkeypatch):
    marker = tmp_path / "killed"
    client = 4  # in round 1's cohort of TINY only
    monkeypatch.setenv("FEDLOOM_KILL_ONCE", f"{client}:{marker}")
    res = fedloom.run(TINY, ["dtype=float64", "backend=ray", "backend.options.workers=2",
                             "backend.options.on_failure=retry", *EF])
    assert marker.exists()  # a worker really was killed
    assert res.summary["model_sha256"] == sequential.summary["model_sha256"]
    assert all(m["dropped_clients"] == 0 for m in res.metrics)


def test_dead_worker_clients_are_dropped(sequential, tmp_path, monkeypatch):
    marker = tmp_path / "killed"
    monkeypatch.setenv("FEDLOOM_KILL_ONCE", f"4:{marker}")
    res = fedloom.run(TINY, ["dtype=float64", "backend=ray", "backend.options.workers=2",
                             "backend.options.on_failure=drop", *EF])
    assert marker.exists()
    dropped = [m.get("dropped_client_ids", []) for m in res.metrics]
    assert 4 in dropped[0] and 0 < len(dropped[0]) < 4  # the killed task's group only
    assert dropped[1:] == [[], []]
    assert res.metrics[0]["cohort_size"] == 4
    assert res.summary["model_sha256"] != sequential.summary["model_sha256"]
    # nothing of the dropped clients was aggregated; the run finished every round
    assert len(res.metrics) == TINY["rounds"]


def test_ray_float32_is_single_thread_sequential():
    """Ray's workers run one thread each: a float32 run has the bits of the
    sequential backend at one thread (and differs from two threads only by
    what the thread count changes)."""
    import torch

    res = fedloom.run(TINY, ["backend=ray", "backend.options.workers=2", *EF])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fedloom.run(TINY, EF)
    finally:
        torch.set_num_threads(threads)
    assert res.summary["model_sha256"] == one.summary["model_sha256"]


def test_unreachable_cluster_is_a_one_line_config_error():
    from fedloom.config import ConfigError

    for address, msg in (("127.0.0.1:1", "cannot reach the Ray cluster at 127.0.0.1:1"),
                         ("nonsense", "expected HOST:PORT")):
        with pytest.raises(ConfigError, match=msg):
            fedloom.run(TINY, ["backend=ray", f"backend.options.address={address}"])


def test_gpus_or_threads_beyond_the_cluster_are_one_line_config_errors():
    """Ray would wait forever for a task's resources the cluster lacks: refused,
    naming the key (the fixture's cluster: 2 CPUs, no GPU here)."""
    from fedloom.config import ConfigError

    gpus = ray.cluster_resources().get("GPU", 0)
    with pytest.raises(ConfigError,
                       match=r"^backend.options.gpus_per_worker: .* the Ray cluster has"):
        fedloom.run(TINY, ["backend=ray", f"backend.options.gpus_per_worker={gpus + 0.5}"])
    with pytest.raises(ConfigError, match=r"^backend.threads: 3 CPUs a task, the Ray cluster"):
        fedloom.run(TINY, ["backend=ray", "backend.threads=3"])
    assert ray.is_initialized()  # the fixture's instance is left running


def test_ray_summary_records_worker_threads():
    res = fedloom.run(TINY, ["backend=ray", "backend.options.workers=2", "rounds=1"])
    assert res.summary["worker_threads"] == 1


@pytest.mark.parametrize("extra", [
    ["compression.name=topk", "compression.options.ratio=0.1"], []], ids=["topk", "identity"])
def test_ray_tasks_do_their_clients_uplink(monkeypatch, early_calls, extra):
    """With a pure compressor and the plain feedback policy, each Ray task takes
    its clients' norms and encodes their updates (Top-k: the payload comes back
    with the result; the float32 identity: the norm only, the parent encodes), and
    each group's results are handed over as its task returns. The run is the
    sequential one with the cohort handed over at once, model and metrics."""
    import json

    from fedloom.engine.trainers.backends import SequentialBackend

    with monkeypatch.context() as mp:
        mp.setattr(SequentialBackend, "capabilities", dataclasses.replace(
            SequentialBackend.capabilities, streams=False))
        ref = fedloom.run(TINY, ["dtype=float64", *extra])
    assert not early_calls
    res = fedloom.run(TINY, ["dtype=float64", "backend=ray", "backend.options.workers=2", *extra])
    sent = [(s is not None, s is not None and s.payload is not None) for _, s in early_calls]
    assert len(sent) == TINY["rounds"] * TINY["cohort"]["size"]
    assert all(s for s, _ in sent)  # every norm taken by a task
    # float64 identity is no in-place float32 row: the tasks encode it as well
    assert all(p for _, p in sent)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    wall = ("train_s", "agg_s", "wall_s")
    assert ([json.dumps({k: v for k, v in m.items() if k not in wall}) for m in res.metrics]
            == [json.dumps({k: v for k, v in m.items() if k not in wall}) for m in ref.metrics])
