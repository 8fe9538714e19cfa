"""Every backend gives the sequential backend's results (float64: the same bits).

The configs have ragged client sizes (Dirichlet), partial participation (4 of
10 per round) and, in one case, Top-k with error feedback.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import fedloom
from conftest import TINY
from fedloom.engine.trainers.backends import balanced_groups
from fedloom.job import local_job

EF = ["compression.name=topk", "compression.options.ratio=0.1", "compression.feedback=ef"]


def _at_once(monkeypatch: pytest.MonkeyPatch, extra: list[str]):
    """TINY on the sequential backend with the cohort's results handed over at once
    after training (no early uplink, every update a fresh vector): the reference the
    streamed paths (process workers, the sequential backend's own) must equal."""
    from fedloom.engine.trainers.backends import SequentialBackend

    with monkeypatch.context() as mp:
        mp.setattr(SequentialBackend, "capabilities", dataclasses.replace(
            SequentialBackend.capabilities, streams=False))
        return fedloom.run(TINY, extra)


# every client variant under the sequential inner backend; under vmap the one that
# exercises the most (compression with client state): the other two said the same
@pytest.mark.parametrize(("inner", "extra"), [
    ("sequential", []), ("sequential", EF), ("sequential", ["client.method=scaffold"]),
    ("vmap", EF)], ids=["sequential-plain", "sequential-topk_ef", "sequential-scaffold",
                        "vmap-topk_ef"])
def test_process_backend_same_bits(extra, inner):
    """Workers running ``inner`` give ``backend=inner``'s bits (vmap's own agreement
    with sequential is tested in test_vmap.py)."""
    ref = fedloom.run(TINY, ["dtype=float64", f"backend={inner}", *extra])
    res = fedloom.run(TINY, ["dtype=float64", "backend=process", "backend.options.workers=2",
                             f"backend.options.inner={inner}", *extra])
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    assert [m["uplink_bytes"] for m in res.metrics] == [m["uplink_bytes"] for m in ref.metrics]


def test_process_backend_uplinks_each_client_as_it_arrives(monkeypatch, early_calls):
    """Plain FedAvg, identity compressor: the parent screens, encodes and decodes
    each client's update as its worker sends it, while the others still train
    (EarlyUplink), and the run is the sequential one, metrics included. With the
    ratio bound tight, clients are refused by the cohort's median after their
    early work was done: it is discarded and their rows are zeroed."""
    seen = early_calls
    wall = ("train_s", "agg_s", "wall_s")
    for extra in ([], ["server.max_norm_ratio=1.05"]):
        seen.clear()
        ref = _at_once(monkeypatch, ["dtype=float64", *extra])
        assert not seen  # the reference hands the cohort over at once
        res = fedloom.run(TINY, ["dtype=float64", "backend=process", "backend.options.workers=2",
                                 *extra])
        assert len(seen) == TINY["rounds"] * TINY["cohort"]["size"]
        assert res.summary["model_sha256"] == ref.summary["model_sha256"]
        assert ([{k: v for k, v in m.items() if k not in wall} for m in res.metrics]
                == [{k: v for k, v in m.items() if k not in wall} for m in ref.metrics])
        if extra:
            assert sum(m.get("rejected_updates", 0) for m in res.metrics) > 0


def test_process_backend_runs_lockstep_in_its_workers():
    """``backend.options.inner: lockstep``: each worker trains its group lock-step (the TINY
    MLP is lock-step's), and the run has the sequential backend's bits in float64."""
    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment
    from fedloom.engine.trainers.lockstep import LockstepBackend
    from fedloom.engine.trainers.parallel import make_inner

    exp = Experiment.from_config(load_config(TINY, ["dtype=float64"]))
    inner = make_inner(exp.trainer, exp.algorithm.method, "lockstep", 0, exp.x, exp.y)
    exp.close()
    assert isinstance(inner, LockstepBackend) and inner.enabled and inner.x is exp.x
    ref = fedloom.run(TINY, ["dtype=float64", "backend=sequential"])
    res = fedloom.run(TINY, ["dtype=float64", "backend=process", "backend.options.workers=2",
                             "backend.options.inner=lockstep"])
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]


