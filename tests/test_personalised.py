"""The baselines reviewers expect: FedDyn, FedPer / LG-FedAvg, FedRep, FedBABU, APFL,
MOON and FedBN as local methods, and personalised evaluation.

Three kinds of test: conformance (every method reruns and resumes bit for bit,
composes with CRAFT and Top-k + EF, refuses bad options in one line), properties
(the server's head never moves under FedPer / FedBABU, MOON at μ = 0 is local SGD,
FedBN is ``model.buffers: local``, APFL's α stays in [0, 1]), and one local round
(or two with the server) of each method against its rule written out here from
the public code or the paper, with a plain ``nn.Module`` and ``torch.optim.SGD``
on the same batches (the batch order is fedloom's, not what is under test).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fedloom
from conftest import TINY, stop_and_resume
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment
from fedloom.rng import derive_seed

METHODS = ["feddyn", "fedper", "lg_fedavg", "fedrep", "fedbabu", "apfl", "moon", "fedbn"]
F64 = ["dtype=float64"]
# float64, against the rule written out: w_k is read back as w − (w − w_k), one
# rounding of the update (measured ≤ 7e-18 on these inputs)
TOL = 1e-14


def _cfg(method, *over):
    return load_config(TINY, [f"client.method={method}", *over])


# ------------------------------------------------------------------ conformance
# The methods with per-client or server state (FedPer and LG-FedAvg keep theirs as
# FedRep does; FedBABU and FedBN keep none beyond fedloom's own): each resumes.
STATEFUL = ["feddyn", "fedrep", "apfl", "moon"]
QUICK = ["cohort.size=3", "eval.every=3"]


@pytest.mark.parametrize("method", STATEFUL)
def test_resume_is_bit_identical_under_craft_and_topk_ef(method, tmp_path):
    """Each method under CRAFT with Top-10 % + EF: finite, and a run stopped after
    round 2 and resumed ends at the uninterrupted run's model."""
    over = [f"client.method={method}", "aggregator.name=craft", "server.lr=0.5",
            "compression.name=topk", "compression.options.ratio=0.1",
            "compression.feedback=ef", "rounds=3", *QUICK]
    ref, res = stop_and_resume(TINY, over, tmp_path / "run")
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    last = res.metrics[-1]
    assert last["rejected_updates"] == 0 and 0 <= last["client_acc_mean"] <= 1
    if method in ("fedper", "lg_fedavg", "fedrep", "apfl"):
        assert last["personal_clients"] >= 1 and 0 <= last["personal_acc_mean"] <= 1


@pytest.mark.parametrize("method", [m for m in METHODS if m not in STATEFUL])
def test_the_others_compose_with_craft_and_topk_ef(method):
    res = fedloom.run(TINY, [f"client.method={method}", "aggregator.name=craft",
                             "server.lr=0.5", "compression.name=topk",
                             "compression.options.ratio=0.1", "compression.feedback=ef",
                             "rounds=2", "cohort.size=3", "eval.every=2"])
    last = res.metrics[-1]
    assert last["rejected_updates"] == 0 and 0 <= last["client_acc_mean"] <= 1
    assert bool(torch.isfinite(res.w).all())


def test_vmap_falls_back_to_sequential_for_methods_and_equals_it():
    over = ["client.method=fedrep", "rounds=1", *QUICK]
    seq = fedloom.run(TINY, over)
    vm = fedloom.run(TINY, [*over, "backend.name=vmap"])
    assert seq.summary["model_sha256"] == vm.summary["model_sha256"]


