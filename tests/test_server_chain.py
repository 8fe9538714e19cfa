"""The server step as a chain of transforms (fedloom.server_opt on the one
transform protocol of fedloom.transforms): the named optimizers give the
pre-move models bit for bit and resume their flat states, chains compose as
written, and a chain of one's own runs (and resumes) as a named optimizer does."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import yaml

import fedloom
import fedloom.client.transforms
import fedloom.transforms
from conftest import TINY
from fedloom.engine.runs.legacy import legacy_opt_state
from fedloom.registry import accepted_options, get
from fedloom.server_opt import (
    Chain,
    ServerOptimizer,
    chain,
    heavy_ball,
    scale,
    scale_by_adagrad,
    scale_by_adam,
    scale_by_yogi,
)

NAMES = ("sgd", "momentum", "adam", "yogi", "adagrad")


# The pre-move implementation (fedloom.aggregate.server_opt before the server step
# became a chain), frozen here as the reference of the bit-for-bit tests.
@dataclass(frozen=True)
class _PreMove:
    kind: str = "sgd"
    lr: float = 1.0
    momentum: float = 0.9
    beta1: float = 0.9
    beta2: float = 0.99
    eps: float = 1e-3

    def init(self, w):
        if self.kind == "sgd":
            return {}
        if self.kind == "momentum":
            return {"v": torch.zeros_like(w)}
        state = {"v": torch.full_like(w, self.eps**2)}
        if self.kind in ("adam", "yogi"):
            state["m"] = torch.zeros_like(w)
        return state

    def step(self, w, agg, state):
        if self.kind == "sgd":
            return w - self.lr * agg, state
        if self.kind == "momentum":
            v = self.momentum * state["v"] + agg
            return w - self.lr * v, {"v": v}
        sq = agg * agg
        if self.kind == "adagrad":
            v = state["v"] + sq
            return w - self.lr * agg / (v.sqrt() + self.eps), {"v": v}
        m = self.beta1 * state["m"] + (1 - self.beta1) * agg
        if self.kind == "adam":
            v = self.beta2 * state["v"] + (1 - self.beta2) * sq
        elif self.kind == "yogi":
            v = state["v"] - (1 - self.beta2) * sq * torch.sign(state["v"] - sq)
        else:
            raise ValueError(f"server.optimizer: unknown {self.kind!r}")
        return w - self.lr * m / (v.sqrt() + self.eps), {"m": m, "v": v}


SETTINGS = [
    {},  # the factories' defaults
    {"lr": 0.037, "momentum": 0.55, "beta1": 0.83, "beta2": 0.971, "eps": 3e-3},
    {"lr": 1.7, "momentum": 0.99, "beta1": 0.5, "beta2": 0.5, "eps": 1e-6},
]


def _directions(dtype, steps=5, d=257, seed=0):
    """Directions of mixed scales (tiny to large), signs and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        x = torch.randn(d, generator=g, dtype=torch.float64)
        x = x * torch.logspace(-6, 2, d, dtype=torch.float64)[torch.randperm(d, generator=g)]
        x[t::17] = 0.0
        out.append(x.to(dtype))
    return out


def _flat(state):
    """A chain's tuple state as the one flat mapping the pre-move optimizer kept
    (a named optimizer has one transform with a state at most)."""
    if isinstance(state, dict):
        return state
    out = {}
    for own in state:
        assert own is None or not (out.keys() & own.keys())
        out.update(own or {})
    return out


def _same_state(a, b):
    a, b = _flat(a), _flat(b)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("settings", range(len(SETTINGS)))
