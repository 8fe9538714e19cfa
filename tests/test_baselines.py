"""Golden values and properties of the baselines (rules in each module's docstring)."""

import pytest
import torch

import fedloom
from conftest import stop_and_resume
from fedloom import CohortInfo, Layout, make_aggregator
from fedloom.aggregate.fednova import nova_norm
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment


def _info(m, **kw):
    base = {"clients": torch.arange(m), "round": 0, "num_clients": m}
    base.update(kw)
    return CohortInfo(**base)


def test_fednova_golden():
    # g1 = [2, 0] with τ1 = 1, g2 = [0, 4] with τ2 = 2, p = [1/2, 1/2]:
    # d = [g1/1, g2/2] = [[2, 0], [0, 2]]; τ_eff = 1.5; agg = 1.5 · [1, 1] = [1.5, 1.5]
    U = torch.tensor([[2.0, 0.0], [0.0, 4.0]], dtype=torch.float64)
    agg = make_aggregator("fednova")
    out, _, m = agg(U, torch.ones(2), None, info=_info(2, steps=torch.tensor([1, 2])))
    assert torch.allclose(out, torch.tensor([1.5, 1.5], dtype=torch.float64))
    assert m["fednova_tau_eff"] == 1.5
    # momentum: a = [τ − β(1 − β^τ)/(1 − β)]/(1 − β); τ = 2, β = 0.5 → (2 − 0.75)/0.5 = 2.5
    assert float(nova_norm(torch.tensor([2]), 0.5)) == pytest.approx(2.5)


def test_qfedavg_golden_and_q0_is_mean_step():
    # q = 1, L = 1/η = 10, F = [1, 2], g1 = [1, 0], g2 = [0, 1]:
    # Δ = 10 g; ‖Δ‖² = 100; h_k = 1·F^0·100 + 10 F_k = [110, 120]; Σh = 230
    # D_k = F_k Δ_k: D1 = 1·[10, 0], D2 = 2·[0, 10] → Σ D = [10, 20] → step = [10, 20]/230
    U = torch.eye(2, dtype=torch.float64)
    info = _info(2, start_losses=torch.tensor([1.0, 2.0], dtype=torch.float64), lr=0.1)
    out, _, _ = make_aggregator("qfedavg", q=1.0)(U, torch.ones(2), None, info=info)
    assert torch.allclose(out, torch.tensor([10 / 230, 20 / 230], dtype=torch.float64))
    # q = 0: h_k = L, D_k = Δ_k → Σ L g_k / (m L) = mean g_k
    out0, _, _ = make_aggregator("qfedavg", q=0.0)(U, torch.ones(2), None, info=info)
    assert torch.allclose(out0, torch.tensor([0.5, 0.5], dtype=torch.float64))


def test_config_is_conflict_free_and_equal_angle():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        U = torch.randn(4, 12, generator=gen, dtype=torch.float64)
        out, _, _ = make_aggregator("config")(U, torch.ones(4), None)
        dots = U @ out
        assert (dots > 0).all()
        cos = dots / (U.norm(dim=1) * out.norm())
        assert torch.allclose(cos, cos[0].expand(4), atol=1e-9)  # equal angles to all clients


def test_fedfv_removes_conflicts_for_two_clients():
    # g1 = [1, 0], g2 = [-1, 1]; ⟨g1, g2⟩ = −1 < 0. α = 0 → both projected:
    # g1' = g1 − (−1/2) g2 = [0.5, 0.5]; g2' = g2 − (−1/1) g1 = [0, 1]
    # mean = [0.25, 0.75]; rescaled to ‖mean g‖ = ‖[0, 0.5]‖ = 0.5
    U = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    info = _info(2, start_losses=torch.tensor([1.0, 2.0], dtype=torch.float64))
    agg = make_aggregator("fedfv", alpha=0.0, tau=0)
    out, _, _ = agg(U, torch.ones(2), agg.init(Layout.flat(2)), info=info)
    expected = torch.tensor([0.25, 0.75], dtype=torch.float64)
    expected = expected / expected.norm() * 0.5
    assert torch.allclose(out, expected)
    assert ((U @ out) >= -1e-12).all()