@pytest.mark.parametrize("over,why", [
    (["client.method=fedper", "client.method.options.personal=[nope]"],
     "client.method.options.personal: no layer group 'nope'"),
    (["client.method=fedper", "client.method.options.personal=[net.1,net.3]"],
     "every layer group is personal"),
    (["client.method=fedrep", "client.method.options.head_epochs=-1"], "head_epochs"),
    (["client.method=apfl", "client.momentum=0.9"], "client.momentum: apfl"),
    (["client.method=apfl", "client.method.options.alpha=2"], "alpha: must be in [0, 1]"),
    (["client.method=moon", "client.method.options.tau=0"], "tau"),
    (["client.method=feddyn", "client.method.options.alpha=0"], "alpha: must be a number > 0"),
    (["client.method=fedbn", "model.buffers=keep_global"], "model.buffers: client.method"),
    (["client.method=fedbabu", "client.method.options.lam=1"], "lam"),
])
def test_bad_options_are_one_line_config_errors(over, why):
    with pytest.raises(ConfigError) as e:
        fedloom.run(TINY, [*over, "rounds=1"])
    msg = str(e.value)
    assert why in msg and "\n" not in msg


# ------------------------------------------------------------------- properties
def _head(exp):
    return exp.layout.groups[-1].slice


def test_fedper_and_fedbabu_never_move_the_servers_head_and_fedper_keeps_personal_heads():
    """FedPer sends no head update and FedBABU trains none: the global head is the
    initial one after every round, the body moves; FedPer's clients that trained
    have heads of their own, the others are reported apart."""
    for method in ("fedper", "fedbabu"):
        cfg = _cfg(method, "rounds=2", "eval.every=2", "eval.finetune_steps=2")
        exp = Experiment.from_config(cfg)
        w0 = exp.init().w
        res = fedloom.run(cfg)
        h = _head(exp)
        assert torch.equal(res.w[h], w0[h]), method
        assert not torch.equal(res.w[: h.start], w0[: h.start]), method
        last = res.metrics[-1]
        assert 0 <= last["finetune_acc_mean"] <= 1
        if method == "fedper":
            assert 1 <= last["personal_clients"] < cfg.data.num_clients
            assert "unsampled_acc_mean" in last


def test_moon_with_mu_zero_is_local_sgd_bit_for_bit():
    a = fedloom.run(TINY, ["client.method=moon", "client.method.options.mu=0", "rounds=2",
                           *QUICK])
    b = fedloom.run(TINY, ["rounds=2", *QUICK])
    assert a.summary["model_sha256"] == b.summary["model_sha256"]
    c = fedloom.run(TINY, ["client.method=moon", "client.method.options.mu=5", "rounds=2",
                           *QUICK])
    assert c.summary["model_sha256"] != b.summary["model_sha256"]


def test_fedbn_is_model_buffers_local():
    """On a ResNet with BatchNorm, ``client.method: fedbn`` gives the ``model.buffers:
    local`` run bit for bit, and differs from ``average``."""
    base = ["model.name=resnet", "model.options={depth: 8, width: 4, norm: batch}",
            "rounds=2", "cohort.size=2", "eval.every=2", "data.num_clients=4",
            "data.max_samples=300"]
    fedbn = fedloom.run(TINY, ["client.method=fedbn", *base])
    local = fedloom.run(TINY, ["model.buffers=local", *base])
    avg = fedloom.run(TINY, base)
    assert fedbn.summary["model_sha256"] == local.summary["model_sha256"]
    assert fedbn.metrics[-1]["client_acc_mean"] == local.metrics[-1]["client_acc_mean"]
    assert avg.metrics[-1]["client_acc_mean"] != local.metrics[-1]["client_acc_mean"]


def test_apfl_alpha_stays_in_bounds_and_its_update_is_local_sgds():
    """APFL's global copy is plain local SGD (its update equals FedAvg's client
    update to rounding, float64), and α stays in [0, 1] under a huge α step."""
    cfg = _cfg("apfl", "client.method.options.alpha_lr=1000", *F64)
    exp = Experiment.from_config(cfg)
    st = exp.init()
    job = exp.plan_round(st).jobs[0]
    res = exp.algorithm.method.run(exp.trainer, job)
    plain = exp.trainer.run(job)
    assert torch.allclose(res.update, plain.update, rtol=0, atol=1e-12)
    assert 0.0 <= float(res.state["mix"][0]) <= 1.0
    assert float(res.state["mix"][0]) in (0.0, 1.0)  # a huge step is clipped