@pytest.mark.parametrize("name", NAMES)
def test_each_name_is_the_pre_move_optimizer_bit_for_bit(name, settings, dtype):
    factory = get("server_optimizer", name)
    kw = accepted_options(factory, SETTINGS[settings])
    new, ref = factory(**kw), _PreMove(name, **kw)
    assert isinstance(new, ServerOptimizer) and new.kind == name
    w = torch.randn(257, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w = w.to(dtype)
    w_new, s_new = w, new.init(w)
    w_ref, s_ref = w, ref.init(w)
    _same_state(s_new, s_ref)
    for agg in _directions(dtype):
        w_new, s_new = new.step(w_new, agg, s_new)
        w_ref, s_ref = ref.step(w_ref, agg, s_ref)
        assert w_new.dtype == dtype and torch.equal(w_new, w_ref)
        _same_state(s_new, s_ref)


@pytest.mark.parametrize("name", NAMES)
def test_a_pre_move_state_resumes(name):
    """An opt_state written by the pre-move optimizer continues as if never stopped."""
    ref = _PreMove(name, lr=0.3)
    new = ServerOptimizer(name, lr=0.3)
    dirs = _directions(torch.float32, steps=6, seed=5)
    w = torch.ones(257)
    w_ref, s_ref = w, ref.init(w)
    for agg in dirs[:3]:
        w_ref, s_ref = ref.step(w_ref, agg, s_ref)
    # the flat mapping of a checkpoint written before the chain's tuple state (after a
    # step adam's holds m before v: read by name)
    w_new, s_new = w_ref, legacy_opt_state(dict(s_ref), lambda: new.init(w))
    assert isinstance(s_new, tuple)
    for agg in dirs[3:]:
        w_new, s_new = new.step(w_new, agg, s_new)
        w_ref, s_ref = ref.step(w_ref, agg, s_ref)
    assert torch.equal(w_new, w_ref)
    _same_state(s_new, s_ref)


def test_the_registry_names_the_packages_objects():
    from fedloom.server_opt import optimizers

    assert get("server_optimizer", "adam") is optimizers.adam
    assert optimizers.adam(lr=0.1) == ServerOptimizer("adam", lr=0.1)
    assert optimizers.make_server_optimizer("yogi", lr=0.2).chain == chain(scale_by_yogi(lr=0.2))
    with pytest.raises(ValueError, match="unknown 'adamw'"):
        ServerOptimizer("adamw").init(torch.zeros(3))


def test_the_old_module_of_the_optimizers_is_translated():
    """fedloom.aggregate.server_opt is gone: a config (or a run directory's) naming a
    factory there as ``module:attr`` names it in fedloom.server_opt.optimizers, and a
    ServerOptimizer recorded as an object under its old module resumes under the new."""
    from fedloom.config import load_config
    from fedloom.config.translate import translate
    from fedloom.engine.objects import moved_objects

    got = translate({"server": {"optimizer": "fedloom.aggregate.server_opt:adam"}})
    assert got["server"] == {"optimizer": "fedloom.server_opt.optimizers:adam"}
    got = translate({"server": {"optimizer": {"name": "fedloom.aggregate.server_opt:yogi",
                                              "options": {"beta1": 0.5}}}})
    assert got["server"]["optimizer"] == {"name": "fedloom.server_opt.optimizers:yogi",
                                          "options": {"beta1": 0.5}}
    cfg = load_config(_tiny(), ["server.optimizer=fedloom.aggregate.server_opt:adam"])
    assert cfg.server.optimizer.name == "fedloom.server_opt.optimizers:adam"
    old = {"server": {"optimizer": {"name": "object fedloom.aggregate.server_opt."
                                            "ServerOptimizer", "options": {}}}}
    assert moved_objects(old)["server"]["optimizer"]["name"] == (
        "object fedloom.server_opt.optimizers.ServerOptimizer")


def test_one_chain_serves_the_local_and_the_server_step():
    assert chain is fedloom.transforms.chain is fedloom.client.transforms.chain
    assert Chain is fedloom.transforms.Chain is fedloom.client.transforms.Chain
    # the chain's state is the tuple of its transforms' (None: stateless)
    w = torch.zeros(3)
    s = chain(heavy_ball(0.9), scale(0.5)).init(w)
    assert isinstance(s, tuple) and len(s) == 2 and s[1] is None and list(s[0]) == ["v"]
    assert ServerOptimizer("sgd").init(w) == (None,)


def test_the_earlier_names_still_work_and_warn():
    from fedloom.server_opt import adagrad, adam, momentum, yogi

    w, dirs = torch.randn(257, dtype=torch.float64), _directions(torch.float64)
    for old, new in ((lambda: momentum(0.7, prefix="h"), heavy_ball(0.7)),
                     (lambda: adam(0.8, 0.9, 1e-2), scale_by_adam(0.8, 0.9, 1e-2)),
                     (lambda: yogi(), scale_by_yogi()),
                     (lambda: adagrad(1e-2), scale_by_adagrad(1e-2))):
        with pytest.warns(DeprecationWarning, match=r"fedloom\.server_opt\.\w+ is now"):
            t = old()
        assert t == new
    # a scale after a preconditioner multiplies its quotient now: the named step in
    # exact arithmetic, to the last bits
    with pytest.warns(DeprecationWarning):
        mine = chain(adam(), scale(0.05))
    got, ref = _run(mine, w, dirs), _run(ServerOptimizer("adam", lr=0.05), w, dirs)
    assert torch.allclose(got[0], ref[0], rtol=0, atol=1e-12)
    _same_state(got[1], ref[1])


def _run(c, w, dirs):
    s = c.init(w)
    for agg in dirs:
        w, s = c.step(w, agg, s)
    return w, s


@pytest.mark.parametrize("inner", [lambda: heavy_ball(0.7), lambda: scale_by_adam(),
                                   lambda: scale_by_yogi(0.8), lambda: scale_by_adagrad(1e-2)],
                         ids=["heavy_ball", "adam", "yogi", "adagrad"])
def test_scale_one_is_the_identity(inner):
    w, dirs = torch.randn(257), _directions(torch.float32)
    ref = _run(chain(inner()), w, dirs)
    for c in (chain(scale(1.0), inner()), chain(inner(), scale(1.0)),
              chain(scale(1.0), inner(), scale(1.0))):
        got = _run(c, w, dirs)
        assert torch.equal(got[0], ref[0])
        _same_state(got[1], ref[1])
    # the empty chain steps by the aggregate itself
    assert torch.equal(_run(chain(), w, dirs[:1])[0], w - dirs[0])


def test_the_chain_applies_its_transforms_in_order():
    w, dirs = torch.randn(257, dtype=torch.float64), _directions(torch.float64)
    # a power of two scales exactly: before momentum, the same steps with v doubled
    w_a, s_a = _run(chain(scale(2.0), heavy_ball(0.5)), w, dirs)
    w_b, s_b = _run(chain(heavy_ball(0.5), scale(2.0)), w, dirs)
    assert torch.equal(w_a, w_b) and torch.equal(s_a[1]["v"], 2.0 * s_b[0]["v"])
    # before adam, a scale changes what the moments see: another step
    w_c, _ = _run(chain(scale(0.1), scale_by_adam()), w, dirs)
    w_d, _ = _run(chain(scale_by_adam(), scale(0.1)), w, dirs)
    assert not torch.allclose(w_c, w_d)
    # a transform after a preconditioner sees its whole direction d/(√v + τ)
    c = chain(scale_by_adagrad(1e-2), heavy_ball(0.5))
    s = c.init(w)
    agg = dirs[0]
    v = s[0]["v"] + agg * agg
    step = agg / (v.sqrt() + 1e-2)
    w1, s1 = c.step(w, agg, s)
    assert torch.equal(w1, w - (0.5 * s[1]["v"] + step))
    assert torch.equal(s1[0]["v"], v) and torch.equal(s1[1]["v"], step)


def test_two_transforms_of_a_kind_keep_their_own_state():
    w, dirs = torch.randn(257, dtype=torch.float64), _directions(torch.float64)
    w_2, s_2 = _run(chain(heavy_ball(0.5), heavy_ball(0.25)), w, dirs)
    v1 = v2 = torch.zeros_like(w)
    for agg in dirs:
        v1 = 0.5 * v1 + agg
        v2 = 0.25 * v2 + v1
        w = w - v2
    assert torch.equal(w_2, w)
    assert torch.equal(s_2[0]["v"], v1) and torch.equal(s_2[1]["v"], v2)


def test_a_step_leaves_the_given_state_and_direction_alone():
    """The engine keeps the old state when a step is not finite and reads the
    aggregate after the step: neither is modified in place."""
    for c in (ServerOptimizer("adam", lr=0.1), ServerOptimizer("momentum"),
              chain(scale_by_yogi(), heavy_ball(0.3), scale(0.5))):
        w = torch.randn(9)
        s0 = c.init(w)
        kept = copy.deepcopy(s0)
        agg = torch.full((9,), float("inf"))
        agg_kept = agg.clone()
        w1, _ = c.step(w, agg, s0)
        assert not bool(torch.isfinite(w1).all())
        for own, own_kept in zip(s0, kept, strict=True):
            if own is not None:
                _same_state(own, own_kept)
        assert torch.equal(agg, agg_kept)


def test_the_legacy_reader_fills_each_transform_by_name_and_refuses_a_mismatch():
    w = torch.zeros(4)
    c = chain(scale_by_adagrad(1e-2), heavy_ball(0.5), scale(0.1))
    # a user's chain of the flat layout: the second momentum's entry under its prefix
    v, h = torch.full((4,), 2.0), torch.full((4,), 3.0)
    got = legacy_opt_state({"v": v, "mom_v": h}, lambda: c.init(w))
    assert got[2] is None and got[0]["v"] is v and got[1]["v"] is h
    # today's layout, and a state of one's own optimizer, are returned as they are
    today = c.init(w)
    assert legacy_opt_state(today, lambda: c.init(w)) is today
    mine = {"anything": w}
    assert legacy_opt_state(mine, lambda: {"anything": w}) is mine
    for bad, why in (({"v": v}, "no tensor 'v'"),  # the momentum's entry missing
                     ({"v": v, "mom_v": torch.zeros(5)}, "shape and dtype"),
                     ({"v": v, "mom_v": h, "m": h}, "holds 'm'")):
        with pytest.raises(ValueError, match=why):
            legacy_opt_state(bad, lambda: c.init(w))


def _tiny():
    return copy.deepcopy(TINY)


# the named optimizers at their default options, the chains of the same settings
@pytest.mark.parametrize("name, lr, obj", [
    ("momentum", 0.8, lambda: chain(heavy_ball(0.9), scale(0.8))),
    ("adam", 0.05, lambda: chain(scale_by_adam(0.9, 0.99, 1e-3, lr=0.05))),
])
def test_a_users_chain_runs_as_the_named_optimizer(name, lr, obj, tmp_path):
    ref = fedloom.run(_tiny(), ["rounds=2", f"server.optimizer={name}", f"server.lr={lr}"])
    got = fedloom.run(_tiny(), ["rounds=2", f"server.lr={lr}"], server=obj(),
                      out=tmp_path / "r")
    assert got.summary["model_sha256"] == ref.summary["model_sha256"]
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())["server"]["optimizer"]
    name = saved["name"] if isinstance(saved, dict) else saved  # {name, options} or a name
    assert name == "object fedloom.transforms.Chain"