def test_process_backend_float32_is_single_thread_sequential():
    """float32: the workers run one thread each, so they give the bits of the
    sequential backend at one thread; against two threads here they differ by
    exactly what the thread count changes (measured: 3e-8 after 3 rounds)."""
    b = fedloom.run(TINY, ["backend=process", "backend.options.workers=2"])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fedloom.run(TINY, [])
    finally:
        torch.set_num_threads(threads)
    assert b.summary["model_sha256"] == one.summary["model_sha256"]
    a = fedloom.run(TINY, ["backend.threads=2"])  # two threads, whatever this process has
    assert torch.allclose(a.w, b.w, rtol=1e-5, atol=1e-6)


def test_balanced_groups_cover_every_job_once():
    jobs = [local_job(k, 0, torch.zeros(1), 0.1, torch.zeros(n, 1), torch.zeros(n), 0)
            for k, n in enumerate([50, 10, 10, 30, 5, 5])]
    groups = balanced_groups(jobs, 3)
    assert sorted(i for g in groups for i in g) == list(range(6))
    loads = [sum(int(jobs[i].y.shape[0]) for i in g) for g in groups]
    assert sorted(loads) == [30, 30, 50]  # LPT: 50 | 30 | 10+10+5+5
    assert len(balanced_groups(jobs, 10)) == 6  # never more groups than jobs


def test_backend_section_shorthand():
    from fedloom.config import load_config

    cfg = load_config(TINY, ["backend=process", "backend.options.workers=3"])
    assert (cfg.backend.name, cfg.backend.options) == ("process", {"workers": 3})
    cfg = load_config({**TINY, "backend": "vmap"}, ["backend.options.chunk=5"])
    assert (cfg.backend.name, cfg.backend.options) == ("vmap", {"chunk": 5})
    cfg = load_config(TINY, ["backend.options.workers=2", "backend=ray"])
    assert (cfg.backend.name, cfg.backend.options) == ("ray", {"workers": 2})


@pytest.mark.parametrize("policy", ["retry", "drop"])
def test_process_worker_death(tmp_path, monkeypatch, policy):
    """A worker killed (SIGKILL) in round 1: retried, the run is the sequential one;
    dropped, round 1 goes on without the unfinished clients and the run finishes."""
    marker = tmp_path / "killed"
    monkeypatch.setenv("FEDLOOM_KILL_ONCE", f"4:{marker}")  # client 4: round 1 only
    over = ["dtype=float64", "backend=process", "backend.options.workers=2",
            f"backend.options.on_failure={policy}", *EF]
    res = fedloom.run(TINY, over)
    assert marker.exists()
    ref = fedloom.run(TINY, ["dtype=float64", *EF])
    dropped = [m.get("dropped_client_ids", []) for m in res.metrics]
    if policy == "retry":
        assert res.summary["model_sha256"] == ref.summary["model_sha256"]
        assert dropped == [[], [], []]
    else:
        assert 4 in dropped[0] and dropped[1:] == [[], []]
        assert len(res.metrics) == TINY["rounds"]


