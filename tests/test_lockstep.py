"""The lockstep backend gives the sequential backend's results: bit for bit in float64."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fedloom
from fedloom.capabilities import backend_caps
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, LocalSGD
from fedloom.client.transforms import job_terms
from fedloom.config import load_config
from fedloom.engine.experiment import Experiment
from fedloom.engine.trainers.auto import CANDIDATES, choose, lockstep_reason
from fedloom.engine.trainers.backends import SequentialBackend
from fedloom.engine.trainers.lockstep import LockstepBackend, lockstep_plan, shape_reason
from fedloom.job import Penalty, local_job
from fedloom.models import CNN
from fedloom.models.zoo import CraftCNN, FlareCNN, LeafCNN
from fedloom.params import Layout

# 8 clients of the natural split of the synthetic data: ragged sizes (asserted below).
SYN = {"name": "syn", "seed": 2, "rounds": 2,
       "data": {"name": "synthetic", "num_clients": 8, "partition": {"name": "natural"},
                "max_samples": 1200},
       "model": {"name": "mlp", "options": {"hidden": [12]}}, "cohort": {"size": 4},
       "client": {"lr": 0.05, "batch_size": 16, "epochs": 1}, "checkpoint": {"every": 0},
       "eval": {"every": 2},
       # one intra-op thread: the tests stay quick on a machine shared with other jobs
       "backend": {"threads": 1}}


# The built-in CNN (McMahan et al.'s, narrowed) on 8×8 digits, Dirichlet-split: ragged
# clients of images; two convolutions, ReLU, max-pools, flatten, two Linear layers.
CNNCFG = {**SYN, "data": {"name": "digits", "num_clients": 6, "max_samples": 300,
                          "partition": {"name": "dirichlet", "options": {"alpha": 0.5}}},
          "model": {"name": "cnn", "options": {"channels": [2, 4]}}, "cohort": {"size": 3}}


def _rounds(over: list[str], rounds: int = 2, base: dict = SYN):
    """The global model after ``rounds`` rounds, and the experiment's backend."""
    exp = Experiment.from_config(load_config(base, over))
    st = exp.init()
    losses = []
    for _ in range(rounds):
        st, rec = exp.round(st)
        losses.append(rec.get("train_loss"))
    exp.close()
    return st.w, losses, exp.backend


@pytest.mark.parametrize("extra", [
    [],
    ["client.momentum=0.9", "client.weight_decay=0.001", "client.prox_mu=0.1"],
    ["client.steps=7", "client.momentum=0.5"],
    # SCAFFOLD-style shift; FLARE's penalty on the first steps
    ["compression.name=topk", "compression.options.ratio=0.2", "compression.feedback=scafcom"],
    ["compression.name=topk", "compression.options.ratio=0.2", "compression.options.scope=tensor",
     "compression.feedback=flare", "compression.feedback.options.tau=0.5"],
    # local methods whose work is the loop with their terms, then complete() (#53)
    ["client.method.name=scaffold", "client.momentum=0.5"],
    ["client.method.name=feddyn", "client.method.options.alpha=0.1"],
])
def test_lockstep_equals_sequential_bit_for_bit_in_float64(extra):
    wa, la, _ = _rounds(["dtype=float64", *extra])
    wb, lb, backend = _rounds(["dtype=float64", "backend.name=lockstep", *extra])
    assert backend.name == "lockstep" and backend.reason is None  # not a fallback
    assert torch.equal(wa, wb)
    assert la == lb and None not in la  # the mean local losses too


@pytest.mark.parametrize("extra", [
    [],
    ["client.momentum=0.9", "client.weight_decay=0.001", "client.prox_mu=0.1",
     "client.batch_size=7"],
    ["compression.name=topk", "compression.options.ratio=0.2", "compression.feedback=scafcom"],
])
def test_lockstep_cnn_equals_sequential_bit_for_bit_in_float64(extra):
    wa, la, _ = _rounds(["dtype=float64", *extra], base=CNNCFG)
    wb, lb, backend = _rounds(["dtype=float64", "backend.name=lockstep", *extra], base=CNNCFG)
    assert backend.name == "lockstep" and backend.reason is None  # not a fallback
    assert backend.plan is not None and [o.kind for o in backend.plan][:3] == [
        "conv", "relu", "maxpool"]
    assert torch.equal(wa, wb)
    assert la == lb and None not in la