def test_fedlf_min_norm_and_rescale():
    # Two orthogonal equal-norm clients with equal losses: min-norm point is the midpoint,
    # rescaled to ‖mean g‖.
    U = torch.tensor([[2.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    info = _info(2, start_losses=torch.tensor([1.0, 1.0], dtype=torch.float64))
    agg = make_aggregator("fedlf")
    out, _, _ = agg(U, torch.ones(2), agg.init(Layout.flat(2)), info=info)
    assert torch.allclose(out, torch.tensor([1.0, 1.0], dtype=torch.float64), atol=1e-8)


def test_afl_lambda_moves_to_high_loss_client_and_needs_full_cohort(tiny):
    agg = make_aggregator("afl", gamma_lambda=0.5)
    U = torch.eye(3, dtype=torch.float64)
    info = _info(3, start_losses=torch.tensor([0.1, 0.2, 2.0], dtype=torch.float64), lr=0.5)
    out, lam, _ = agg(U, torch.ones(3), agg.init(Layout.flat(3)), info=info)
    # the public step at server.lr = 1: η_l Σ λ_k g_k/η_l = Σ λ_k g_k with λ uniform
    assert torch.allclose(out, torch.full((3,), 1 / 3, dtype=torch.float64))
    assert abs(float(lam.sum()) - 1) < 1e-12 and int(lam.argmax()) == 2
    with pytest.raises(ConfigError, match=r"cohort\.size"):
        Experiment.from_config(load_config(tiny, ["aggregator.name=afl"]))
    res = fedloom.run(tiny, ["aggregator.name=afl", "cohort.size=10", "rounds=2",
                             "eval.average_iterates=true"])
    assert res.metrics[-1]["afl_lambda_max"] > 0.1


def test_scaffold_first_round_matches_sgd_and_controls_follow_option_ii(tiny):
    cfg_s = load_config(tiny, ["client.method=scaffold", "rounds=2", "dtype=float64"])
    cfg_p = load_config(tiny, ["rounds=2", "dtype=float64"])
    es, ep = Experiment.from_config(cfg_s), Experiment.from_config(cfg_p)
    s0, p0 = es.init(), ep.init()
    s1, _ = es.round(s0)
    p1, _ = ep.round(p0)
    # c = c_k = 0 in round 1: SCAFFOLD is plain local SGD
    assert torch.equal(s1.w, p1.w)
    cohort = es.sample_cohort(0)
    ck = s1.clients.gather("control", cohort)
    # c_k⁺ = g_k/(K η) with c = c_k = 0; server c = (m/N) mean(c_k⁺)
    assert torch.allclose(s1.method_state["c"], (len(cohort) / 10) * ck.mean(0))
    others = [k for k in range(10) if k not in cohort.tolist()]
    assert torch.equal(s1.clients.gather("control", others), torch.zeros(len(others),
                                                                         es.layout.size,
                                                                         dtype=torch.float64))
    s2, _ = es.round(s1)  # round 2 uses the correction
    assert torch.isfinite(s2.w).all() and not torch.equal(s2.w, s1.w)


def test_ditto_personal_models_and_metrics(tiny):
    res = fedloom.run(tiny, ["client.method=ditto", "rounds=3"])
    last = res.metrics[-1]
    for k in ("personal_acc_mean", "personal_acc_std", "personal_acc_worst10",
              "client_acc_mean", "personal_loss"):
        assert k in last
    # CRAFT inside Ditto is one config line
    res2 = fedloom.run(tiny, ["client.method=ditto", "aggregator.name=craft", "rounds=2"])
    assert "craft_max_violation" in res2.metrics[-1] and "personal_acc_mean" in res2.metrics[-1]
    with pytest.raises(ConfigError, match=r"client\.method\.options\.mu"):
        fedloom.run(tiny, ["client.method=ditto", "client.method.options.mu=1"])


def test_ditto_with_huge_lambda_keeps_personal_near_global(tiny):
    cfg = load_config(tiny, ["client.method=ditto", "client.method.options.lam=5.0",
                             "client.lr=0.1", "rounds=1", "dtype=float64"])
    exp = Experiment.from_config(cfg)
    st, _ = exp.round(exp.init())
    cohort = exp.sample_cohort(0)
    v = st.clients.gather("personal", cohort)
    w0 = exp.init().w
    cfg0 = load_config(tiny, ["client.method=ditto", "client.method.options.lam=0.0",
                              "client.lr=0.1", "rounds=1", "dtype=float64"])
    exp0 = Experiment.from_config(cfg0)
    st0, _ = exp0.round(exp0.init())
    v0 = st0.clients.gather("personal", cohort)
    assert (v - w0).norm() < (v0 - w0).norm()  # the prox term pulls towards w


@pytest.mark.parametrize("method", ["scaffold", "ditto"])
def test_resume_with_client_state_is_bit_identical(tiny, tmp_path, method):
    ov = ["rounds=4", "checkpoint.every=1", f"client.method={method}"]
    ref, res = stop_and_resume(tiny, ov, tmp_path / "r")
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    assert res.summary["personal_acc_mean" if method == "ditto" else "test_acc"] == \
        ref.summary["personal_acc_mean" if method == "ditto" else "test_acc"]
