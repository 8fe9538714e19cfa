"""Error feedback: the EF identity, SA-PEF's limits, untouched non-sampled clients."""

import pytest
import torch

import fedloom
from conftest import stop_and_resume
from fedloom.compress import make_compressor
from fedloom.compress.feedback import EF21, ErrorFeedback, UplinkContext, make_feedback
from fedloom.config import load_config
from fedloom.engine.experiment import Experiment

EXACT = [("topk", {"ratio": 0.05}), ("topk", {"ratio": 0.05, "values": "float16"}),
         ("randk", {"ratio": 0.1, "scaled": False}), ("fp16", {}), ("identity", {})]


def _ctx(seed=0, alpha=0.0):
    return UplinkContext(0, 0.1, 5, alpha, torch.Generator().manual_seed(seed))


def _vec(seed, d=500):
    return torch.randn(d, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name,opts", EXACT)
@pytest.mark.parametrize("alpha", [0.0, 0.85, 1.0])
def test_ef_identity_is_exact(name, opts, alpha):
    """u == decode(encode(u)) + e_new, bit for bit, over several rounds."""
    comp = make_compressor(name, **opts)
    fb = ErrorFeedback(alpha, name="sapef")
    e = torch.zeros(500)
    for r in range(5):
        g = _vec(r)
        u = g + (1 - alpha) * e
        out = fb.uplink(g, {"residual": e}, comp, _ctx(r, alpha), {})
        assert torch.equal(out.sent, comp.decode(out.payload))
        assert torch.equal(out.sent + out.state["residual"], u)
        e = out.state["residual"]


@pytest.mark.parametrize("name,opts", [("sign", {}), ("qsgd", {"levels": 3})])
def test_ef_identity_for_quantisers_to_rounding(name, opts):
    # (u − s) + s can round in float32 when s is far from u: equal to 1 ulp of |u| + |s|
    comp = make_compressor(name, **opts)
    fb = ErrorFeedback(0.0)
    g = _vec(1)
    out = fb.uplink(g, {"residual": torch.zeros(500)}, comp, _ctx(), {})
    assert torch.allclose(out.sent + out.state["residual"], g, rtol=0, atol=1e-6)


def test_ef21_keeps_h_plus_c():
    comp = make_compressor("topk", ratio=0.1)
    fb = EF21("sampled")
    h = _vec(7) * 0.1
    g = _vec(8)
    out = fb.uplink(g, {"h": h}, comp, _ctx(), {})
    assert torch.equal(out.sent, comp.decode(comp.encode(g - h)))
    assert torch.equal(out.state["h"], h + out.sent)
    assert torch.equal(fb.server_row(out, {"h": h}, {}), h + out.sent)


def test_theory_alpha_schedule():
    fb = make_feedback("sapef", alpha=0.85, schedule="theory")
    assert fb.alpha(0.1, 5, {}) == 0.85  # no L̂ yet: the constant
    s = 0.1 * 2.0 * 5
    assert fb.alpha(0.1, 5, {"lipschitz": 2.0}) == pytest.approx(1 / (1 + 12 * s * s))
    # L̂ is the running max of the cohort median
    end = fb.end_round([], {"lipschitz": 2.0}, 10, [1.0, 3.0, 2.5])
    assert end.server["lipschitz"] == 2.5
    assert fb.end_round([], end.server, 10, [0.1]).server["lipschitz"] == 2.5
    with pytest.raises(ValueError, match=r"compression\.feedback"):
        make_feedback("bogus")


BASE = ["compression.name=topk", "compression.options.ratio=0.05", "rounds=3",
        "dtype=float64"]


def test_sapef_alpha_0_equals_ef_and_alpha_1_equals_saef(tiny):
    ef = fedloom.run(tiny, [*BASE, "compression.feedback=ef"])
    sa0 = fedloom.run(tiny, [*BASE, "compression.feedback={name: sapef, options: {alpha: 0.0}}"])
    assert ef.summary["model_sha256"] == sa0.summary["model_sha256"]
    saef = fedloom.run(tiny, [*BASE, "compression.feedback=saef"])
    sa1 = fedloom.run(tiny, [*BASE, "compression.feedback={name: sapef, options: {alpha: 1.0}}"])
    assert saef.summary["model_sha256"] == sa1.summary["model_sha256"]
    mid = fedloom.run(tiny, [*BASE, "compression.feedback={name: sapef, options: {alpha: 0.5}}"])
    assert mid.summary["model_sha256"] not in {ef.summary["model_sha256"],
                                               saef.summary["model_sha256"]}


def test_step_ahead_update_is_measured_from_received_model(tiny):
    """g = w − x_T includes the shift α e: with a zero learning-rate effect (lr tiny) the
    update is ≈ α e, not 0 (measuring from x_0 would drop it)."""
    cfg = load_config(tiny, [*BASE, "compression.feedback={name: sapef, options: {alpha: 1.0}}",
                             "client.lr=1e-12", "rounds=1"])
    exp = Experiment.from_config(cfg)
    st = exp.init()
    cohort = exp.sample_cohort(0)
    e = torch.randn(len(cohort), exp.layout.size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    st.clients.scatter("fb.residual", cohort, e)
    captured = {}
    inner = exp.backend.train_cohort

    def spy(jobs):
        res = inner(jobs)
        captured["updates"] = torch.stack([r.update for r in res])
        return res

    exp.backend.train_cohort = spy
    exp.round(st)
    assert torch.allclose(captured["updates"], e.to(captured["updates"].dtype), atol=1e-6)


def test_non_sampled_clients_keep_their_residual(tiny):
    cfg = load_config(tiny, [*BASE, "compression.feedback=ef"])
    exp = Experiment.from_config(cfg)
    st = exp.init()
    marker = torch.full((10, exp.layout.size), 0.5, dtype=torch.float64)
    st.clients.scatter("fb.residual", range(10), marker)
    cohort = exp.sample_cohort(0).tolist()
    st, m = exp.round(st)
    others = [k for k in range(10) if k not in cohort]
    assert torch.equal(st.clients.gather("fb.residual", others), marker[: len(others)])
    changed = st.clients.gather("fb.residual", cohort)
    assert not torch.equal(changed, marker[: len(cohort)])
    assert m["residual_norm"] > 0 and 0.04 < m["density"] < 0.06


def test_topk_uplink_bytes_and_resume_with_residuals(tiny, tmp_path):
    ov = ["compression.name=topk", "compression.options.ratio=0.01", "compression.feedback=sapef",
          "rounds=4", "checkpoint.every=1"]
    ref, res = stop_and_resume(tiny, ov, tmp_path / "r")
    d = ref.layout.size
    for m in ref.metrics:
        # header 8 + sparse header 10 + ~k varint bytes + 4k value bytes, per client
        k = round(0.01 * d)
        assert m["cohort_size"] * (18 + 5 * k) <= m["uplink_bytes"] <= m["cohort_size"] * (
            18 + 9 * k)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]


def test_craft_over_sapef_payloads_keeps_constraints_on_decoded_rows(tiny):
    res = fedloom.run(tiny, ["aggregator.name=craft", "compression.name=topk",
                             "compression.options.ratio=0.2", "compression.feedback=sapef",
                             "dtype=float64", "rounds=3"])
    for m in res.metrics:
        assert m["craft_max_violation"] < 1e-8
        assert m["craft_min_alignment"] > 0


def test_mismatch_and_theory_schedule_metrics(tiny):
    res = fedloom.run(tiny, [*BASE, "compression.feedback=sapef", "metrics.mismatch=true",
                             "compression.feedback.options.alpha_schedule=theory"])
    last = res.metrics[-1]
    assert last["grad_mismatch"] >= 0 and last["residual_sq"] > 0 and last["grad_sq"] > 0
    assert last["lipschitz_estimate"] > 0 and 0 < last["alpha"] < 1
    assert res.metrics[0]["alpha"] == 0.85  # before any estimate


def test_cser_resets_residuals_every_period(tiny):
    ov = ["compression.name=topk", "compression.options.ratio=0.05", "compression.feedback=cser",
          "compression.feedback.options.period=2", "rounds=4", "dtype=float64"]
    res = fedloom.run(tiny, ov)
    up = [m["uplink_bytes"] for m in res.metrics]
    down = [m["downlink_bytes"] for m in res.metrics]
    # rounds 2 and 4 also carry the residual tops (uplink) and the dense ē (downlink)
    assert up[1] > up[0] and up[3] > up[2]
    assert down[1] > down[0] and down[3] == down[1]
    # unit: after a reset every client's residual is e − ē
    comp = make_compressor("topk", ratio=0.05)
    fb = make_feedback("cser", period=1)
    ups = [fb.uplink(_vec(s), {"residual": _vec(s + 10)}, comp, _ctx(s), {}) for s in range(3)]
    before = [u.state["residual"].clone() for u in ups]
    e_bar = torch.stack([u.extra_sent for u in ups]).mean(0)
    end = fb.end_round(ups, {}, 10, [])
    assert torch.equal(end.w_shift, e_bar)
    for u, b in zip(ups, before, strict=True):
        assert torch.equal(u.state["residual"], b - e_bar)


def test_scafcom_updates_controls_as_specified():
    comp = make_compressor("topk", ratio=0.2)
    fb = make_feedback("scafcom", beta=0.2)
    c = _vec(1) * 0.1
    ck, vk, g = _vec(2) * 0.1, _vec(3) * 0.1, _vec(4)
    ctx = UplinkContext(0, 0.05, 4, 0.0, torch.Generator())
    assert torch.equal(fb.grad_shift({"c": ck, "v": vk}, {"c": c}), c - ck)
    out = fb.uplink(g, {"c": ck, "v": vk}, comp, ctx, {"c": c})
    v = 0.8 * vk + 0.2 * (g / (0.05 * 4) + ck - c)
    assert torch.allclose(out.state["v"], v)
    assert torch.equal(out.sent, comp.decode(comp.encode(v - ck)))
    assert torch.equal(out.state["c"], ck + out.sent)
    assert torch.allclose(fb.server_row(out, {}, {"c": c}), 0.05 * 4 * (out.sent + c))
    end = fb.end_round([out], {"c": c}, 10, [])
    assert torch.allclose(end.server["c"], c + 0.1 * out.sent)


def test_scafcom_and_ef21_run_end_to_end(tiny):
    for fbname in ("scafcom", "ef21"):
        res = fedloom.run(tiny, ["compression.name=topk", "compression.options.ratio=0.1",
                                 f"compression.feedback={fbname}", "rounds=3"])
        assert all(m["rejected_updates"] == 0 for m in res.metrics)
        assert res.metrics[-1]["test_acc"] > 0.1


def test_reported_uplink_bytes_are_the_payload_lengths(tiny):
    cfg = load_config(tiny, ["compression.name=qsgd", "compression.options.levels=3",
                             "compression.feedback=ef"])
    exp = Experiment.from_config(cfg)
    sizes = []
    encode = exp.uplink.encode

    def spy(x, *, gen=None):
        p = encode(x, gen=gen)
        sizes.append(len(p))
        return p

    exp.uplink.encode = spy
    _, m = exp.round(exp.init())
    assert len(sizes) == m["cohort_size"] and m["uplink_bytes"] == sum(sizes)