@pytest.mark.parametrize("base", [SYN, CNNCFG])
def test_the_clients_are_ragged(base):
    exp = Experiment.from_config(load_config(base, ["dtype=float64"]))
    assert len(set(exp.clients.fed.num_train().tolist())) > 1


@pytest.mark.parametrize("base,over", [(SYN, ["model.options.hidden=[64]"]),
                                       (CNNCFG, ["client.momentum=0.9"])])
def test_lockstep_float32_tolerance(base, over):
    wa, _, _ = _rounds(over, base=base)
    wb, _, _ = _rounds([*over, "backend.name=lockstep"], base=base)
    # float32: agreement to float32 rounding (MKL's batched sgemm orders some sums apart;
    # the convolutions are the per-client calls of sequential)
    assert torch.allclose(wa, wb, rtol=1e-5, atol=1e-6)


def test_model_sha256_and_rerun_are_identical():
    over = ["dtype=float64", "client.momentum=0.9", "rounds=2"]
    a = fedloom.run(SYN, over)
    b = fedloom.run(SYN, [*over, "backend.name=lockstep"])
    c = fedloom.run(SYN, [*over, "backend.name=lockstep"])
    assert a.summary["model_sha256"] == b.summary["model_sha256"] == c.summary["model_sha256"]
    assert fedloom.model_sha256(b.w) == a.summary["model_sha256"]


# ----------------------------------------------------------------- the trainer itself
class _Funcs(nn.Module):
    """torch.flatten / F.relu / torch.relu and a bias-free Linear: a chain fx traces."""

    def __init__(self, d: int, h: int, c: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, h)
        self.b = nn.Linear(h, h, bias=False)
        self.c = nn.Linear(h, c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(x, start_dim=1)
        return self.c(torch.relu(self.b(F.relu(self.a(x)))))


def _jobs(model: nn.Module, sizes: list[int], shape: tuple[int, ...], dtype, *,
          penalty: bool = False, shift: bool = False) -> tuple[LocalSGD, list[ClientJob]]:
    g = torch.Generator().manual_seed(0)
    layout = Layout.from_module(model)
    w = torch.randn(layout.size, generator=g, dtype=dtype) * 0.3
    jobs = []
    for k, n in enumerate(sizes):
        x = torch.randn(n, *shape, generator=g, dtype=dtype)
        y = torch.randint(0, 3, (n,), generator=g)
        pen = (Penalty(torch.zeros_like(w), 0.01, 2, "l1") if penalty and k % 2 == 0 else None)
        sh = torch.randn(layout.size, generator=g, dtype=dtype) * 0.01 if shift else None
        jobs.append(local_job(k, 0, w, 0.1 if k != 1 else 0.05, x, y, 100 + k,
                              start_loss=k == 0, transforms=job_terms(sh, pen),
                              max_steps=3 if k == 2 else None))
    return layout, jobs


@pytest.mark.parametrize("model,shape", [
    # products of 6·n·5 < 400: the client-by-client GEMMs of torch's small-matrix case
    (lambda: nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)), (2, 3)),
    (lambda: _Funcs(40, 24, 3), (40,)),
    (lambda: nn.Sequential(nn.Flatten(), nn.Identity(), nn.Linear(30, 32), nn.ReLU(),
                           nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 3)), (5, 6)),
    # every 2-d layer: padded and bias-free convolutions, max- and average pools
    (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                           nn.Conv2d(3, 4, 3, bias=False), nn.ReLU(),
                           nn.AvgPool2d(2, ceil_mode=True), nn.Flatten(), nn.Linear(4, 5),
                           nn.ReLU(), nn.Linear(5, 3)), (2, 8, 8)),
    # a pool first (no gradient below the first convolution), strides, dilations,
    # padding="valid", avg-pool's count_include_pad and divisor_override
    (lambda: nn.Sequential(nn.MaxPool2d(2, stride=1, padding=1, dilation=2),
                           nn.Conv2d(1, 2, 3, stride=2, dilation=2, padding="valid"),
                           nn.AvgPool2d(2, stride=1, padding=1, count_include_pad=False),
                           nn.Conv2d(2, 2, (2, 2), stride=(1, 2)),
                           nn.AvgPool2d(2, divisor_override=3), nn.Flatten(),
                           nn.Linear(2, 3)), (1, 9, 9)),
    # the papers' CNNs, narrowed: McMahan et al.'s / LEAF's ("same" 5×5) and FLARE's
    # ("valid" 5×5)
    (lambda: CNN((1, 8, 8), 3, (2, 4)), (1, 8, 8)),
    (lambda: LeafCNN((1, 8, 8), 3, (3, 4), hidden=16), (1, 8, 8)),
    (lambda: FlareCNN((1, 16, 16), 3, (2, 3)), (1, 16, 16)),
    # GroupNorm after convolutions (one and two groups, its own ε), first in the chain
    # (no input gradient) and on the features of a Linear layer
    (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.ReLU(),
                           nn.MaxPool2d(2), nn.Conv2d(4, 4, 3), nn.GroupNorm(1, 4, eps=1e-3),
                           nn.ReLU(), nn.Flatten(), nn.Linear(16, 3)), (2, 8, 8)),
    (lambda: nn.Sequential(nn.GroupNorm(1, 2), nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(),
                           nn.Linear(108, 8), nn.GroupNorm(2, 8), nn.Linear(8, 3)), (2, 8, 8)),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_trainer_updates_equal_sequential_per_client(model, shape, dtype):
    torch.manual_seed(0)
    net = model().to(dtype)
    layout, jobs = _jobs(net, [5, 9, 16, 33, 1], shape, dtype, penalty=True, shift=True)
    tr = LocalSGD(net, layout, batch_size=4, epochs=2, momentum=0.9, weight_decay=0.01,
                  prox_mu=0.1)
    ls = LockstepBackend(tr, LocalMethod(), chunk=3)  # chunks of 3 and 2 clients
    assert ls.reason is None
    got = ls.train_cohort(jobs)
    want = SequentialBackend(tr, LocalMethod()).train_cohort(jobs)
    for a, b in zip(got, want, strict=True):
        assert a is not None and b is not None
        if dtype == torch.float64:
            assert torch.equal(a.update, b.update)
            assert (a.loss, a.start_loss) == (b.loss, b.start_loss)
        else:  # float32: to float32 rounding (see test_lockstep_float32_tolerance)
            assert torch.allclose(a.update, b.update, rtol=1e-5, atol=1e-6)
            assert a.loss == pytest.approx(b.loss, rel=1e-5)
        assert (a.steps, a.num_samples) == (b.steps, b.num_samples)
    assert [r.steps for r in got if r is not None] == [4, 6, 3, 18, 2]  # ragged, max_steps


