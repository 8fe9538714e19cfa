"""Train mode, dropout and module buffers (BatchNorm statistics): fedloom.buffers.

Tiny models on the 8×8 digits: a conv → BatchNorm2d → ReLU → dropout → linear
net, built by a factory that draws its initial weights from torch's global RNG
(PyTorch's default init), as a user's model does.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fedloom
from fedloom.buffers import average_buffers, flatten_buffers, load_buffers, module_buffers
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment
from fedloom.engine.runs.checkpoint import load_checkpoint
from fedloom.params import Layout


class Net(nn.Module):
    """conv3×3(4) → [BatchNorm2d] → ReLU → Dropout(p) → linear."""

    def __init__(self, p: float = 0.0, bn: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4) if bn else nn.Identity()
        self.drop = nn.Dropout(p)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(F.relu(self.bn(self.conv(x))).flatten(1)))


SEEN: list[tuple[bool, bool]] = []  # (module.training, grad enabled) of each forward


class Recorder(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append((self.training, torch.is_grad_enabled()))
        return super().forward(x)


def _cfg(tiny, *over):
    return load_config(tiny, list(over))


def _run(tiny, over, factory, **kw):
    return fedloom.run(tiny, list(over), model=factory, **kw)


def _exp(tiny, over, factory):
    return Experiment.from_config(_cfg(tiny, *over), model=factory)


def _one_round(exp, st):
    """A round in its parts, so the test sees what each client sent."""
    plan = exp.plan_round(st)
    raw = exp.backend.train_cohort(plan.jobs)
    for r in raw:
        r.extra["w_k"] = st.w - r.update  # kept: the uplink frees the update
    plan, outcome = exp.uplink_round(st, plan, raw)
    results = outcome.results
    bufs = [copy.deepcopy(r.buffers) for r in results]
    new, _ = exp.finish_round(st, plan, outcome, t0=0.0, t_train=0.0)
    return plan, results, bufs, new


# ---------------------------------------------------------------- the factory
def test_factory_is_seeded_and_leaves_the_global_rng_alone(tiny):
    # Before: the factory drew from the global RNG as it stood, so two runs with the
    # same seed started (and ended) with different weights.
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()  # noqa: NPY002
    a = _run(tiny, ["rounds=1"], lambda: Net(bn=False))
    torch.rand(3)  # move the global generator: the next run must not care
    b = _run(tiny, ["rounds=1"], lambda: Net(bn=False))
    c = _run(tiny, ["rounds=1", "seed=4"], lambda: Net(bn=False))
    assert a.summary["model_sha256"] == b.summary["model_sha256"]
    assert a.summary["model_sha256"] != c.summary["model_sha256"]
    torch.rand(3)
    torch.set_rng_state(torch_state)
    x = _exp(tiny, [], lambda: Net(bn=False))
    assert torch.equal(torch.get_rng_state(), torch_state)  # building left it alone
    np.testing.assert_array_equal(np.random.get_state()[1], np_state[1])  # noqa: NPY002
    st = x.init()
    x.round(st)
    assert torch.equal(torch.get_rng_state(), torch_state)  # training too


# ------------------------------------------------------------------ the modes
def test_train_mode_in_local_steps_eval_mode_in_evaluation(tiny):
    exp = _exp(tiny, ["eval.every=3"], lambda: Recorder(p=0.5))
    st = exp.init()
    SEEN.clear()
    st, m = exp.round(st)  # round 1 of 3: no evaluation
    assert "test_acc" not in m and SEEN
    assert all(training for training, grad in SEEN if grad)  # every training forward
    SEEN.clear()
    exp.evaluate(st.w)
    assert SEEN and not any(training for training, _ in SEEN)
    assert exp.module.training is False


# -------------------------------------------------------------------- dropout
def test_dropout_fires_and_reruns_and_resumes_are_bit_identical(tiny, tmp_path):
    def drop():
        return Net(p=0.5, bn=False)

    tiny["rounds"] = 2
    on = _run(tiny, [], drop)
    off = _run(tiny, [], lambda: Net(p=0.0, bn=False))
    again = _run(tiny, [], drop)
    # Before: the module trained in eval mode, so p had no effect at all.
    assert on.summary["model_sha256"] != off.summary["model_sha256"]
    assert on.summary["model_sha256"] == again.summary["model_sha256"]

    def stop(state, metrics):
        if state.next_round == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(tiny, [], drop, out=tmp_path / "r", callbacks=[stop])
    resumed = _run(tiny, [], drop, out=tmp_path / "r", resume=True)
    assert resumed.summary["model_sha256"] == on.summary["model_sha256"]


def test_vmap_refuses_a_dropout_model_and_auto_trains_it_sequentially(tiny):
    with pytest.raises(ConfigError, match=r"backend\.name: vmap"):
        _exp(tiny, ["backend.name=vmap"], lambda: Net(p=0.5))
    with pytest.raises(ConfigError, match=r"backend\.options\.inner: vmap"):
        _exp(tiny, ["backend.name=process", "backend.options.inner=vmap"], lambda: Net(p=0.5))
    # p = 0 draws nothing: vmap is fine
    assert _exp(tiny, ["backend.name=vmap"], lambda: Net(p=0.0)).backend.enabled


@pytest.mark.slow
def test_process_backend_matches_sequential_with_dropout_and_batchnorm(tiny):
    # Masks and statistics derive from (seed, round, client, step): a worker
    # process draws the same ones (float64: same bits, see engine.trainers.parallel).
    ov = ["dtype=float64", "rounds=2"]
    seq = _run(tiny, ov, lambda: Net(p=0.5))
    proc = _run(tiny, [*ov, "backend.name=process", "backend.options.workers=2"],
                lambda: Net(p=0.5))
    assert proc.summary["model_sha256"] == seq.summary["model_sha256"]
    assert proc.summary["buffers_sha256"] == seq.summary["buffers_sha256"]


# ---------------------------------------------------------------- BatchNorm
def test_local_training_updates_buffers_as_plain_pytorch_does(tiny):
    # Independent reference: the client's batches through an ordinary module in
    # train mode with torch.optim.SGD, no fedloom code in the loop.
    exp = _exp(tiny, ["dtype=float64"], lambda: Net())
    st = exp.init()
    plan, results, bufs, _ = _one_round(exp, st)
    job, res = plan.jobs[0], results[0]
    ref = copy.deepcopy(exp.module).train()
    exp.layout.load_into(ref, st.w)
    load_buffers(ref, st.buffers)  # the round's start (the module now holds the new ones)
    opt = torch.optim.SGD(ref.parameters(), lr=job.lr)
    gen = torch.Generator()
    gen.manual_seed(job.gen_seed)
    for idx in exp.trainer.batch_indices(int(job.y.shape[0]), gen):
        opt.zero_grad()
        F.cross_entropy(ref(job.x[idx]), job.y[idx]).backward()
        opt.step()
    got = bufs[0]
    for name, v in module_buffers(ref).items():
        assert torch.allclose(got[name], v, rtol=0, atol=1e-12), name
    assert int(got["bn.num_batches_tracked"]) == res.steps
    w_ref = exp.layout.flatten(ref)
    assert torch.allclose(res.extra["w_k"], w_ref, rtol=0, atol=1e-12)


def test_average_is_the_data_weighted_mean_of_the_clients_buffers(tiny):
    exp = _exp(tiny, ["dtype=float64"], lambda: Net())
    st = exp.init()
    _, results, bufs, new = _one_round(exp, st)
    n = [r.num_samples for r in results]
    assert len(set(n)) > 1  # the weights matter
    for name in ("bn.running_mean", "bn.running_var"):
        want = sum(nk * b[name] for nk, b in zip(n, bufs, strict=True)) / sum(n)
        assert torch.allclose(new.buffers[name], want, rtol=1e-14, atol=0), name
        assert not torch.allclose(new.buffers[name], bufs[0][name])
    # the integer count: the maximum over the clients
    assert int(new.buffers["bn.num_batches_tracked"]) == max(r.steps for r in results)
    # evaluation uses them: the module holds the new global buffers
    assert torch.equal(dict(exp.module.named_buffers())["bn.running_var"],
                       new.buffers["bn.running_var"])

    # ...and a second run on the same Experiment starts from the initial buffers,
    # not from the ones the module holds now
    again = exp.init()
    assert all(torch.equal(again.buffers[k], v) for k, v in st.buffers.items())
    assert not torch.equal(again.buffers["bn.running_var"], new.buffers["bn.running_var"])


def test_average_buffers_rules():
    a = {"m": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    b = {"m": torch.tensor([4.0, 8.0]), "n": torch.tensor(5)}
    out = average_buffers([a, b], [1, 2])  # (1·a + 2·b) / 3
    assert torch.equal(out["m"], torch.tensor([3.0, 6.0]))
    assert out["n"].dtype == torch.int64 and int(out["n"]) == 5
    with pytest.raises(ValueError, match="positive weight"):
        average_buffers([a, b], [1, 0])


def test_rejected_clients_buffers_are_never_averaged(tiny):
    # Every update above the bound: nobody is accepted, the buffers stay.
    exp = _exp(tiny, ["server.max_update_norm=1e-12", "model.buffers=local"], lambda: Net())
    st = exp.init()
    plan, _, bufs, new = _one_round(exp, st)
    assert not torch.equal(bufs[0]["bn.running_mean"], st.buffers["bn.running_mean"])
    for name, v in st.buffers.items():
        assert torch.equal(new.buffers[name], v), name
    assert not bool(new.clients.gather("bn.buffers_set", plan.cohort.tolist()).any())


def test_keep_global_never_updates_the_buffers(tiny):
    exp = _exp(tiny, ["model.buffers=keep_global"], lambda: Net())
    st = exp.init()
    _, _, bufs, new = _one_round(exp, st)
    assert not torch.equal(bufs[0]["bn.running_mean"], st.buffers["bn.running_mean"])
    for name, v in st.buffers.items():
        assert torch.equal(new.buffers[name], v), name
    res = _run(tiny, ["model.buffers=keep_global"], lambda: Net())
    for name, v in module_buffers(Net()).items():  # initial statistics: 0, 1, 0
        assert torch.equal(dict(res.model.named_buffers())[name], v), name


def test_local_keeps_each_clients_buffers_and_starts_from_them(tiny):
    exp = _exp(tiny, ["model.buffers=local", "cohort.size=10"], lambda: Net())
    st = exp.init()
    plan, results, bufs, st1 = _one_round(exp, st)
    ids = plan.cohort.tolist()
    rows = st1.clients.gather("bn.buffers", ids)
    for i in range(len(ids)):
        assert torch.equal(rows[i], flatten_buffers(bufs[i], exp.dtype))
    # the global buffers are still the weighted mean (the global test set uses them)
    want = average_buffers(bufs, [r.num_samples for r in results])
    assert torch.equal(st1.buffers["bn.running_mean"], want["bn.running_mean"])
    # next round: each client starts from its own statistics, not the global ones
    plan2 = exp.plan_round(st1)
    for job in plan2.jobs:
        own = bufs[ids.index(job.client)]
        assert torch.equal(job.buffers["bn.running_var"], own["bn.running_var"])


def test_local_buffers_survive_checkpoint_and_resume(tiny, tmp_path):
    ov = ["model.buffers=local", "rounds=2"]
    ref = _run(tiny, ov, lambda: Net(), out=tmp_path / "a")

    def stop(state, metrics):
        if state.next_round == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(tiny, ov, lambda: Net(), out=tmp_path / "b", callbacks=[stop])
    res = _run(tiny, ov, lambda: Net(), out=tmp_path / "b", resume=True)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    assert res.summary["buffers_sha256"] == ref.summary["buffers_sha256"]
    sa = load_checkpoint(tmp_path / "a/checkpoints/last.pt", ["store"])["store"]
    sb = load_checkpoint(tmp_path / "b/checkpoints/last.pt", ["store"])["store"]
    assert np.array_equal(sa["bn.buffers"], sb["bn.buffers"])
    assert np.count_nonzero(sa["bn.buffers_set"]) > 0
    # per-client accuracies use each client's own statistics, identically after resume
    acc_a = json.loads((tmp_path / "a/client_acc.json").read_text())
    acc_b = json.loads((tmp_path / "b/client_acc.json").read_text())
    assert acc_a == acc_b
    # model.pt carries the buffers
    blob = torch.load(tmp_path / "b/model.pt", weights_only=True)
    assert torch.equal(blob["state_dict"]["bn.running_var"],
                       dict(res.model.named_buffers())["bn.running_var"])


def test_vmap_matches_sequential_with_batchnorm(tiny):
    # Clients of different sizes and a short last batch: the padded steps run
    # client by client, so the batch statistics are each client's own.
    ov = ["dtype=float64", "cohort.size=6"]
    seq = _exp(tiny, ov, lambda: Net())
    vm = _exp(tiny, [*ov, "backend.name=vmap"], lambda: Net())
    assert vm.backend.enabled
    a, b = seq.init(), vm.init()
    for _ in range(2):
        a, _ = seq.round(a)
        b, _ = vm.round(b)
    assert torch.allclose(a.w, b.w, rtol=0, atol=1e-12)
    for name in a.buffers:
        assert torch.allclose(a.buffers[name].double(), b.buffers[name].double(),
                              rtol=0, atol=1e-12), name


def test_a_batch_of_one_that_batchnorm1d_cannot_train_on_is_one_line(tiny):
    def bn1d():
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.BatchNorm1d(8), nn.ReLU(),
                             nn.Linear(8, 10))

    n0 = int(_exp(tiny, [], lambda: Net()).fed.num_train()[0])
    b = n0 - 1  # client 0's last batch holds one sample
    # Before: the run stopped inside training with BatchNorm's own ValueError.
    with pytest.raises(ConfigError, match=rf"client\.batch_size: {b} leaves client 0 "):
        _exp(tiny, [f"client.batch_size={b}"], bn1d)
    _exp(tiny, [f"client.batch_size={b}"], lambda: Net())  # BatchNorm2d: 64 values a channel


def test_privacy_refuses_averaged_buffers(tiny):
    with pytest.raises(ConfigError, match=r"model\.buffers"):
        _exp(tiny, ["server.secure_aggregation=true"], lambda: Net())


# ---------------------------------------------------- the built-in ResNet's norm
def test_resnet_norm_choice_keeps_weights_and_layer_groups(tiny):
    base = ["model.name=resnet", "model.options={depth: 8, width: 4}", "rounds=1"]
    group = _exp(tiny, base, None)
    batch = _exp(tiny, [*base, "model.options.norm=batch"], None)
    none = _exp(tiny, [*base, "model.options.norm=none"], None)
    assert "norm" not in group.cfg.model.options  # the default, group, is unchanged
    assert not module_buffers(group.module)
    # same names, same groups, same initial weights: only the layer kind differs
    assert batch.layout == group.layout
    assert torch.equal(batch.init().w, group.init().w)
    # BN's affine parameters join their conv's group
    assert batch.layout.groups[0].tensors == ("conv1.weight", "gn1.weight", "gn1.bias")
    bufs = batch.init().buffers
    assert torch.equal(bufs["gn1.running_var"], torch.ones(4))  # reset, not to_empty garbage
    assert int(bufs["gn1.num_batches_tracked"]) == 0
    assert isinstance(batch.module.gn1, nn.BatchNorm2d)
    assert none.layout.size < group.layout.size
    st, _ = batch.round(batch.init())
    assert not torch.equal(st.buffers["gn1.running_var"], torch.ones(4))


def test_layout_groups_batchnorm_with_its_conv():
    lay = Layout.from_module(Net())
    assert [g.tensors for g in lay.groups] == [
        ("conv.weight", "conv.bias", "bn.weight", "bn.bias"), ("fc.weight", "fc.bias")]
