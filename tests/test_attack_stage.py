"""The attack stage in a run: what each attack sees of the round, its place before
every client's feedback policy and codec, every backend, resume, data poisoning and
the attack success rate."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import fedloom
from conftest import TINY, stop_and_resume
from fedloom.attack import Attack, Backdoor, LabelFlip
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment
from fedloom.metrics import evaluate

EF = ["compression.name=topk", "compression.options.ratio=0.1", "compression.feedback=ef"]
F64 = ["dtype=float64", "cohort.size=10"]


def _round_seen(overrides: list[str], rounds_before: int = 0):
    """Run ``rounds_before`` rounds, then one round's stages by hand: the attackers, the
    updates as trained (by client), the plan and what the uplink made of them."""
    exp = Experiment.from_config(load_config(TINY, [*F64, *overrides]))
    try:
        st = exp.init()
        for _ in range(rounds_before):
            st, _ = exp.round(st)
        plan = exp.plan_round(st)
        raw = exp.train_cohort(plan.jobs)
        trained = {res.client: res.update.detach().clone() for res in raw if res is not None}
        fb = [{k: v.clone() for k, v in rows.items()} for rows in plan.fb_rows]
        _, outcome = exp.uplink_round(st, plan, raw)
        attackers = exp.around.attack.clients
    finally:
        exp.close()
    return attackers, trained, fb, plan, outcome


def _sent(plan, up, d: int) -> torch.Tensor:
    """What the server reads of ``up``: the decode of its payload."""
    return plan.comp.decode(up.payload, d)


def _through(plan, g: torch.Tensor) -> torch.Tensor:
    """``g`` encoded and decoded by the round's codec (the identity carries float32)."""
    return plan.comp.decode(plan.comp.encode(g), g.numel())


def test_an_omniscient_attack_sees_the_rounds_honest_updates():
    """IPM (ε = 2): every attacker sends −2·mean of the honest clients' trained updates
    of the round (float64; what the server reads is that row through the identity
    codec), every honest client its own update."""
    attackers, trained, _, plan, out = _round_seen(
        ["attack.name=ipm", "attack.fraction=0.3", "attack.options.epsilon=2"])
    honest = torch.stack([u for k, u in trained.items() if k not in attackers])
    assert len(attackers) == 3 and honest.shape[0] == 7
    expected = _through(plan, -2 * honest.double().mean(0))
    d = honest.shape[1]
    for res, up in zip(out.results, out.ups, strict=True):
        want = expected if res.client in attackers else _through(plan, trained[res.client])
        assert torch.equal(_sent(plan, up, d), want)


def test_colluders_see_only_their_own_updates():
    attackers, trained, _, plan, out = _round_seen(
        ["attack.name=ipm", "attack.fraction=0.3", "attack.options.knowledge=colluders"])
    # in cohort order, as the stage stacks them (a mean's bits depend on the order)
    own = torch.stack([trained[res.client] for res in out.results
                       if res.client in attackers])
    sent = [_sent(plan, up, own.shape[1]) for res, up in zip(out.results, out.ups, strict=True)
            if res.client in attackers]
    assert len(sent) == 3
    for row in sent:
        assert torch.equal(row, _through(plan, -0.1 * own.double().mean(0)))


def test_the_attackers_row_goes_through_its_own_residual_and_codec():
    """Top-k (10 %) with error feedback, after one round (residuals are not zero): an
    attacker sends topk(a + e_k), a the attack's row (ALIE of the honest updates), e_k
    its own residual, and keeps a + e_k − topk(a + e_k); an honest client the same with
    its trained update. The attack sees the updates before anyone's compression."""
    attackers, trained, fb, plan, out = _round_seen(
        ["attack.name=alie", "attack.fraction=0.3", "attack.options.z=1.0", *EF], 1)
    honest = torch.stack([u for k, u in trained.items() if k not in attackers]).double()
    a = honest.mean(0) + honest.std(0, correction=1)
    seen_attacker = 0
    for i, (res, up) in enumerate(zip(out.results, out.ups, strict=True)):
        e = fb[i]["residual"]
        assert float(e.abs().max()) > 0  # round 2: the residual carries round 1's rest
        g = a if res.client in attackers else trained[res.client]
        u = g + e
        sent = plan.comp.decode(plan.comp.encode(u), u.numel())
        assert torch.allclose(_sent(plan, up, u.numel()), sent, rtol=0, atol=1e-12)
        assert torch.allclose(up.state["residual"], u - sent, rtol=0, atol=1e-12)
        seen_attacker += res.client in attackers
    assert seen_attacker == 3


def _same_as_sequential(attack: list[str], backend: list[str]) -> None:
    """Two rounds in float64 with 30 % attackers: ``backend`` gives the sequential
    backend's model bit for bit."""
    cfg = {**copy.deepcopy(TINY), "rounds": 2}
    over = [*F64, "attack.fraction=0.3", *attack]
    ref = fedloom.run(cfg, over)
    res = fedloom.run(cfg, [*over, *backend])
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]