@pytest.mark.parametrize("model,shape", [
    # BatchNorm2d after convolutions (momentum 0.1, and None: the cumulative average
    # over num_batches_tracked); BatchNorm1d on a Linear layer's features, its own ε
    (lambda: nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                           nn.MaxPool2d(2), nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4, momentum=None),
                           nn.ReLU(), nn.Flatten(), nn.Linear(16, 3)), (2, 8, 8)),
    (lambda: nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.BatchNorm1d(8, eps=1e-3),
                           nn.ReLU(), nn.Linear(8, 3)), (12,)),
    # first in the chain (no input gradient) without affine parameters; batch
    # statistics only (track_running_stats=False: no buffers)
    (lambda: nn.Sequential(nn.BatchNorm2d(2, affine=False), nn.Conv2d(2, 3, 3),
                           nn.BatchNorm2d(3, track_running_stats=False), nn.ReLU(),
                           nn.Flatten(), nn.Linear(108, 3)), (2, 8, 8)),
    # BatchNorm1d on [C, L] samples
    (lambda: nn.Sequential(nn.BatchNorm1d(3), nn.Flatten(), nn.Linear(15, 3)), (3, 5)),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("start", ["module", "job"])
def test_batchnorm_updates_and_running_statistics_equal_sequential(model, shape, dtype, start):
    torch.manual_seed(0)
    net = model().to(dtype)
    # no batch of one sample (BatchNorm1d refuses to train on it, on both paths)
    layout, jobs = _jobs(net, [6, 10, 16, 34, 2], shape, dtype, penalty=True, shift=True)
    if start == "job":  # the jobs carry their own buffers (model.buffers: local, FedBN)
        g = torch.Generator().manual_seed(1)
        for k, j in enumerate(jobs):
            bufs = {n: (torch.rand(v.shape, generator=g, dtype=dtype) + 0.5
                        if v.is_floating_point() else torch.full_like(v, 3 + k))
                    for n, v in net.named_buffers()}
            jobs[k] = replace(j, buffers=bufs)
    tr = LocalSGD(net, layout, batch_size=4, epochs=2, momentum=0.9, weight_decay=0.01,
                  prox_mu=0.1)
    ls = LockstepBackend(tr, LocalMethod(), chunk=3)
    assert ls.reason is None and any(o.kind == "batchnorm" for o in ls.plan)
    got = ls.train_cohort(jobs)
    want = SequentialBackend(tr, LocalMethod()).train_cohort(jobs)
    for a, b in zip(got, want, strict=True):
        assert a is not None and b is not None
        assert set(a.buffers) == set(b.buffers) == {n for n, _ in net.named_buffers()}
        # both dtypes: each client's BatchNorm and convolutions are its own calls,
        # the batched Linear GEMMs here are under MKL's small-product bound
        assert torch.equal(a.update, b.update) and a.loss == b.loss
        for n in b.buffers:
            assert torch.equal(a.buffers[n], b.buffers[n]), n
    # the running statistics moved (and differently per client)
    stats = [r.buffers for r in got if r is not None and r.buffers]
    if stats:
        name = next(n for n in stats[0] if n.endswith("running_mean"))
        assert not torch.equal(stats[0][name], stats[1][name])


