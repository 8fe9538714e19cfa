"""The vmap backend gives the sequential backend's results."""

import pytest
import torch

import fedloom
from fedloom.config import load_config
from fedloom.engine.experiment import Experiment

SYN = {"name": "syn", "seed": 2, "rounds": 3,
       "data": {"name": "synthetic", "num_clients": 8, "partition": {"name": "natural"},
                "max_samples": 3000},
       "model": {"name": "mlp", "hidden": [12]}, "cohort": {"size": 4},
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
        load_config(SYN, ["backend=auto", "backend.workers=2", "dtype=float64"]))
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
    ditto = Experiment.from_config(load_config(tiny, ["backend=auto", "backend.workers=1",
                                          "client.method=ditto"]))
    ditto.round(ditto.init())
    assert ditto.backend.name == "sequential"  # no lockstep for Ditto, one worker: no process