@pytest.mark.parametrize("backend", [["backend=vmap"], ["backend=lockstep"]],
                         ids=["vmap", "lockstep"])
def test_batched_backends_give_the_sequential_model(backend):
    """ALIE (every honest update of the round, z from the round's n and f)."""
    _same_as_sequential(["attack.name=alie"], backend)


@pytest.mark.slow
def test_process_workers_train_the_poisoned_samples_they_were_sent():
    """A backdoor on two process workers: they are sent the poisoned data once (the
    workers' start is most of its 10-20 s: marked slow)."""
    _same_as_sequential(["attack.name=backdoor", "attack.options.target=1"],
                        ["backend=process", "backend.options.workers=2"])


@pytest.mark.slow
@pytest.mark.parametrize("backend", [["backend=process", "backend.options.workers=2"],
                                     ["backend=ray", "backend.options.workers=2"]],
                         ids=["process", "ray"])
def test_workers_elsewhere_give_the_sequential_model_under_alie(backend):
    """ALIE on process and Ray workers (their start is most of the time: marked slow)."""
    if "backend=ray" in backend:
        pytest.importorskip("ray")
    _same_as_sequential(["attack.name=alie"], backend)


def test_resume_is_bit_identical(tmp_path):
    """Gaussian attackers (their noise from (seed, round, client)), stopped after round 2."""
    cfg = {**copy.deepcopy(TINY), "rounds": 4}
    ref, res = stop_and_resume(cfg, ["attack.name=gaussian", "attack.fraction=0.3",
                                     "attack.options.sigma=0.01"], tmp_path / "run")
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    other = fedloom.run(cfg, ["attack.name=gaussian", "attack.fraction=0.3",
                              "attack.options.sigma=0.01", "seed=4"])
    assert other.summary["model_sha256"] != ref.summary["model_sha256"]


def test_inf_rows_are_refused_and_counted_never_averaged():
    res = fedloom.run({**copy.deepcopy(TINY), "rounds": 2},
                      [*F64, "attack.name=inf", "attack.fraction=0.3"])
    assert res.metrics[-1]["rejected_updates_total"] == 6  # 3 attackers, 2 rounds
    assert bool(torch.isfinite(res.w).all())


def test_label_flip_poisons_only_the_attackers_samples():
    cfg = load_config(TINY, ["attack.name=label_flip", "attack.fraction=0.3"])
    exp, clean = Experiment.from_config(cfg), Experiment.from_config(load_config(TINY))
    try:
        fed, y, y0 = exp.clients.fed, exp.clients.y, clean.clients.y
        mine = np.concatenate([fed.train[k] for k in exp.around.attack.clients])
        others = np.setdiff1d(np.arange(len(y)), mine)
        assert torch.equal(y[mine], 9 - y0[mine])   # digits: C = 10, y ↦ 9 − y
        assert torch.equal(y[others], y0[others])   # honest and test samples untouched
        assert torch.equal(exp.clients.x, clean.clients.x)
    finally:
        exp.close()
        clean.close()


def test_backdoor_raises_the_attack_success_rate():
    """Digits, 30 % backdoor attackers (half their samples triggered, label 1, model
    replacement) against the same run without them, 6 rounds: the attack success rate
    (triggered test samples not of class 1 classified as 1) is the accuracy on the
    backdoor's test set, and far above the clean model's on that set (measured: 1.0
    against 0.11, test accuracy 0.75 against 0.76)."""
    over = [*F64, "rounds=6"]
    res = fedloom.run(TINY, [*over, "attack.name=backdoor", "attack.fraction=0.3",
                             "attack.options.target=1"])
    exp = Experiment.from_config(load_config(TINY, over))
    try:
        clean = fedloom.run(TINY, over).w
        x, y = exp.evaluator.x_test, exp.evaluator.y_test
        bd = Backdoor(target=1)
        bd._range = (float(exp.clients.x.max()), float(exp.clients.x.min()))
        (xs, ys), = bd.test_sets(x, y).values()
        assert bool((ys == 1).all()) and xs.shape[0] == int((y != 1).sum())
        m = exp.space
        asr = res.metrics[-1]["attack_success_rate"]
        assert asr == evaluate(m.module, m.layout, res.w, xs, ys)[0]
        asr_clean = evaluate(m.module, m.layout, clean, xs, ys)[0]
    finally:
        exp.close()
    assert asr > asr_clean + 0.3, (asr, asr_clean)