def test_batchnorm_on_a_single_sample_is_refused_as_sequential_refuses_it():
    net = nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    layout, jobs = _jobs(net, [5], (4,), torch.float64)  # batches of 4 and 1
    tr = LocalSGD(net.double(), layout, batch_size=4)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        SequentialBackend(tr, LocalMethod()).train_cohort(jobs)
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        LockstepBackend(tr, LocalMethod()).train_cohort(jobs)


def _bn_chain() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 10))


@pytest.mark.parametrize("policy", ["average", "local"])
def test_batchnorm_runs_equal_sequential_with_their_buffers(policy):
    # whole runs: the server's averaged (or each client's FedBN) buffers are the same
    over = ["dtype=float64", "client.momentum=0.9", f"model.buffers={policy}"]
    out = []
    for backend in ("sequential", "lockstep"):
        exp = Experiment.from_config(load_config(CNNCFG, [*over, f"backend.name={backend}"]),
                         model=_bn_chain)
        st = exp.init()
        for _ in range(2):
            st, _ = exp.round(st)
        out.append((st, exp.backend))
        exp.close()
    (a, _), (b, ls) = out
    assert ls.name == "lockstep" and ls.reason is None
    assert torch.equal(a.w, b.w)
    assert set(a.buffers) == set(b.buffers) and a.buffers
    for n in a.buffers:
        assert torch.equal(a.buffers[n], b.buffers[n]), n


def _pfl_like() -> nn.Module:
    """pfl-research's benchmark CNN's chain (conv, conv, max-pool, Dropout(0.25), Dense,
    Dropout(0.5)), narrowed to 8×8 images."""
    return nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 4, 3), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Dropout(0.25), nn.Flatten(), nn.Linear(16, 8),
                         nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 3))


