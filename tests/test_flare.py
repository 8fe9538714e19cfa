"""FLARE: the penalty's reach, τ's decay, the accumulator, TAU = 0 equals EC."""

import pytest
import torch
from torch.nn import functional as F

import fedloom
from fedloom import Layout
from fedloom.client.sgd import LocalSGD, Penalty
from fedloom.compress import make_compressor
from fedloom.compress.feedback import UplinkContext, make_feedback
from fedloom.compress.flare import FLARE, flare_mask
from fedloom.models import MLP
from fedloom.params import functional_forward


def test_tau_decays_as_specified():
    fl = FLARE(Layout.flat(4), tau=0.05, decay=1.1, steps=1)
    assert fl.tau_at(0) == pytest.approx(0.05 / 1.1)
    assert fl.tau_at(9) == pytest.approx(0.05 / 1.1**10)


def test_mask_is_top_half_of_accumulator_per_tensor():
    layout = Layout([("a", (4,)), ("b", (3,))])
    acc = torch.tensor([0.1, -5.0, 0.3, 2.0, 1.0, -3.0, 0.0])
    # a: |A| = [.1, 5, .3, 2], n = 4: the public median is the upper middle 2 → [0, 1, 0, 0];
    # b: [1, 3, 0], median 1 → [0, 1, 0]
    assert flare_mask(acc, layout).tolist() == [0, 1, 0, 0, 0, 1, 0]


def test_penalty_only_on_first_p_steps_and_only_where_masked():
    torch.manual_seed(0)
    model = MLP(4, [3], 2).double()
    layout = Layout.from_module(model)
    x = torch.randn(12, 4, dtype=torch.float64)
    y = torch.randint(0, 2, (12,))
    w0 = layout.flatten(model)
    target = w0 + torch.randn(layout.size, dtype=torch.float64)
    mask = (torch.arange(layout.size) % 2).double()
    pen = Penalty(target, 0.3, 1, "l1", mask)
    trainer = LocalSGD(model, layout, batch_size=4, steps=3)
    gen = torch.Generator().manual_seed(5)
    got, _, _ = trainer.descend(w0, w0, x, y, 0.1, gen, penalty=pen)
    # by hand: step 0 adds τ m sign(w − t); steps 1 and 2 are plain SGD
    batches = trainer.batch_indices(12, torch.Generator().manual_seed(5))
    w = w0.clone()
    for s, idx in enumerate(batches):
        wg = w.clone().requires_grad_(True)
        loss = F.cross_entropy(functional_forward(model, layout, wg, x[idx]), y[idx])
        (g,) = torch.autograd.grad(loss, wg)
        if s == 0:
            g = g + 0.3 * mask * torch.sign(w - target)
        w = w - 0.1 * g
    assert torch.allclose(got, w, atol=1e-12)


def test_accumulator_identity_and_tiny_uplink_at_99_999_sparsity():
    layout = Layout([("fc1.weight", (1000, 1000)), ("fc1.bias", (1000,)),
                     ("fc2.weight", (10, 1000)), ("fc2.bias", (10,))])  # 1.011M parameters
    comp = make_compressor("topk", ratio=1e-5, scope="tensor", layout=layout)
    fb = make_feedback("flare", layout=layout)
    g = torch.randn(layout.size, generator=torch.Generator().manual_seed(0))
    acc = torch.randn(layout.size, generator=torch.Generator().manual_seed(1)) * 0.01
    out = fb.uplink(g, {"residual": acc}, comp, UplinkContext(0, 0.1, 1, 0.0, torch.Generator()),
                    {})
    assert torch.equal(out.sent + out.state["residual"], g + acc)  # u == sent + A_new
    # round(n_l · 1e-5) + 1 per tensor (the public count): 10 + 1, then 0 + 1 three times
    assert int((out.sent != 0).sum()) == 11 + 1 + 1 + 1
    assert len(out.payload) < 150  # a few hundred bytes at most, not a dense vector


def test_flare_with_tau_zero_equals_ec_step_for_step(tiny):
    base = ["compression.name=topk", "compression.options.ratio=0.02",
            "compression.options.scope=tensor", "aggregator.options.weighted=false",
            "rounds=3", "dtype=float64"]
    ec = fedloom.run(tiny, [*base, "compression.feedback=ef"])
    fl0 = fedloom.run(tiny, [*base, "compression.feedback={name: flare, options: {tau: 0}}"])
    fl = fedloom.run(tiny, [*base, "compression.feedback={name: flare, options: {tau: 0.5}}"])
    assert fl0.summary["model_sha256"] == ec.summary["model_sha256"]
    assert fl.summary["model_sha256"] != ec.summary["model_sha256"]
    prox = fedloom.run(tiny, [*base, "compression.feedback={name: ec_prox, options: {tau: 0.5}}"])
    assert prox.summary["model_sha256"] != ec.summary["model_sha256"]


def test_craft_over_flare_payloads_keeps_constraints(tiny):
    res = fedloom.run(tiny, ["aggregator.name=craft", "compression.name=topk",
                             "compression.options.ratio=0.3", "compression.options.scope=tensor",
                             "compression.feedback=flare", "dtype=float64", "rounds=2"])
    assert all(m["craft_max_violation"] < 1e-8 for m in res.metrics)


