"""The vmap backend gives the sequential backend's results."""

import pytest
import torch

import fedloom
from fedloom.config import load_config
from fedloom.engine.experiment import Experiment

SYN = {"name": "syn", "seed": 2, "rounds": 3,
       "data": {"name": "synthetic", "num_clients": 8, "partition": {"name": "natural"},
                "max_samples": 3000},
       "model": {"name": "mlp", "options": {"hidden": [12]}}, "cohort": {"size": 4},
       "client": {"lr": 0.05, "batch_size": 16, "epochs": 1}, "checkpoint": {"every": 0}}


@pytest.mark.parametrize("extra", [
    [],
    ["client.momentum=0.9", "client.weight_decay=0.001", "client.prox_mu=0.1"],
    ["client.steps=7"],
    ["compression.name=topk", "compression.options.ratio=0.2", "compression.feedback=sapef"],
    ["compression.name=topk", "compression.options.ratio=0.2", "compression.options.scope=tensor",
     "compression.feedback=flare", "compression.feedback.options.tau=0.5"],
    ["compression.name=topk", "compression.options.ratio=0.2", "compression.feedback=scafcom"],
])
def test_vmap_matches_sequential_in_float64(extra):
    a = fedloom.run(SYN, ["dtype=float64", *extra])
    b = fedloom.run(SYN, ["dtype=float64", "backend=vmap", *extra])
    assert torch.allclose(a.w, b.w, rtol=0, atol=1e-12)
    assert [m["cohort_size"] for m in a.metrics] == [m["cohort_size"] for m in b.metrics]


def test_vmap_float32_tolerance_and_chunks():
    a = fedloom.run(SYN, ["rounds=2"])
    b = fedloom.run(SYN, ["rounds=2", "backend=vmap"])
    # float32: agreement to float32 rounding of the training arithmetic
    assert torch.allclose(a.w, b.w, rtol=1e-5, atol=1e-6)
    exp = Experiment.from_config(load_config(SYN, ["backend=vmap", "dtype=float64"]))
    exp.backend.chunk = 3  # a cohort of 4 in chunks of 3 and 1
    st, _ = exp.round(exp.init())
    ref = Experiment.from_config(load_config(SYN, ["dtype=float64"]))
    st2, _ = ref.round(ref.init())
    assert torch.allclose(st.w, st2.w, rtol=0, atol=1e-12)


def test_auto_backend_measures_then_keeps_the_faster(tiny):
    # a cohort of 4 on 2 workers, on a CPU: sequential, lockstep, process and
    # process+lockstep are timed (vmap only on a GPU); real timings, real pools
    exp = Experiment.from_config(
        load_config(SYN, ["backend=auto", "backend.options.workers=2", "dtype=float64"]))
    assert exp.backend.name == "auto"
    st, _ = exp.round(exp.init())
    assert set(exp.backend.times) == {"sequential", "lockstep", "process", "process+lockstep"}
    assert exp.backend.name == min(exp.backend.times, key=exp.backend.times.get)
    ref = Experiment.from_config(load_config(SYN, ["dtype=float64"]))
    st2, _ = ref.round(ref.init())
    assert torch.equal(st.w, st2.w)  # the first cohort's results are the sequential ones
    st, _ = exp.round(st)  # the chosen backend runs on
    st2, _ = ref.round(st2)
    assert torch.allclose(st.w, st2.w, rtol=0, atol=1e-12)
    exp.close()
    ditto = Experiment.from_config(load_config(tiny, ["backend=auto", "backend.options.workers=1",
                                          "client.method=ditto"]))
    ditto.round(ditto.init())
    assert ditto.backend.name == "sequential"  # no lockstep for Ditto, one worker: no process


def test_vmap_refuses_by_its_declared_capabilities_in_one_line(caplog):
    """A local method and a job that vmap's loop capabilities leave out train on the
    sequential path (the same model, bit for bit), the reason logged once."""
    import logging

    from fedloom.capabilities import LoopCaps, backend_caps
    from fedloom.client.loop import jobs_reason
    from fedloom.client.transforms import Objective, Prox
    from fedloom.job import local_job

    assert backend_caps(Experiment.from_config(load_config(
        SYN, ["backend=vmap"])).backend).loop == LoopCaps()
    with caplog.at_level(logging.INFO, logger="fedloom"):
        a = fedloom.run(SYN, ["dtype=float64", "client.method.name=scaffold"])
        b = fedloom.run(SYN, ["dtype=float64", "backend=vmap", "client.method.name=scaffold"])
    assert torch.equal(a.w, b.w)
    lines = [r.message for r in caplog.records if r.message.startswith("backend vmap")]
    assert lines == ["backend vmap: local method scaffold (the backend's loop.methods "
                     "capability); training on the sequential path"]
    w, x, y = torch.zeros(3), torch.zeros(2, 1), torch.zeros(2, dtype=torch.long)
    plain = local_job(0, 0, w, 0.1, x, y, 1)
    assert jobs_reason(LoopCaps(), [plain, plain]) is None
    assert "probe" in jobs_reason(LoopCaps(), [local_job(0, 0, w, 0.1, x, y, 1, probe=True)])
    own = local_job(0, 0, w, 0.1, x, y, 1, transforms=(Objective(lambda *a: a[0]),))
    assert "objective" in jobs_reason(LoopCaps(), [own])
    assert jobs_reason(LoopCaps(objective=True), [own]) is None
    dyn = local_job(0, 0, w, 0.1, x, y, 1, transforms=(Prox(0.1),))
    assert jobs_reason(LoopCaps(), [dyn, dyn]) is None
    assert "prox" in jobs_reason(LoopCaps(), [dyn, plain])
    assert jobs_reason(LoopCaps(mixed_prox=True), [dyn, plain]) is None