@pytest.mark.parametrize("model,shape", [
    (_pfl_like, (2, 8, 8)),
    # the CRAFT code's CNN: Dropout(0.2) and (0.5) before ReLUs; Dropout(p=0) draws nothing
    (lambda: nn.Sequential(CraftCNN((1, 16, 16), 3, (2, 3)), nn.Dropout(0.0)), (1, 16, 16)),
])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dropout_masks_are_the_sequential_trainers(model, shape, dtype):
    torch.manual_seed(0)
    net = model().to(dtype)
    layout, jobs = _jobs(net, [5, 9, 16, 33, 1], shape, dtype, penalty=True, shift=True)
    kw = {"batch_size": 4, "epochs": 2, "momentum": 0.9, "weight_decay": 0.01}
    tr = LocalSGD(net, layout, random_forward=True, **kw)
    ls = LockstepBackend(tr, LocalMethod(), chunk=3)
    assert ls.reason is None
    got = ls.train_cohort(jobs)
    want = SequentialBackend(tr, LocalMethod()).train_cohort(jobs)
    for a, b in zip(got, want, strict=True):
        assert a is not None and b is not None
        if dtype == torch.float64:
            assert torch.equal(a.update, b.update) and a.loss == b.loss
        else:
            # float32: the batched and per-client kernels round differently, and with
            # more than one thread differently again; these steps grow the weights
            # (updates of norm ~1e2), so the check is relative to the update's norm
            assert float((a.update - b.update).norm()) <= 1e-5 * float(b.update.norm())
    # the masks matter: without dropout the updates are others
    for mod in net.modules():
        if isinstance(mod, nn.Dropout):
            mod.p = 0.0
    plain = LockstepBackend(LocalSGD(net, layout, **kw), LocalMethod(), chunk=3)
    assert plain.plan is not None and all(o.kind != "dropout" for o in plain.plan)
    again = plain.train_cohort(jobs)
    assert not torch.equal(again[3].update, got[3].update)


class _WithBuffer(nn.Sequential):
    """A chain with a buffer of its own (not BatchNorm's running statistics)."""

    def __init__(self) -> None:
        super().__init__(nn.Flatten(), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
        self.register_buffer("mask", torch.ones(4))


@pytest.mark.parametrize("model,why", [
    (nn.Sequential(nn.Conv2d(2, 2, 3, groups=2), nn.Flatten(), nn.Linear(8, 3)), "groups"),
    (nn.Sequential(nn.Conv2d(1, 2, 3, padding="same"), nn.Flatten(), nn.Linear(8, 3)),
     "padding='same'"),
    (nn.Sequential(nn.Conv2d(1, 2, 3, padding_mode="reflect"), nn.Flatten(), nn.Linear(8, 3)),
     "reflect"),
    (nn.Sequential(nn.Conv2d(1, 2, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2, 3)),
     "AdaptiveAvgPool2d"),
    (nn.Sequential(nn.Conv2d(1, 2, 3), nn.GroupNorm(1, 2, affine=False), nn.Flatten(),
                   nn.Linear(2, 3)), "GroupNorm without affine"),
    (_WithBuffer(), "buffers other than BatchNorm's (mask)"),
    (nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm3d(2), nn.Flatten(), nn.Linear(8, 3)),
     "BatchNorm3d"),
    (nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.Dropout(0.5, inplace=True),
                   nn.Linear(4, 3)), "in-place Dropout"),
    (nn.Sequential(nn.Conv2d(1, 2, 3), nn.Dropout2d(0.5), nn.Flatten(), nn.Linear(8, 3)),
     "Dropout2d"),
    (nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3)), "Tanh"),
])
def test_unsupported_layers_are_named(model, why):
    ops, reason = lockstep_plan(model, Layout.from_module(model))
    assert ops is None and why in reason


def test_frozen_and_shared_layers_are_refused():
    lin = nn.Linear(4, 4)
    shared = nn.Sequential(nn.Flatten(), lin, nn.ReLU(), lin, nn.Linear(4, 3))
    assert "twice" in lockstep_plan(shared, Layout.from_module(shared))[1]
    frozen = nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.Linear(4, 3))
    frozen[1].weight.requires_grad_(False)
    assert "frozen" in lockstep_plan(frozen, Layout.from_module(frozen))[1]


def test_a_linear_on_unflattened_samples_falls_back(caplog):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Flatten(), nn.Linear(8, 3)).double()
    layout, jobs = _jobs(net, [6, 9], (2, 3), torch.float64)
    tr = LocalSGD(net, layout, batch_size=4)
    ls = LockstepBackend(tr, LocalMethod())
    assert ls.reason is None  # the chain itself is supported; the samples are not
    with caplog.at_level(logging.INFO, logger="fedloom"):
        got = ls.train_cohort(jobs)
    assert any("2-dimensional samples" in r.getMessage() for r in caplog.records)
    want = SequentialBackend(tr, LocalMethod()).train_cohort(jobs)
    assert all(torch.equal(a.update, b.update) for a, b in zip(got, want, strict=True))