@pytest.mark.parametrize("inner", ["sequential", "lockstep"])
def test_process_workers_write_the_server_rows_float32(monkeypatch, inner):
    """float32, identity compressor: each worker writes its client's update into the
    server's row (shared memory) and the parent neither copies nor serialises it
    (InPlacePayload: the bytes counted are the identity payload's); the run is the
    sequential one at one thread, every metric but the times, refusals and server
    clipping included. The size rules read the norms the workers took (no second
    pass over the rows in the parent), and clip by them to the same bits.
    Lock-step workers hand their group's results over together, each one passed on
    as a sequential worker's is."""
    import fedloom.engine.stages.receive as receive_mod
    from fedloom.compress.identity import InPlacePayload
    from fedloom.engine.trainers.parallel import ProcessBackend

    made: list[int] = []
    init = InPlacePayload.__init__

    def spy(self, row, checksum):
        made.append(row.numel())
        init(self, row, checksum)

    monkeypatch.setattr(InPlacePayload, "__init__", spy)
    adopted: list[bool] = []
    train = ProcessBackend.train_cohort

    def spy_train(self, jobs, on_result=None):
        out = train(self, jobs, on_result)
        rows = on_result.rows if on_result is not None else None
        adopted.append(rows is not None and self._shared.rows.data_ptr() == rows.data_ptr())
        return out

    monkeypatch.setattr(ProcessBackend, "train_cohort", spy_train)
    passes: list[int] = []
    norms = receive_mod.row_norms

    def spy_norms(rows):
        passes.append(len(rows))
        return norms(rows)

    monkeypatch.setattr(receive_mod, "row_norms", spy_norms)
    wall = ("train_s", "agg_s", "wall_s")
    threads = torch.get_num_threads()
    for extra in ([], ["server.max_norm_ratio=1.05"], ["server.clip_norm=0.02"]):
        made.clear()
        adopted.clear()
        passes.clear()
        try:
            torch.set_num_threads(1)
            ref = _at_once(monkeypatch, extra)
        finally:
            torch.set_num_threads(threads)
        assert not made
        ref_passes = len(passes)
        res = fedloom.run(TINY, ["backend=process", "backend.options.workers=2",
                                 f"backend.options.inner={inner}", *extra])
        assert adopted and all(adopted)
        assert ref_passes > 0 and len(passes) == ref_passes  # none in the process run
        assert len(made) == TINY["rounds"] * TINY["cohort"]["size"]
        assert res.summary["model_sha256"] == ref.summary["model_sha256"]
        assert ([{k: v for k, v in m.items() if k not in wall} for m in res.metrics]
                == [{k: v for k, v in m.items() if k not in wall} for m in ref.metrics])
        if extra and "max_norm_ratio" in extra[0]:
            assert sum(m.get("rejected_updates", 0) for m in res.metrics) > 0
        if extra and "clip_norm" in extra[0]:
            assert sum(m["clipped_updates"] for m in res.metrics) > 0


@pytest.mark.parametrize("extra", [
    ["compression.name=topk", "compression.options.ratio=0.1"],
    ["compression.name=qsgd"],
    ["compression.name=topk", "compression.options.ratio=0.1", "client.lr=1e20"]],
    ids=["topk", "qsgd", "topk-diverged"])
def test_process_workers_encode_their_clients_updates(monkeypatch, early_calls, extra):
    """A pure compressor and the plain feedback policy: each worker takes its
    client's norm and encodes its update where it was trained (ClientSide, the
    client's own generator), and the parent only decodes; the run is the sequential
    one at one thread, metrics included. Diverged clients (non-finite updates) are
    not encoded by their workers, and are refused and counted as on the sequential
    backend."""
    wall = ("train_s", "agg_s", "wall_s")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ref = _at_once(monkeypatch, extra)
    finally:
        torch.set_num_threads(threads)
    assert not early_calls
    res = fedloom.run(TINY, ["backend=process", "backend.options.workers=2", *extra])
    sent = [s is not None and s.payload is not None for _, s in early_calls]
    assert len(sent) == TINY["rounds"] * TINY["cohort"]["size"]
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    # as JSON: a diverged run's NaN losses compare equal there
    assert ([json.dumps({k: v for k, v in m.items() if k not in wall}) for m in res.metrics]
            == [json.dumps({k: v for k, v in m.items() if k not in wall}) for m in ref.metrics])
    rejected = sum(m.get("rejected_updates", 0) for m in res.metrics)
    if "client.lr=1e20" in extra:
        assert rejected > 0 and not all(sent)
    else:
        assert rejected == 0 and all(sent)