# ------------------------------------------- against the rules written out here
def _job(method, *over):
    cfg = _cfg(method, *F64, *over)
    exp = Experiment.from_config(cfg)
    st = exp.init()
    return exp, st, exp.plan_round(st)


def _module_at(exp, w):
    m = copy.deepcopy(exp.module)
    exp.layout.load_into(m, w)
    m.train()
    return m


def _flat(exp, m):
    return exp.layout.flatten(m).detach()


def _batches(exp, job, tag=None, epochs=None):
    gen = torch.Generator()
    gen.manual_seed(job.gen_seed if tag is None else
                    derive_seed(job.gen_seed, job.round, job.client, tag))
    return exp.trainer.batch_indices(int(job.y.shape[0]), gen, epochs)


def _sgd_pass(m, job, batches, lr, frozen=(), loss_fn=None):
    """FL-bench's fit loop: zero_grad, loss, backward, zero the frozen params'
    grads, optimizer.step."""
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    for idx in batches:
        opt.zero_grad()
        x, y = job.x[idx], job.y[idx]
        loss = F.cross_entropy(m(x), y) if loss_fn is None else loss_fn(m, x, y)
        loss.backward()
        for name, p in m.named_parameters():
            if name in frozen:
                p.grad.zero_()
        opt.step()


def test_fedper_and_fedbabu_local_rounds_equal_fl_benchs_rule():
    for method in ("fedper", "fedbabu"):
        exp, _, plan = _job(method)
        job = plan.jobs[0]
        res = exp.algorithm.method.run(exp.trainer, job)
        m = _module_at(exp, job.w)
        head = set(exp.layout.groups[-1].tensors)
        _sgd_pass(m, job, _batches(exp, job), job.lr, frozen=head if method == "fedbabu" else ())
        w_k = _flat(exp, m)
        h = _head(exp)
        got = job.w - res.update
        if method == "fedper":  # the head is kept, not sent
            assert float((got[: h.start] - w_k[: h.start]).abs().max()) < TOL
            assert float((res.state["head"] - w_k[h]).abs().max()) < TOL
            assert float(res.update[h].abs().max()) < TOL
        else:
            assert float((got - w_k).abs().max()) < TOL


def test_fedrep_local_round_equals_fl_benchs_rule():
    """Head epochs with the body frozen, then body epochs with the head frozen."""
    exp, _, plan = _job("fedrep", "client.method.options.head_epochs=2",
                         "client.method.options.body_epochs=1")
    job = plan.jobs[0]
    res = exp.algorithm.method.run(exp.trainer, job)
    m = _module_at(exp, job.w)
    head = set(exp.layout.groups[-1].tensors)
    body = {n for n, _ in m.named_parameters()} - head
    _sgd_pass(m, job, _batches(exp, job, "fedrep-0", 2), job.lr, frozen=body)
    _sgd_pass(m, job, _batches(exp, job, "fedrep-1", 1), job.lr, frozen=head)
    w_k = _flat(exp, m)
    h = _head(exp)
    assert float(((job.w - res.update)[: h.start] - w_k[: h.start]).abs().max()) < TOL
    assert float((res.state["head"] - w_k[h]).abs().max()) < TOL