def test_sample_shapes_are_checked_through_the_convolutions():
    net = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 3))
    plan, _ = lockstep_plan(net, Layout.from_module(net))
    assert plan is not None
    assert shape_reason(plan, (1, 4, 4)) is None  # 2 × 2 × 2 = 8 features
    assert "8 inputs on 16 features" in shape_reason(plan, (1, 4, 6))  # 2 × 2 × 4
    assert "2-dimensional samples" in shape_reason(plan, (4, 4))
    assert "conv layer on samples of shape [1, 2, 2]" in shape_reason(plan, (1, 2, 2))


def test_fallbacks_log_one_line_and_equal_sequential(caplog):
    for extra, why in ((["client.method=ditto"], "local method ditto"),
                       (["model.name=resnet", "model.options={depth: 8, width: 4}",
                         "model.options.norm=group", "data.name=digits", "data.partition=iid",
                         "data.max_samples=300"],
                        "not a chain"),
                       (["client.amp=bf16", "dtype=float32"], "client.amp bf16")):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fedloom"):
            wb, _, backend = _rounds(["dtype=float64", "backend.name=lockstep", *extra])
        lines = [r.getMessage() for r in caplog.records if "backend lockstep" in r.getMessage()]
        assert len(lines) == 1 and why in lines[0], lines  # one line, not one per round
        assert backend.reason is not None
        wa, _, _ = _rounds(["dtype=float64", *extra])
        assert torch.equal(wa, wb)


def _fake_measure(times: dict[str, float], ran: list[str]):
    """A measure that times nothing: sequential really trains (its results are the
    first cohort's), the others report the given seconds without running."""
    def measure(backend, jobs):
        name = _auto_name(backend)
        ran.append(name)
        if name == "sequential":
            return backend.train_cohort(jobs), times[name]
        return [None] * len(jobs), times[name]
    return measure


def _auto_name(backend) -> str:
    inner = getattr(backend, "inner", None)
    return backend.name if inner in (None, "sequential") else f"{backend.name}+{inner}"


@pytest.mark.parametrize("times,want", [
    ({"sequential": 3.0, "lockstep": 2.0, "process": 1.5, "process+lockstep": 1.2},
     "process+lockstep"),
    ({"sequential": 3.0, "lockstep": 1.0, "process": 1.5, "process+lockstep": 1.2},
     "lockstep"),
    ({"sequential": 1.0, "lockstep": 2.0, "process": 1.5, "process+lockstep": 1.2},
     "sequential"),
    ({"sequential": 2.0, "lockstep": 2.0, "process": 2.0, "process+lockstep": 2.0},
     "sequential"),  # a tie: the first in CANDIDATES order
    ({"sequential": 2.0, "lockstep": 1.0, "process": 1.0, "process+lockstep": 1.0},
     "lockstep"),
])
def test_auto_keeps_the_fastest_candidate_given_the_timings(times, want, caplog):
    """auto times every candidate that applies (a CPU run, two workers, a cohort of 4:
    no vmap) and keeps the fastest, ties to the earlier in CANDIDATES; the first
    cohort's results are sequential's whichever wins, and the table is logged."""
    over = ["backend.name=auto", "backend.options.workers=2", "dtype=float64"]
    exp = Experiment.from_config(load_config(SYN, over))
    ran: list[str] = []
    exp.backend.measure = _fake_measure(times, ran)
    with caplog.at_level(logging.INFO, logger="fedloom"):
        st, _ = exp.round(exp.init())
    assert ran == ["sequential", "lockstep", "process", "process+lockstep"]
    assert exp.backend.times == times and exp.backend.name == want == choose(times)
    assert _auto_name(exp.backend.chosen) == want
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert f"using {want}" in text and all(k in text for k in times)
    ref = Experiment.from_config(load_config(SYN, ["dtype=float64"]))
    assert torch.equal(st.w, ref.round(ref.init())[0].w)
    exp.close()


def test_auto_choose_is_deterministic():
    assert choose({"process": 1.0, "sequential": 1.0}) == "sequential"
    assert choose({"vmap": 1.0, "process+lockstep": 1.0, "process": 1.0}) == "vmap"
    assert choose({"lockstep": 0.5, "sequential": 1.0}) == "lockstep"
    assert list(CANDIDATES) == ["sequential", "lockstep", "vmap", "process", "process+lockstep"]
    with pytest.raises(ValueError):
        choose({})