def test_a_shared_sample_refuses_data_poisoning():
    x, y = torch.zeros(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    parts = [np.array([0, 1, 2]), np.array([2, 3]), np.array([4, 5])]
    with pytest.raises(ValueError, match=r"^attack\.name: .*theirs alone"):
        Attack(frozenset({0}), LabelFlip()).poison(x, y, parts, 3)
    _, y2 = Attack(frozenset({2}), LabelFlip()).poison(x, y, parts, 3)
    assert y2.tolist() == [0, 1, 2, 0, 1, 0]


@pytest.mark.parametrize(("override", "field"), [
    ("attack.options.z=nan", "attack.options.z"),
    ("attack.options.knowledge=all", "attack.options.knowledge"),
    ("attack.options.sigma=-1", "attack.options.sigma"),
])
def test_bad_options_name_the_field(override, field):
    name = "gaussian" if "sigma" in override else "alie"
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
        fedloom.run(TINY, ["rounds=1", "attack.fraction=0.3", f"attack.name={name}", override])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("options", "field"), [
    (["attack.options.target=10"], "attack.options.target"),
    (["attack.options.size=9"], "attack.options.size"),
    (["attack.options.fraction=0"], "attack.options.fraction"),
    (["attack.options.scale=0"], "attack.options.scale"),
])
def test_bad_backdoor_options_name_the_field(options, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        fedloom.run(TINY, ["rounds=1", "attack.fraction=0.3", "attack.name=backdoor", *options])


def test_buffered_async_arrivals_are_attacked_and_resume_bit_identical(tmp_path):
    """FedBuff (buffer 2 of 4 in flight): each server step's arrivals are one round of
    the stage (an attacker sees the honest arrivals of its step); resumed after step 2."""
    cfg = {**copy.deepcopy(TINY), "rounds": 4, "server": {"lr": 1.0},
           "system": {"profile": "uniform", "speed": [50, 500], "up_bps": [1e5, 1e6],
                      "down_bps": 1e7, "mode": "buffered", "concurrency": 4, "buffer": 2}}
    over = ["attack.name=ipm", "attack.fraction=0.3", "attack.options.epsilon=2"]
    ref, res = stop_and_resume(cfg, over, tmp_path / "run")
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    assert fedloom.run(cfg).summary["model_sha256"] != ref.summary["model_sha256"]


def test_flower_and_secagg_apps_refuse_attackers_in_one_line():
    """A Flower or SecAgg+ client trains and sends its own update: no attack stage runs
    there, so a config with attackers is refused rather than run honestly."""
    pytest.importorskip("flwr")
    from fedloom.integrations.flower.messages import _check_scope
    from fedloom.integrations.secagg import check_secagg_scope

    cfg = load_config(TINY, ["attack.fraction=0.3", "server.secure_aggregation=true"])
    for check in (_check_scope, check_secagg_scope):
        with pytest.raises(ConfigError, match=r"^attack\.fraction: ") as e:
            check(cfg)
        assert "\n" not in str(e.value)


def test_under_local_dp_the_attackers_row_is_clipped_like_any_clients():
    """privacy.mode local runs after the attack stage: an attacker (IPM, ε = 50: rows far
    above the clip) sends clip(a) + noise, as the client's own DP code does; with the
    noise at 1e-9 · C every row sent has norm ≤ C (+ 1e-6) and the attackers' are at C."""
    attackers, trained, _, plan, out = _round_seen(
        ["attack.name=ipm", "attack.fraction=0.3", "attack.options.epsilon=50",
         "privacy.mode=local", "privacy.clip=0.5", "privacy.noise_multiplier=1e-9"])
    d = next(iter(trained.values())).numel()
    for res, up in zip(out.results, out.ups, strict=True):
        norm = float(torch.linalg.vector_norm(_sent(plan, up, d)))
        assert norm <= 0.5 + 1e-6
        if res.client in attackers:
            assert norm == pytest.approx(0.5, abs=1e-6)


def test_a_population_generated_on_demand_takes_update_attacks_not_data_poisoning():
    """10⁶ users generated on demand: ALIE attacks the sampled users' updates (the run
    differs from the honest one); label flipping, which poisons stored samples, is
    refused in one line."""
    cfg = {"seed": 1, "rounds": 2, "dtype": "float64",
           "data": {"name": "synthetic-population", "num_clients": 10**6,
                    "partition": {"name": "natural"},
                    "options": {"dim": 3, "classes": 3, "max_size": 70, "test_users": 4}},
           "model": {"name": "mlp", "options": {"hidden": []}},
           "cohort": {"size": 8}, "client": {"lr": 0.05, "batch_size": 16, "steps": 2}}
    with pytest.raises(ConfigError, match=r"^attack\.name: label_flip poisons") as e:
        fedloom.run(cfg, ["attack.name=label_flip", "attack.fraction=0.5"])
    assert "\n" not in str(e.value)
    hostile = fedloom.run(cfg, ["attack.name=alie", "attack.fraction=0.5"])
    assert hostile.summary["model_sha256"] != fedloom.run(cfg).summary["model_sha256"]
