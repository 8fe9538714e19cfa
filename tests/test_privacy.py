"""Differential privacy (fedloom.privacy): the clip bound, the noise scale, the
accountant against dp-accounting's own computation, target ε, refusals, resume."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import dp_accounting as dpa
import pytest
import torch
import yaml
from scipy import stats

import fedloom
from conftest import TINY, stop_and_resume
from fedloom.accounting import Accountant
from fedloom.aggregate.base import make_aggregator
from fedloom.compress import make_compressor
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment
from fedloom.privacy import (
    AdaptiveClip,
    Privacy,
    check_privacy,
    check_secure_aggregation,
    clip_update,
    epsilon_central,
    epsilon_local,
    l2_norm,
    make_privacy,
    resolve_noise,
)
from fedloom.registry import build


def _central(z: float = 1.0, clip: float = 1.0, m: int = 4, n: int = 10,
             adaptive: AdaptiveClip | None = None) -> Privacy:
    return Privacy("central", clip=clip, noise_multiplier=z, delta=1e-5, cohort_size=m,
                   num_clients=n, seed=7, adaptive=adaptive)


# ------------------------------------------------------------------ clip bound
def _adversarial(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.finfo(dtype).max
    out = [torch.randn(1000, generator=g, dtype=dtype) * s
           for s in (1e-30, 1e-3, 1.0, 1e3, 1e30)]
    one = torch.zeros(1000, dtype=dtype)
    one[17] = big / 2                                  # one coordinate near the max
    out.append(one)
    out.append(torch.full((1000,), big / 4, dtype=dtype))  # Σ v² overflows in any dtype
    out.append(torch.full((5000,), torch.finfo(dtype).tiny / 8, dtype=dtype))  # subnormal
    out.append(torch.full((1000,), 1.0000001, dtype=dtype))  # just above a clip of √1000
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bound", [1e-6, 0.37, 31.6227766, 1e4])
def test_clip_bound_holds_for_huge_tiny_and_borderline_updates(dtype, bound):
    for v in _adversarial(dtype):
        c, n, scaled = clip_update(v, bound)
        assert l2_norm(c) <= bound, (l2_norm(c), bound)
        assert torch.isfinite(c).all()
        assert scaled == (n > bound)
        if scaled:  # the direction is kept (cosine in float64 with the input)
            vn = v.double() / float(v.abs().max())  # ‖v‖ itself may overflow float64
            cos = float((c.double() / l2_norm(c)) @ (vn / l2_norm(vn)))
            assert cos > 1 - 1e-5
            assert l2_norm(c) > bound * (1 - 1e-5)  # and it is clipped to C, not below
        else:
            assert c is v


def test_l2_norm_is_finite_and_exact_where_the_squares_overflow_or_underflow():
    v = torch.full((100,), 1e300, dtype=torch.float64)
    assert l2_norm(v) == pytest.approx(1e301, rel=1e-12)   # √100 · 1e300
    t = torch.full((100,), 1e-170, dtype=torch.float64)
    assert l2_norm(t) == pytest.approx(1e-169, rel=1e-12)
    assert l2_norm(torch.zeros(3)) == 0.0
    assert math.isnan(l2_norm(torch.tensor([1.0, float("nan")])))


def test_central_aggregate_clips_every_accepted_row_in_place():
    rows = torch.stack([torch.full((50,), 1e30), torch.full((50,), 1e-30), torch.ones(50),
                        torch.full((50,), -3.0)]).float()
    ok = torch.tensor([True, True, True, False])
    p = _central(z=0.0, clip=2.0)
    agg, _, m = p.aggregate(rows, ok, p.init(), 0)
    for i in range(3):
        assert l2_norm(rows[i]) <= 2.0
    assert m["dp_clipped"] == 2.0                         # the 1e30 row and the ones (norm √50)
    # z = 0: the clipped sum over the fixed denominator m̄ = 4; the rejected row adds nothing
    expect = (rows[0].double() + rows[1].double() + rows[2].double()) / 4
    assert torch.allclose(agg.double(), expect, rtol=1e-6, atol=0)


# ------------------------------------------------------------------ noise scale
def _sd_interval(n: int, sigma: float, conf: float = 0.999) -> tuple[float, float]:
    """Mean-zero normal samples: Σx²/σ² ~ χ²_n, so the sample sd √(Σx²/n) lies in
    σ·[√(χ²_{n,(1−c)/2}/n), √(χ²_{n,(1+c)/2}/n)] with probability c."""
    lo, hi = stats.chi2.ppf([(1 - conf) / 2, (1 + conf) / 2], n)
    return sigma * math.sqrt(lo / n), sigma * math.sqrt(hi / n)


def _sd(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


@pytest.mark.parametrize("z,clip,m", [(1.3, 0.7, 5), (0.4, 3.0, 2)])
def test_central_noise_has_std_z_c_over_the_fixed_denominator(z, clip, m):
    d = 20_000
    p = _central(z=z, clip=clip, m=m, n=20)
    rows = torch.zeros(m, d, dtype=torch.float64)
    ok = torch.ones(m, dtype=torch.bool)
    ok[0] = False  # a rejected client does not change the denominator
    agg, _, _ = p.aggregate(rows, ok, p.init(), 3)
    lo, hi = _sd_interval(d, z * clip / m)
    assert lo < _sd(agg) < hi
    assert abs(float(agg.mean())) < 4 * z * clip / m / math.sqrt(d)
    # the same (seed, round) gives the same noise; another round other noise
    again, _, _ = p.aggregate(rows, ok, p.init(), 3)
    other, _, _ = p.aggregate(rows, ok, p.init(), 4)
    assert torch.equal(agg, again) and not torch.equal(agg, other)


def test_adaptive_clipping_raises_the_update_noise_as_andrew_et_al_theorem_1():
    z, sb, m, d = 0.8, 1.5, 6, 20_000
    p = _central(z=z, clip=0.5, m=m, n=30, adaptive=AdaptiveClip(0.5, 0.2, sb))
    sigma = (z ** -2 - (2 * sb) ** -2) ** -0.5           # 0.83006
    agg, st, met = p.aggregate(torch.zeros(m, d, dtype=torch.float64),
                               torch.ones(m, dtype=torch.bool), p.init(), 0)
    lo, hi = _sd_interval(d, sigma * 0.5 / m)
    assert lo < _sd(agg) < hi
    # every update is below C (all zero): b̃ ≈ 1 > γ, so C shrinks by exp(−η(b̃ − γ))
    assert st["clip"] == pytest.approx(0.5 * math.exp(-0.2 * (met["dp_unclipped_fraction"] - 0.5)))
    with pytest.raises(ConfigError, match="count_stddev"):
        _central(z=2.0, adaptive=AdaptiveClip(0.5, 0.2, 0.9))   # needs 2σ_b > z


def test_noise_parameters_equal_flowers_dp_strategies():
    """Flower's DifferentialPrivacyServerSide{Fixed,Adaptive}Clipping: noise std
    z·C/m (compute_stdv) and the adaptive update noise with σ_b = m/20 by default
    (compute_adaptive_noise_params) — the same numbers as ours."""
    dp = pytest.importorskip("flwr.supercore.differential_privacy")
    for z, m, sb in ((0.8, 6, 1.5), (0.3, 10, None), (1.0, 50, None)):
        sd, sigma = dp.compute_adaptive_noise_params(z, m, sb)
        cfg = load_config(copy.deepcopy(TINY), [
            f"cohort.size={min(m, 10)}", "privacy.mode=central",
            f"privacy.noise_multiplier={z}", "privacy.adaptive_clip.enabled=true",
            f"privacy.adaptive_clip.count_stddev={'null' if sb is None else sb}"])
        cfg.cohort.size = m  # the mechanism only (no data needs m clients here)
        from fedloom.privacy import make_privacy

        p = make_privacy(cfg, 100)
        assert p.adaptive.count_stddev == sd
        assert p.sigma == pytest.approx(sigma, rel=1e-15)
    assert _central(z=1.3, clip=0.7, m=5).sigma * 0.7 / 5 == dp.compute_stdv(1.3, 0.7, 5)


def test_local_noise_has_std_z_c_and_comes_from_the_clients_stream():
    z, clip, d = 0.9, 0.25, 20_000
    p = Privacy("local", clip=clip, noise_multiplier=z, delta=1e-5, cohort_size=3,
                num_clients=9, seed=1)
    u = torch.zeros(d)
    a, clipped = p.privatize(u, 2, 5)
    lo, hi = _sd_interval(d, z * clip)
    assert lo < _sd(a) < hi and not clipped
    assert torch.equal(a, p.privatize(u, 2, 5)[0])
    assert not torch.equal(a, p.privatize(u, 2, 6)[0])     # another client, other noise
    big, clipped = p.privatize(torch.full((d,), 10.0), 2, 5)
    assert clipped and l2_norm(big - a) <= clip * (1 + 1e-6)  # the same noise on clip(u)


# ------------------------------------------------------------------ accountant
def test_central_epsilon_is_dp_accountings_own_computation():
    n, m, z, delta = 10, 4, 1.0, 1e-5
    # the earlier accounting, one option away: RDP, replace-one, without replacement
    acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    # replace-one: the clipped sum's sensitivity is 2C, noise zC → multiplier z/2
    acc.compose(dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(n, m, dpa.GaussianDpEvent(z / 2)), 7))
    ours = epsilon_central(7, num_clients=n, cohort=m, noise_multiplier=z, delta=delta,
                           accountant="rdp", neighbours="replace_one")
    assert ours == pytest.approx(acc.get_epsilon(delta), rel=1e-12)
    # the default: PLD, add/remove; a fixed-size cohort displaces a client, so the
    # round is the Poisson-sampled Gaussian at rate m/n with multiplier z/2
    pld = dpa.pld.PLDAccountant()
    pld.compose(dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(m / n, dpa.GaussianDpEvent(z / 2)), 7))
    default = epsilon_central(7, num_clients=n, cohort=m, noise_multiplier=z, delta=delta)
    assert default == pytest.approx(pld.get_epsilon(delta), rel=1e-9)
    p = _central(z=z, m=m, n=n)
    assert p.epsilon(p.init(), 0) == 0.0
    eps = [p.epsilon(p.init(), t) for t in range(1, 6)]
    assert eps == sorted(eps) and eps[0] > 0
    assert epsilon_central(3, num_clients=n, cohort=m, noise_multiplier=0.0,
                           delta=delta) == math.inf


def test_local_epsilon_is_dp_accountings_gaussian_composition():
    for k in (1, 5):
        acc = dpa.rdp.RdpAccountant()
        acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1.5 / 2), k))
        assert epsilon_local(k, noise_multiplier=1.5, delta=1e-6,
                             accountant="rdp") == pytest.approx(acc.get_epsilon(1e-6), rel=1e-12)
        pld = dpa.pld.PLDAccountant()
        pld.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(1.5 / 2), k))
        assert epsilon_local(k, noise_multiplier=1.5, delta=1e-6) == pytest.approx(
            pld.get_epsilon(1e-6), rel=1e-9)
    p = Privacy("local", clip=1.0, noise_multiplier=1.5, delta=1e-6, cohort_size=2,
                num_clients=5, seed=0)
    st = p.participated(p.participated(p.init(), torch.tensor([1, 3])), torch.tensor([3, 4]))
    assert st["participation"].tolist() == [0, 1, 0, 2, 1]
    assert p.epsilon(st, 2) == epsilon_local(2, noise_multiplier=1.5, delta=1e-6)
    # target ε: the next round is judged for a client that took part most (2 → 3)
    e3 = epsilon_local(3, noise_multiplier=1.5, delta=1e-6)
    for target, stops in ((e3 * 0.999, True), (e3 * 1.001, False)):
        q = Privacy("local", clip=1.0, noise_multiplier=1.5, delta=1e-6, cohort_size=2,
                    num_clients=5, seed=0, target_epsilon=target)
        assert (q.stop_reason(st, 2) is not None) == stops


# ------------------------------------------------------------------ engine
def test_run_reports_epsilon_each_round_and_target_epsilon_stops_it(tmp_path):
    # TINY: 10 clients, 4 a round; z = 1: ε(3) = 15.14, ε(4) = 17.39 (the accountant
    # above: PLD, add/remove, the Poisson-sampled Gaussian at 0.4 with multiplier 1/2)
    over = ["privacy.mode=central", "privacy.target_epsilon=16", "rounds=6"]
    out = tmp_path / "run"
    res = fedloom.run(copy.deepcopy(TINY), over, out=out)
    assert [m["round"] for m in res.metrics] == [1, 2, 3]
    for m in res.metrics:
        assert m["dp_epsilon"] == epsilon_central(m["round"], num_clients=10, cohort=4,
                                                  noise_multiplier=1.0, delta=1e-5)
    assert res.metrics[-1]["dp_epsilon"] <= 16 < epsilon_central(
        4, num_clients=10, cohort=4, noise_multiplier=1.0, delta=1e-5)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 3 and "privacy.target_epsilon=16" in summary["stop_reason"]
    assert summary["dp_accounting"] == {"accountant": "pld", "neighbours": "add_remove",
                                        "sampling": "fixed-size, without replacement",
                                        "rate": 0.4}
    assert summary["dp_epsilon"] == res.metrics[-1]["dp_epsilon"]
    # resuming the stopped run runs nothing more
    again = fedloom.run(copy.deepcopy(TINY), over, out=out, resume=True)
    assert len(again.metrics) == 3 and again.summary["model_sha256"] == summary["model_sha256"]


def test_auto_noise_meets_the_target_and_config_yaml_holds_the_number(tmp_path):
    # RDP: the search evaluates the accountant ~15 times (PLD's is tests/test_accounting.py's)
    over = ["privacy.mode=central", "privacy.noise_multiplier=auto", "privacy.accountant=rdp",
            "privacy.target_epsilon=18", "rounds=3"]
    res = fedloom.run(copy.deepcopy(TINY), over, out=tmp_path / "run")
    rec = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["privacy"]
    z = rec["noise_multiplier"]
    assert isinstance(z, float) and rec["max_epsilon"] == 18
    eps = [m["dp_epsilon"] for m in res.metrics]
    assert len(eps) == 3 and eps[-1] <= 18  # all three rounds run, within the target
    # the smallest such z to 1e-3 (fedloom.accounting.NOISE_RTOL): 0.2 % less spends more
    assert epsilon_central(3, num_clients=10, cohort=4, noise_multiplier=z * 0.998,
                           delta=1e-5, accountant="rdp") > 18
    assert eps[-1] == epsilon_central(3, num_clients=10, cohort=4, noise_multiplier=z,
                                      delta=1e-5, accountant="rdp")


def test_max_epsilon_refuses_to_start_and_accounting_cohort_scales_the_noise():
    cfg = load_config(copy.deepcopy(TINY), ["privacy.mode=central", "privacy.max_epsilon=16",
                                            "rounds=4"])
    with pytest.raises(ConfigError, match=r"^privacy.max_epsilon: 4 rounds would spend "
                                          r"epsilon=17.39"):
        make_privacy(cfg, 10)
    assert make_privacy(dataclasses.replace(cfg, rounds=3), 10).planned_epsilon(3) <= 16
    # a deployment of 100 a round out of 10,000, simulated with 4 of 10 (pfl's noise_scale)
    dep = load_config(copy.deepcopy(TINY), ["privacy.mode=central",
                                            "privacy.accounting_population=10000",
                                            "privacy.accounting_cohort=100"])
    p = make_privacy(dep, 10)
    assert p.rate == 0.01 and p.noise_scale == 0.04
    assert p.record() == {"accountant": "pld", "neighbours": "add_remove",
                          "sampling": "fixed-size, without replacement", "rate": 0.01,
                          "population": 10000, "cohort": 100, "noise_scale": 0.04}
    total = torch.zeros(100_000, dtype=torch.float64)
    std = float(p.release(total, p.init(), 0).std())
    assert std == pytest.approx(1.0 * 1.0 / 100, rel=0.02)  # z·C/M: the deployment's mean
    assert p.epsilon(p.init(), 2000) == pytest.approx(
        Accountant("pld", "fixed").epsilon(0.01, 1.0, 2000, 1e-5), rel=1e-12)
    for over, field in ((["privacy.accounting_cohort=3"], "privacy.accounting_cohort"),
                        (["privacy.accounting_cohort=100", "privacy.accounting_population=50"],
                         "privacy.accounting_population")):
        bad = load_config(copy.deepcopy(TINY), ["privacy.mode=central", *over])
        with pytest.raises(ConfigError, match=f"^{field}: "):
            make_privacy(bad, 10)


def test_local_mode_solves_and_caps_for_a_client_in_every_round():
    over = ["privacy.mode=local", "privacy.accountant=rdp", "privacy.target_epsilon=5",
            "privacy.noise_multiplier=auto", "rounds=4"]
    cfg = resolve_noise(load_config(copy.deepcopy(TINY), over))
    z = cfg.privacy.noise_multiplier
    # Gaussian(z/2) over 4 participations: the worst case a priori
    assert epsilon_local(4, noise_multiplier=z, delta=1e-5, accountant="rdp") <= 5
    assert epsilon_local(4, noise_multiplier=z * 0.998, delta=1e-5, accountant="rdp") > 5
    assert make_privacy(cfg, 10).planned_epsilon(4) <= 5
    capped = load_config(copy.deepcopy(TINY), ["privacy.mode=local", "privacy.max_epsilon=5",
                                               "privacy.noise_multiplier=1", "rounds=4"])
    with pytest.raises(ConfigError, match=r"^privacy.max_epsilon: 4 rounds would spend"):
        make_privacy(capped, 10)


def test_central_mode_without_noise_or_clipping_is_the_unweighted_fedavg_run():
    """z = 0 and a clip no update reaches: DP-FedAvg's Σ u_k / m̄ with every client
    accepted is the plain mean, so the run equals fedavg(weighted=false) to float64
    rounding (the sum is taken in another order)."""
    base = copy.deepcopy(TINY)
    base["dtype"] = "float64"
    plain = fedloom.run(base, ["aggregator.options={weighted: false}"])
    dp = fedloom.run(base, ["privacy.mode=central", "privacy.noise_multiplier=0",
                            "privacy.clip=1e30"])
    assert torch.allclose(dp.w, plain.w, rtol=0, atol=1e-12)
    assert all(m["dp_epsilon"] == math.inf and m["dp_clipped"] == 0 for m in dp.metrics)


def test_resume_is_bit_identical_with_adaptive_clipping(tmp_path):
    over = ["privacy.mode=central", "privacy.clip=0.3", "privacy.noise_multiplier=0.5",
            "privacy.adaptive_clip.enabled=true", "privacy.adaptive_clip.count_stddev=1.0",
            "rounds=4"]
    ref, res = stop_and_resume(copy.deepcopy(TINY), over, tmp_path / "r", stop_after=2)
    assert torch.equal(ref.w, res.w)
    clips = [m["dp_clip"] for m in ref.metrics]
    assert clips == [m["dp_clip"] for m in res.metrics]
    assert len(set(clips)) == 4  # C_t moves every round


def test_a_checkpoint_with_a_forged_privacy_state_is_refused_naming_it(tmp_path):
    from fedloom.engine.runs.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    over = ["privacy.mode=central", "privacy.noise_multiplier=0", "rounds=2"]
    out = tmp_path / "r"
    fedloom.run(copy.deepcopy(TINY), over, out=out)
    for name in ("last.pt", "prev.pt"):  # a valid digest: the content check must catch it
        p = out / "checkpoints" / name
        ck = load_checkpoint(p)
        ck["privacy_state"] = {"clip": -1.0}
        save_checkpoint(p, ck)
    with pytest.raises(CheckpointError, match=r"privacy_state: clip -1\.0"):
        fedloom.run(copy.deepcopy(TINY), over, out=out, resume=True)


def test_local_mode_adds_noise_before_compression_and_ef_keeps_the_noisy_residual():
    cfg = load_config(copy.deepcopy(TINY), [
        "privacy.mode=local", "privacy.clip=0.5", "privacy.noise_multiplier=0.3",
        "compression.name=topk", "compression.options={ratio: 0.1}", "compression.feedback=ef"])
    exp = Experiment.from_config(cfg)
    try:
        st = exp.init()
        plan = exp.plan_round(st)
        raw = exp.backend.train_cohort(plan.jobs)
        raw[0].update[3] = float("nan")  # sent as zero plus noise, not withheld
        dense = [r.update.clone() for r in raw]
        dense[0].zero_()
        plan, outcome = exp.uplink_round(st, plan, raw)
        results, ups = outcome.results, outcome.ups
        assert outcome.refused == {}
        d = exp.layout.size
        k = math.ceil(0.1 * d)
        for res, up, g in zip(results, ups, dense, strict=True):
            noisy, _ = exp.privacy.privatize(g, 0, res.client)
            # what was sent is Top-k of the noisy update: k coordinates, as many as sent
            assert int((up.sent != 0).sum()) <= k
            # EF (round 1, e = 0): residual + sent = the noisy update, not the clean one
            back = up.state["residual"] + up.sent
            assert torch.allclose(back, noisy, atol=1e-6)
            assert not torch.allclose(back, g, atol=1e-3)
    finally:
        exp.close()


# ------------------------------------------------------------------ refusals
def _check(mode: str, aggregator: str = "fedavg", feedback: str = "none",
           method: str = "sgd", schedule: str = "constant") -> None:
    over = [f"privacy.mode={mode}", f"aggregator.name={aggregator}",
            f"compression.feedback={feedback}", f"client.method={method}",
            *([f"compression.feedback.options.alpha_schedule={schedule}"]
              if schedule != "constant" else [])]
    cfg = load_config(copy.deepcopy(TINY), over)
    from fedloom.compress.feedback import feedback_from_config
    from fedloom.params import Layout

    p = Privacy(mode, clip=1.0, noise_multiplier=1.0, delta=1e-5, cohort_size=4,
                num_clients=10, seed=0)
    check_privacy(p, aggregator=make_aggregator(aggregator), aggregator_name=aggregator,
                  feedback=feedback_from_config(cfg.compression.feedback, Layout.flat(8)),
                  feedback_name=feedback, method=build("method", method, {}, "m"),
                  method_name=method, w=torch.zeros(8))


@pytest.mark.parametrize("agg", ["craft", "config", "fedfv", "fedlf", "median",
                                 "trimmed_mean", "krum", "qfedavg", "afl", "coordmean",
                                 "fednova"])
def test_central_dp_refuses_every_rule_but_fedavg(agg):
    with pytest.raises(ConfigError, match=r"^aggregator\.name: "):
        _check("central", agg)


def test_dp_refuses_unnoised_server_state_and_accepts_what_it_covers():
    _check("central")
    _check("central", feedback="ef")
    _check("central", feedback="sapef")
    for fb in ("ef21", "cser", "scafcom"):
        with pytest.raises(ConfigError, match=r"^compression\.feedback\.name: "):
            _check("central", feedback=fb)
    with pytest.raises(ConfigError, match=r"^compression\.feedback\.options\.alpha_schedule: "):
        _check("local", feedback="sapef", schedule="theory")
    with pytest.raises(ConfigError, match=r"^client\.method\.name: "):
        _check("local", method="scaffold")
    # local DP: the server's rule is post-processing of noisy messages
    for agg in ("craft", "median", "fednova"):
        _check("local", agg, feedback="ef21")
    for agg in ("qfedavg", "afl"):  # they read the client's unnoised loss
        with pytest.raises(ConfigError, match=r"^aggregator\.name: "):
            _check("local", agg)


def test_declared_linear_rules_are_linear_and_dp_mean_rules_are_the_mean():
    """The properties privacy and secure aggregation trust, tried on every
    registered rule that declares them: agg(aU + bV) = a·agg(U) + b·agg(V) for the
    same weights and cohort, and under unit weights a dp_mean rule is the mean."""
    from fedloom.aggregate.base import CohortInfo
    from fedloom.capabilities import aggregator_caps
    from fedloom.params import Layout
    from fedloom.registry import available

    g = torch.Generator().manual_seed(3)
    m, d = 5, 40
    u, v = (torch.randn(m, d, generator=g, dtype=torch.float64) for _ in range(2))
    n = torch.tensor([3.0, 10.0, 1.0, 7.0, 2.0], dtype=torch.float64)
    info = CohortInfo(clients=torch.arange(m), round=0, num_clients=20,
                      losses=torch.rand(m, dtype=torch.float64, generator=g),
                      steps=torch.tensor([5, 9, 2, 5, 7]), lr=0.1,
                      start_losses=torch.rand(m, dtype=torch.float64, generator=g) + 1)
    seen = set()
    for name in available("aggregator"):
        agg = make_aggregator(name)
        if not aggregator_caps(agg).linear:
            continue
        seen.add(name)
        st = agg.init(Layout.flat(d))

        def f(x, w=n, agg=agg, st=st):
            return agg(x, w, st, info=info)[0]

        assert torch.allclose(f(2.5 * u - 0.7 * v), 2.5 * f(u) - 0.7 * f(v), atol=1e-12), name
        if aggregator_caps(agg).dp_mean:
            assert torch.allclose(f(u, torch.ones(m, dtype=torch.float64)), u.mean(0),
                                  atol=1e-12), name
    assert {"fedavg", "fednova"} <= seen


def test_secure_aggregation_takes_sum_rules_and_dense_payloads_only():
    def check(agg: str, comp: str, **opts: object) -> None:
        check_secure_aggregation(aggregator=make_aggregator(agg), aggregator_name=agg,
                                 compressor=make_compressor(comp, **opts),
                                 compressor_name=comp)

    for agg in ("fedavg", "fednova"):
        for comp in ("identity", "fp16", "bf16"):
            check(agg, comp)
    for agg in ("craft", "config", "median", "krum", "trimmed_mean", "fedfv", "coordmean"):
        with pytest.raises(ConfigError, match=r"^aggregator\.name: "):
            check(agg, "identity")
    for comp, opts in (("topk", {"ratio": 0.1}), ("randk", {"ratio": 0.1}), ("sign", {}),
                       ("qsgd", {})):
        with pytest.raises(ConfigError, match=r"^compression\.name: "):
            check("fedavg", comp, **opts)


@pytest.mark.parametrize("over,field", [
    (["privacy.mode=central", "aggregator.name=craft"], "aggregator.name"),
    (["server.secure_aggregation=true", "aggregator.name=craft"], "aggregator.name"),
    (["server.secure_aggregation=true", "compression.name=topk"], "compression.name"),
    (["privacy.mode=local", "privacy.adaptive_clip.enabled=true"],
     "privacy.adaptive_clip.enabled"),
    (["privacy.mode=central", "system.availability=0.5"], "system.availability"),
    # TINY's 3 rounds spend 15.14 at z = 1 (PLD, add/remove): over the cap, nothing runs
    (["privacy.mode=central", "privacy.max_epsilon=10"], "privacy.max_epsilon"),
    (["privacy.mode=central", "privacy.noise_multiplier=auto"], "privacy.noise_multiplier"),
    (["privacy.mode=local", "privacy.accounting_cohort=100"], "privacy.accounting_cohort"),
    (["privacy.mode=central", "privacy.accountant=moments"], "privacy.accountant"),
])
def test_cli_refuses_with_one_line_and_exit_2(tmp_path, capsys, over, field):
    from fedloom import cli

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "r"
    capsys.readouterr()
    assert cli.main(["run", str(cfg), *over, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0], err
    assert not out.exists()