def test_auto_candidates_where_they_apply():
    """One worker: no process candidates; a model or method lock-step does not run:
    no lockstep candidate (nor process+lockstep); vmap only on a GPU."""
    exp = Experiment.from_config(load_config(SYN, ["backend.name=auto",
                                                   "backend.options.workers=1"]))
    jobs = exp.plan_round(exp.init()).jobs
    assert list(exp.backend.candidates(jobs)) == ["sequential", "lockstep"]
    exp.close()
    exp = Experiment.from_config(load_config(SYN, ["backend.name=auto",
                                                   "backend.options.workers=2"]))
    assert list(exp.backend.candidates(jobs)) == ["sequential", "lockstep", "process",
                                                   "process+lockstep"]
    assert list(exp.backend.candidates(jobs[:3])) == ["sequential", "lockstep"]  # < 2 a worker
    exp.close()
    exp = Experiment.from_config(load_config(SYN, ["backend.name=auto", "backend.options.workers=2",
                                       "client.method=ditto"]))
    assert list(exp.backend.candidates(jobs)) == ["sequential", "process"]
    exp.close()


def test_auto_rule_reasons():
    net = CNN((1, 8, 8), 3, (2, 4)).double()
    layout, jobs = _jobs(net, [5, 9, 6], (1, 8, 8), torch.float64)
    ls = LockstepBackend(LocalSGD(net, layout, batch_size=4), LocalMethod())
    assert lockstep_reason(ls, jobs) is None
    probed = [replace(j, steps=replace(j.steps, probe=True)) for j in jobs]
    assert "probe" in lockstep_reason(ls, probed)
    # 6×6: 4 × 1 × 1 features, not 16
    bad = [replace(j, data=replace(j.data, x=j.x[:, :, :6, :6])) for j in jobs]
    assert "features" in lockstep_reason(ls, bad)
    tanh = nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    ls = LockstepBackend(LocalSGD(tanh, Layout.from_module(tanh)), LocalMethod())
    assert "Tanh" in lockstep_reason(ls, jobs)


def test_auto_times_the_candidates_and_runs_on_the_chosen(caplog):
    """Real timings (one worker: sequential and lockstep): the choice is choose() of
    them, and the run gives sequential's models, bit for bit in float64."""
    over = ["backend.name=auto", "backend.options.workers=1", "dtype=float64"]
    with caplog.at_level(logging.INFO, logger="fedloom"):
        w, _, backend = _rounds(over)
    assert set(backend.times) == {"sequential", "lockstep"}
    assert backend.name == choose(backend.times)
    assert any("backend auto: using" in r.getMessage() for r in caplog.records)
    assert torch.equal(w, _rounds(["dtype=float64"])[0])  # sequential's model, bit for bit


def test_auto_streams_through_the_chosen_process_backend(monkeypatch, early_calls):
    """When auto has chosen ``process``, the rounds after the first hand each client's
    result over as it arrives (the chosen backend's streaming: the uplink work as
    results come, the rows in place), as ``backend: process`` does; before the choice
    it does not stream. The model is the sequential run's, bit for bit (float64),
    with the cohort handed over at once there."""
    from fedloom.engine.trainers.backends import SequentialBackend

    seen = early_calls
    monkeypatch.setattr(SequentialBackend, "capabilities", replace(
        SequentialBackend.capabilities, streams=False))  # the reference's rounds
    over = ["backend.name=auto", "backend.options.workers=2", "dtype=float64"]
    exp = Experiment.from_config(load_config(SYN, over))
    assert not backend_caps(exp.backend).streams
    exp.backend.measure = _fake_measure(
        {"sequential": 3.0, "lockstep": 2.0, "process": 1.0, "process+lockstep": 1.5}, [])
    ref = Experiment.from_config(load_config(SYN, ["dtype=float64"]))
    st, st_ref = exp.init(), ref.init()
    try:
        for r in range(3):
            st, _ = exp.round(st)
            st_ref, _ = ref.round(st_ref)
            if r == 0:
                assert (not seen and exp.backend.name == "process"
                        and backend_caps(exp.backend).streams)
        assert len(seen) == 2 * exp.cfg.cohort.size
        assert torch.equal(st.w, st_ref.w)
    finally:
        exp.close()
        ref.close()