def test_a_users_chain_resumes_on_the_uninterrupted_model(tmp_path):
    """Its state (``v``) rides in the checkpoint as a named optimizer's does."""
    c = chain(heavy_ball(0.5), scale(0.8))
    # server.lr: a number, as with any given object; a checkpoint every round
    ov = ["rounds=3", "server.lr=0.8", "checkpoint.every=1"]
    ref = fedloom.run(_tiny(), ov, server=c)
    out = tmp_path / "r"

    def stop(state, metrics):
        if state.next_round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fedloom.run(_tiny(), ov, server=c, out=out, callbacks=[stop])
    ran: list[int] = []
    res = fedloom.run(_tiny(), ov, server=c, out=out, resume=True,
                      callbacks=[lambda state, metrics: ran.append(metrics["round"])])
    assert ran == [3]  # from round 2's checkpoint
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]


def _as_before_the_move(out):
    """``out``'s newest checkpoint as a version before the chain's tuple state wrote
    it: one flat opt_state, and a chain given as an object under its old class name."""
    from fedloom.engine.runs.checkpoint import load_checkpoint, save_checkpoint
    from fedloom.engine.runs.directory import CHECKPOINT_FILE

    old, new = "object fedloom.server_opt.transforms.Chain", "object fedloom.transforms.Chain"
    ck = load_checkpoint(out / CHECKPOINT_FILE)
    flat = _flat(ck["opt_state"])
    ck["opt_state"] = dict(reversed(flat.items()))  # after a step adam's held m first
    if ck["config"]["server"]["optimizer"]["name"] == new:
        ck["config"]["server"]["optimizer"]["name"] = old
        cfg = out / "config.yaml"
        cfg.write_text(cfg.read_text().replace(new, old))
    save_checkpoint(out / CHECKPOINT_FILE, ck)