def test_moon_local_round_equals_the_public_loss():
    """MOON's loss as the public code writes it: ``−log(exp(s_g/τ) / (exp(s_p/τ) +
    exp(s_g/τ)))``, μ × its mean added to the cross-entropy; z = the head's input.
    Second round, so the previous model is the client's own."""
    exp, st, plan = _job("moon", "client.method.options.mu=2", "cohort.size=10")
    st, _ = exp.round(st)
    plan = exp.plan_round(st)
    job = plan.jobs[0]
    assert bool(job.state["previous_set"][0] > 0)
    res = exp.algorithm.method.run(exp.trainer, job)
    head_name = exp.layout.groups[-1].name
    glob = _module_at(exp, job.w)
    prev = _module_at(exp, job.state["previous"])
    m = _module_at(exp, job.w)
    tau, mu = 0.5, 2.0

    def features(model, x):
        seen = []
        hook = dict(model.named_modules())[head_name].register_forward_pre_hook(
            lambda _m, a: seen.append(a[0]))
        out = model(x)
        hook.remove()
        return out, seen[0]

    def loss_fn(model, x, y):
        logit, z = features(model, x)
        with torch.no_grad():
            _, zg = features(glob, x)
            _, zp = features(prev, x)
        cos = nn.functional.cosine_similarity
        con = -torch.log(torch.exp(cos(z.flatten(1), zg.flatten(1)) / tau) / (
            torch.exp(cos(zp.flatten(1), z.flatten(1)) / tau)
            + torch.exp(cos(z.flatten(1), zg.flatten(1)) / tau)))
        return F.cross_entropy(logit, y) + mu * con.mean()

    _sgd_pass(m, job, _batches(exp, job), job.lr, loss_fn=loss_fn)
    assert float(((job.w - res.update) - _flat(exp, m)).abs().max()) < 1e-12


def test_feddyn_two_rounds_equal_the_papers_algorithm():
    """Acar et al., Algorithm 1, every client every round: local steps on
    ``CE − ⟨g_k, θ⟩ + (α/2)‖θ − w‖²``, ``g_k ← g_k − α(θ_k − w)``,
    ``h ← h − (α/N) Σ (θ_k − w)``, ``w ← mean θ_k − h/α`` — with fedloom's two
    roundings written in: the uplink (identity) carries float32 values, and the
    store keeps ``g_k`` in float32 (``state.dtype``)."""
    alpha = 0.1
    over = [f"client.method.options.alpha={alpha}", "cohort.size=10",
            "aggregator.options.weighted=false", "server.lr=1.0", "rounds=2"]
    cfg = _cfg("feddyn", *F64, *over)
    res = fedloom.run(cfg)
    exp = Experiment.from_config(cfg)
    st = exp.init()
    n = cfg.data.num_clients
    g = torch.zeros(n, exp.layout.size, dtype=torch.float64)
    h = torch.zeros(exp.layout.size, dtype=torch.float64)
    w = st.w.clone()
    for r in range(2):
        plan = exp.plan_round(st)
        thetas = []
        for job in plan.jobs:
            k = job.client
            m = _module_at(exp, w)

            def loss_fn(model, x, y, k=k, w=w):
                theta = torch.cat([p.reshape(-1) for p in model.parameters()])
                return (F.cross_entropy(model(x), y) - torch.dot(g[k], theta)
                        + alpha / 2 * torch.sum((theta - w) ** 2))

            _sgd_pass(m, job, _batches(exp, job), job.lr, loss_fn=loss_fn)
            theta = _flat(exp, m)
            g_new = g[k] - alpha * (theta - w)
            h = h + (g_new - g[k]) / n  # = h − (α/N)(θ_k − w)
            g[k] = _f32(g_new)  # the store keeps client state in state.dtype
            thetas.append(theta)
        # the server averages what the wire carried: identity sends float32
        w = w - torch.stack([_f32(w - t) for t in thetas]).mean(0) - h / alpha
        st = dataclasses_replace_w(st, r + 1, w)
    assert float((res.w - w).abs().max()) < 1e-12


def _f32(x):
    return x.float().double()


def dataclasses_replace_w(st, next_round, w):
    import dataclasses

    return dataclasses.replace(st, next_round=next_round, w=w)