def test_ffl_schedule_follows_the_test_loss(tiny):
    from fedloom.compress.adaptive import FFL
    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment

    cfg = load_config(tiny, ["compression.name=topk", "compression.options.ratio=0.01",
                             "compression.feedback=ef", "compression.adaptive=ffl",
                             "client.epochs=4"])
    exp = Experiment.from_config(cfg)
    st = exp.init()
    # the run's planner is the registered plug-in, planning on what hooks see
    assert isinstance(exp.algorithm.planner, FFL)
    adj0 = exp.algorithm.planner.plan(st.next_round, st.w, st.feedback_state, exp.hook_view)
    assert adj0.metrics["ffl_ratio"] == 0.01 and adj0.epochs == 4  # L_t = L_0 at the start
    # pretend the initial loss was 8x the current one: R_t = 2R, E_t = round(4/2) = 2
    loss = adj0.state["ffl_loss0"]
    adj = FFL().plan(st.next_round, st.w, {**st.feedback_state, "ffl_loss0": 8 * loss},
                     exp.hook_view)
    assert adj.metrics["ffl_ratio"] == pytest.approx(0.02) and adj.epochs == 2
    assert adj.compressor.ratio == pytest.approx(0.02)
    res = fedloom.run(tiny, ["compression.name=topk", "compression.options.ratio=0.01",
                             "compression.feedback=ef", "compression.adaptive=ffl", "rounds=3"])
    assert "ffl_ratio" in res.metrics[-1]


# --- the public rule (RanGreidi/FLARE), written out independently of fedloom -------------
# Mask (src/FLARE_regulerizer.py): the threshold is tfp.stats.percentile(|A|, 50) with its
# default "nearest" interpolation: sort |A| ascending and take the entry at position
# (n − 1)/2 rounded half to even (tf.round). For odd n that is the middle entry; for even n
# the two middle positions are n/2 − 1 and n/2 and the even one of them is taken: the lower
# middle when n ≡ 2 (mod 4), the upper middle when n ≡ 0 (mod 4). The mask is |A| > threshold.
# Count (src/FLARE_utils.py, sparsify_layer): tf.nn.top_k keeps round(n·R) + 2 magnitudes and
# the entries strictly above the smallest of them stay: round(n·R) + 1 entries without ties.


def _public_threshold(vals: list[float]) -> float:
    s = sorted(vals)
    n = len(s)
    if n % 2 == 1:
        return s[n // 2]
    lo = n // 2 - 1
    return s[lo] if lo % 2 == 0 else s[lo + 1]


def _half_even(v: float) -> int:
    f = int(v // 1)
    r = v - f
    return f + (1 if r > 0.5 or (r == 0.5 and f % 2 == 1) else 0)


@pytest.mark.parametrize("sizes", [(4,), (8, 6), (12, 7, 2), (5, 16, 1, 3), (10, 20)])
def test_mask_follows_the_public_median_rule(sizes):
    # Sizes divisible by 4 (upper middle), ≡ 2 mod 4 (lower middle), odd (exact middle), 1.
    layout = Layout([(f"t{i}", (n,)) for i, n in enumerate(sizes)])
    gen = torch.Generator().manual_seed(sum(sizes))
    acc = torch.randn(layout.size, generator=gen, dtype=torch.float64)
    got = flare_mask(acc, layout)
    want = []
    for t in layout.tensors:
        seg = acc[t.slice].abs().tolist()
        thr = _public_threshold(seg)
        want += [1.0 if v > thr else 0.0 for v in seg]
    assert got.tolist() == want
    # n divisible by 4: exactly n/2 − 1 coordinates masked (the upper middle is the threshold)
    for t in layout.tensors:
        if t.numel % 4 == 0:
            assert int(got[t.slice].sum()) == t.numel // 2 - 1


def test_mask_ties_nan_and_zero_accumulator():
    layout = Layout([("a", (4,)), ("b", (3,)), ("c", (4,))])
    acc = torch.tensor([2.0, -1.0, 2.0, 1.0,  0.0, 0.0, 0.0,  float("nan"), 1.0, 2.0, 3.0])
    # a: sorted |A| = [1, 1, 2, 2], threshold (upper middle) 2 → only strict > 2: none
    # (the lower middle, 1, would mask both 2s).
    # b: zeros → nothing above 0. c: NaN → the public percentile is NaN, nothing masked.
    assert flare_mask(acc, layout).tolist() == [0.0] * 11


def _public_count(n: int, ratio: float) -> int:
    return _half_even(n * ratio) + 1


@pytest.mark.parametrize("ratio", [1e-5, 0.01, 0.05, 0.25])
def test_per_tensor_topk_keeps_the_public_count(ratio):
    # 7 of 700 at 1 %: 7 + 1 = 8 kept (the "8 against 7"); 50 · 0.05 = 2.5 → 2 (half
    # to even) + 1; 10 · 0.25 = 2.5 → 2 + 1; 30 · 0.05 = 1.5 → 2 + 1.
    layout = Layout([("w", (700,)), ("b", (50,)), ("c", (10,)), ("e", (30,)), ("f", (3,))])
    top = make_compressor("topk", ratio=ratio, scope="tensor", layout=layout)
    x = torch.randn(layout.size, generator=torch.Generator().manual_seed(3))
    y = top.decode(top.encode(x))
    for t in layout.tensors:
        want = min(t.numel, _public_count(t.numel, ratio))
        seg = x[t.slice]
        kept = (y[t.slice] != 0).nonzero().squeeze(1).tolist()
        assert len(kept) == want, t.name
        assert set(kept) == set(torch.topk(seg.abs(), want).indices.tolist())


def test_topk_old_count_rule_is_an_option():
    layout = Layout([("w", (700,)), ("b", (30,))])
    top = make_compressor("topk", ratio=0.01, scope="tensor", layout=layout, k_rule="round")
    assert [u[2] for u in top.budget(layout.size)] == [7, 1]
    with pytest.raises(ValueError, match=r"compression.options.k_rule"):
        make_compressor("topk", ratio=0.01, scope="tensor", layout=layout, k_rule="ceil")
    with pytest.raises(ValueError, match=r"compression.options.k_rule"):
        make_compressor("topk", count=3, k_rule="flare")