@pytest.mark.parametrize("given", ["adam", "chain"])
def test_a_checkpoint_of_the_flat_layout_resumes(given, tmp_path):
    """A run directory written before the tuple state (a named optimizer's flat
    ``v``, ``m``; a chain of one's own under its old class name) resumes on the
    uninterrupted model."""
    ov = ["rounds=3", "checkpoint.every=1", "server.lr=0.05"]
    kw = {}
    if given == "adam":
        ov.append("server.optimizer=adam")
    else:
        kw["server"] = chain(heavy_ball(0.5), scale(0.05))
    ref = fedloom.run(_tiny(), ov, **kw)
    out = tmp_path / "r"

    def stop(state, metrics):
        if state.next_round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fedloom.run(_tiny(), ov, out=out, callbacks=[stop], **kw)
    _as_before_the_move(out)
    ran: list[int] = []
    res = fedloom.run(_tiny(), ov, out=out, resume=True,
                      callbacks=[lambda state, metrics: ran.append(metrics["round"])], **kw)
    assert ran == [3]  # from round 2's checkpoint
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]


def test_a_flower_strategy_takes_a_chain():
    """FedloomRule takes a chain as its server optimizer; its summary names it."""
    pytest.importorskip("flwr")
    from fedloom.integrations.flower.strategies import FedloomRule

    strat = FedloomRule("fedavg", server_optimizer=chain(heavy_ball(0.9), scale(0.5)),
                        min_available_nodes=2, min_train_nodes=2)
    strat.summary()  # names the chain by its class (a named optimizer: kind and lr)
    assert isinstance(strat.server, Chain)