def test_process_workers_follow_the_server_rows_as_the_cohort_grows():
    """The server's rows handed to the workers are a view of a buffer that holds the
    largest cohort so far: a round with more clients than the first one handed over
    (the same buffer, more of it) gives the workers the larger view, and every update
    lands in its own row of it."""
    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment

    exp = Experiment.from_config(load_config(TINY, ["backend=process",
                                                    "backend.options.workers=2"]))
    try:
        jobs = exp.plan_round(exp.init()).jobs
        assert len(jobs) >= 4
        big = torch.zeros((len(jobs), exp.layout.size)).share_memory_()

        class Sink:
            client_side = None  # nothing of the uplink done in the workers

            def __init__(self, rows):
                self.rows = rows

            def __call__(self, i, res, sent=None):
                pass

        for m in (2, len(jobs)):
            out = exp.backend.train_cohort(jobs[:m], on_result=Sink(big[:m]))
            assert [r.update.data_ptr() for r in out] == [big[j].data_ptr() for j in range(m)]
            assert all(bool(big[j].abs().sum() > 0) for j in range(m))
    finally:
        exp.close()


def test_process_workers_read_the_rounds_model_from_shared_memory():
    """A cohort whose jobs all carry the round's model gets it through one shared
    buffer (not a pickled copy a group); jobs with models of their own (stale models,
    as under asynchronous aggregation) carry theirs. Either way, and alternating, every
    update is the sequential backend's, bit for bit in float64."""
    import dataclasses

    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment

    ref = Experiment.from_config(load_config(TINY, ["dtype=float64"]))
    exp = Experiment.from_config(load_config(TINY, ["dtype=float64", "backend=process",
                                        "backend.options.workers=2"]))
    try:
        jobs = ref.plan_round(ref.init()).jobs  # with their samples, for both
        w = jobs[0].w
        own = [dataclasses.replace(j, w=w + 0.01 * (k + 1)) for k, j in enumerate(jobs)]
        for cohort in (jobs, own, jobs):
            got = exp.backend.train_cohort(cohort)
            want = ref.backend.train_cohort(cohort)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a.update, b.update)
            assert exp.backend._shared.w is not None and exp.backend._shared.w.is_shared()
            assert exp.backend._shared.w.data_ptr() != w.data_ptr()  # a copy the workers hold
        assert not torch.equal(got[0].update, exp.backend.train_cohort(own)[0].update)
    finally:
        exp.close()
        ref.close()


@pytest.mark.parametrize("extra", [
    [], ["server.max_norm_ratio=1.05"], ["server.clip_norm=0.02"], ["dtype=float64"],
    ["compression.name=topk", "compression.options.ratio=0.1"],
    ["compression.name=topk", "compression.options.ratio=0.1", "client.lr=1e20"],
    ["client.method=scaffold"], EF],
    ids=["plain", "ratio", "clip", "float64", "topk", "topk-diverged", "scaffold", "topk_ef"])
def test_sequential_backend_streams_to_the_same_bits(monkeypatch, early_calls, extra):
    """The sequential backend hands each result over as it is trained and plain
    local SGD writes its update into the server's row (float32 identity: the
    payload read in place, InPlacePayload). The run is the one with the cohort
    handed over at once, model and every metric but the times, with refusals,
    clipping, compression, a diverged client, a method with state rows (SCAFFOLD) and
    error feedback (which the early uplink leaves to the round)."""
    from fedloom.compress.identity import InPlacePayload

    seen = early_calls
    made: list[int] = []
    init = InPlacePayload.__init__

    def spy_payload(self, row, checksum):
        made.append(row.numel())
        init(self, row, checksum)

    monkeypatch.setattr(InPlacePayload, "__init__", spy_payload)
    wall = ("train_s", "agg_s", "wall_s")
    ref = _at_once(monkeypatch, extra)
    assert not seen and not made
    res = fedloom.run(TINY, extra)
    n = TINY["rounds"] * TINY["cohort"]["size"]
    assert len(seen) == (0 if extra == EF else n)
    # SCAFFOLD trains as plain SGD does and keeps its rows after (LocalMethod.complete),
    # so its update too is written into the server's row
    plain32 = not any(e.startswith(("compression", "dtype")) for e in extra)
    assert len(made) == (n if plain32 else 0)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    # as JSON: a diverged run's NaN losses compare equal there
    assert ([json.dumps({k: v for k, v in m.items() if k not in wall}) for m in res.metrics]
            == [json.dumps({k: v for k, v in m.items() if k not in wall}) for m in ref.metrics])
    if "client.lr=1e20" in extra:
        assert sum(m.get("rejected_updates", 0) for m in res.metrics) > 0