def test_apfl_local_round_equals_the_papers_algorithm():
    """Deng et al., Algorithm 1, second round (v_k and α_k from the first), each step
    from the step's start: ``w ← w − η∇f(w)``, ``v ← v − ηα∇f(v̄)``,
    ``α ← clip(α − η⟨v − w, ∇f(v̄)⟩)``, v̄ = αv + (1 − α)w."""
    exp, st, plan = _job("apfl", "cohort.size=10")
    st, _ = exp.round(st)
    plan = exp.plan_round(st)
    job = plan.jobs[0]
    res = exp.algorithm.method.run(exp.trainer, job)
    w = job.w.clone()
    v = job.state["personal"].clone()
    a = float(job.state["mix"][0])
    m = _module_at(exp, w)

    def grad_at(theta, x, y):
        exp.layout.load_into(m, theta)
        m.zero_grad()
        F.cross_entropy(m(x), y).backward()
        return torch.cat([p.grad.reshape(-1) for p in m.parameters()])

    for idx in _batches(exp, job):
        x, y = job.x[idx], job.y[idx]
        gw = grad_at(w, x, y)
        gbar = grad_at(a * v + (1 - a) * w, x, y)
        w, v, a = (w - job.lr * gw, v - job.lr * a * gbar,
                   min(1.0, max(0.0, a - job.lr * float(torch.dot(v - w, gbar)))))
    assert float(((job.w - res.update) - w).abs().max()) < 1e-12
    assert float((res.state["personal"] - v).abs().max()) < 1e-12
    assert abs(float(res.state["mix"][0]) - a) < 1e-12


@pytest.mark.parametrize("over", [[], F64, ["client.method.options.adaptive=false"]],
                         ids=["float32", "float64", "fixed_alpha"])
def test_apfl_on_the_step_loop_has_its_plain_loops_bits(over):
    """APFL on the one step loop (``W = [w; v]``, each row's step scaled by the
    gradient function, η = 1) gives the bits of its rule looped plainly —
    ``w − η g_w``, ``v − (ηα) ḡ``, α clipped — on the same batches and gradients,
    in the second round (``v``, α from the store)."""
    from fedloom.client.apfl import _grad

    exp = Experiment.from_config(_cfg("apfl", "cohort.size=3", *over))
    st, _ = exp.round(exp.init())
    job = exp.plan_round(st).jobs[0]
    tr, method = exp.trainer, exp.algorithm.method
    res = method.run(tr, job)
    w = job.w.clone()
    v, a = job.state["personal"].to(w.dtype).clone(), float(job.state["mix"][0])
    bufs_w = {n: t.clone() for n, t in (job.buffers or tr._flat_module().init_buffers).items()}
    bufs_v = {n: t.clone() for n, t in bufs_w.items()}
    tr.module.train()
    for step, idx in enumerate(tr.job_batches(job)):
        xb, yb = tr.batch(job.x, idx, job.gen_seed, step), job.y[idx]
        _, g_w = _grad(tr.module, tr.layout, w, xb, yb, bufs_w)
        _, g_bar = _grad(tr.module, tr.layout, a * v + (1 - a) * w, xb, yb, bufs_v)
        d_alpha = float(torch.dot(v - w, g_bar))
        w, v = w - job.lr * g_w, v - job.lr * a * g_bar
        if method.adaptive:
            a = min(1.0, max(0.0, a - job.lr * d_alpha))
    assert torch.equal(res.update, job.w - w)
    assert torch.equal(res.state["personal"], v)
    assert res.extra["apfl_alpha"] == a and float(res.state["mix"][0]) == float(
        torch.tensor([a], dtype=w.dtype)[0])


def test_fedbabu_runs_on_the_lock_step_trainer_with_sequentials_bits(caplog):
    """FedBABU in its new shape (a Mask term in its jobs, no run() of its own) is
    lock-step's, not a fallback to sequential, and gives sequential's model."""
    import logging

    import fedloom

    caplog.set_level(logging.INFO, logger="fedloom")
    ov = ["client.method=fedbabu", "rounds=2"]
    lock = fedloom.run(copy.deepcopy(TINY), [*ov, "backend.name=lockstep"])
    assert not [r for r in caplog.records if "fedbabu" in r.getMessage()]
    seq = fedloom.run(copy.deepcopy(TINY), [*ov, "backend.name=sequential"])
    assert lock.summary["model_sha256"] == seq.summary["model_sha256"]
