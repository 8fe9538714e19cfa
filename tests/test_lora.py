"""LoRA-aware aggregation (issue #41 item 3): FedIT's mean of the factors and its
product error, and the exact mean of the products refactorised to rank r
(fedloom.aggregate.lora), on layouts with peft's tensor names, in float64. No model
is built: tests/test_lora_runs.py runs them on a tiny Llama."""

import math

import pytest
import torch

from fedloom.aggregate.base import CohortInfo, make_aggregator
from fedloom.aggregate.lora import LoRAExact, lora_pairs
from fedloom.client.fedsa_lora import FedSALoRA
from fedloom.params import Layout

R, FIN, FOUT = 2, 6, 5   # rank, in and out features of each adapted projection
PROJ = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]


def layout(extra=True):
    """Two adapted projections (A [r, in], B [out, r] each, one group each) and a
    trainable tensor that is no adapter (a head, averaged as FedAvg does)."""
    specs, groups = [], []
    for p in PROJ:
        a, b = f"{p}.lora_A.default.weight", f"{p}.lora_B.default.weight"
        specs += [(a, (R, FIN)), (b, (FOUT, R))]
        groups.append([a, b])
    if extra:
        specs.append(("score.weight", (3,)))
        groups.append(["score.weight"])
    return Layout(specs, groups)


def factors(lay, vec):
    """{projection: (A, B)} of a flat vector, by name (not by the rule's offsets)."""
    t = lay.unflatten(vec)
    return {p: (t[f"{p}.lora_A.default.weight"], t[f"{p}.lora_B.default.weight"]) for p in PROJ}


def cohort(lay, w, clients):
    """Rows g_k = w − w_k of the clients' vectors, float64."""
    return torch.stack([w - wk for wk in clients])


def info(w, m):
    return CohortInfo(clients=torch.arange(m), round=0, num_clients=m, w=w)


def draw(lay, m, seed=0, share_a=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(lay.size, generator=g, dtype=torch.float64)
    clients = [torch.randn(lay.size, generator=g, dtype=torch.float64) for _ in range(m)]
    if share_a:
        for wk in clients:
            for t in lay:
                if ".lora_A." in t.name:
                    wk[t.slice] = w[t.slice]
    return w, clients


def hand_mean_product(lay, clients, p):
    """Σ_k p_k B_k A_k per projection, one product at a time."""
    out = {}
    for proj in PROJ:
        out[proj] = sum(pk * (factors(lay, wk)[proj][1] @ factors(lay, wk)[proj][0])
                        for pk, wk in zip(p, clients, strict=True))
    return out


def test_pairs_follow_the_names():
    lay = layout()
    pairs = lora_pairs(lay)
    assert len(pairs.pairs) == 2 and pairs.d == lay.size
    a = lay[f"{PROJ[1]}.lora_A.default.weight"]
    b = lay[f"{PROJ[1]}.lora_B.default.weight"]
    assert pairs.pairs[1] == (a.offset, R, FIN, b.offset, FOUT)
    # B alone (FFA-LoRA's layout) has no pair
    only_b = Layout([(f"{PROJ[0]}.lora_B.default.weight", (FOUT, R))])
    assert lora_pairs(only_b).pairs == ()


def test_fedit_is_fedavg_and_its_product_error_by_hand():
    lay = layout()
    w, clients = draw(lay, 3)
    n = torch.tensor([10.0, 30.0, 60.0], dtype=torch.float64)
    rows = cohort(lay, w, clients)
    fedit = make_aggregator("fedit")
    out, _, metrics = fedit(rows, n, fedit.init(lay), info=info(w, 3))
    avg, _, _ = make_aggregator("fedavg")(rows, n, None)
    assert torch.equal(out, avg)
    # FedIT's public rule (FederatedGPT-Shepherd, fed_utils/model_aggregation.py), written
    # out on the clients' state dicts: weights n_k / Σ n (an L1 normalisation), then the
    # weighted sum of every adapter tensor. w − out is that model.
    p = n / n.sum()
    dicts = [lay.unflatten(wk) for wk in clients]
    shepherd = {key: sum(pk * d[key] for pk, d in zip(p, dicts, strict=True)) for key in dicts[0]}
    got = lay.unflatten(w - out)
    assert max(float((got[k] - shepherd[k]).abs().max()) for k in shepherd) < 1e-12
    # the product error, by hand: ‖B̄Ā − Σ p_k B_k A_k‖ over ‖Σ p_k B_k A_k‖, pooled
    mp = hand_mean_product(lay, clients, p)
    num = den = 0.0
    per = []
    for proj in PROJ:
        a_bar = sum(pk * factors(lay, wk)[proj][0] for pk, wk in zip(p, clients, strict=True))
        b_bar = sum(pk * factors(lay, wk)[proj][1] for pk, wk in zip(p, clients, strict=True))
        e, t = float(((b_bar @ a_bar - mp[proj]) ** 2).sum()), float((mp[proj] ** 2).sum())
        num, den = num + e, den + t
        per.append(math.sqrt(e / t))
    assert math.isclose(metrics["lora_product_error"], math.sqrt(num / den), rel_tol=1e-9)
    assert math.isclose(metrics["lora_product_error_max"], max(per), rel_tol=1e-9)
    assert metrics["lora_product_error"] > 0.1  # random factors: far from exact


def test_fedit_error_is_zero_when_clients_share_a():
    lay = layout()
    w, clients = draw(lay, 4, seed=1, share_a=True)
    fedit = make_aggregator("fedit")
    _, _, metrics = fedit(cohort(lay, w, clients), torch.ones(4, dtype=torch.float64),
                          fedit.init(lay), info=info(w, 4))
    # B̄A − Σ p_k B_k A is zero but for float64 rounding
    assert metrics["lora_product_error"] < 1e-14


def test_fedit_without_the_global_model_says_so():
    lay = layout()
    w, clients = draw(lay, 2)
    fedit = make_aggregator("fedit")
    with pytest.raises(ValueError, match=r"^fedit: needs the global model"):
        fedit(cohort(lay, w, clients), torch.ones(2, dtype=torch.float64), fedit.init(lay),
              info=CohortInfo(clients=torch.arange(2), round=0, num_clients=2))
    # measure=False is FedAvg and asks for nothing
    plain = make_aggregator("fedit", measure=False)
    assert "w" not in plain.capabilities.requires
    _, _, metrics = plain(cohort(lay, w, clients), torch.ones(2, dtype=torch.float64),
                          plain.init(lay))
    assert metrics == {}


def exact_step(lay, w, clients, n=None, **opts):
    m = len(clients)
    n = torch.ones(m, dtype=torch.float64) if n is None else n
    agg = LoRAExact(**opts)
    out, _, metrics = agg(cohort(lay, w, clients), n, agg.init(lay), info=info(w, m))
    return w - out, metrics  # the next global model under server sgd, lr 1


@pytest.mark.parametrize("split", ["closest", "balanced"])
def test_exact_gives_back_one_shared_pair(split):
    lay = layout()
    w, clients = draw(lay, 1, seed=2)
    new, metrics = exact_step(lay, w, clients * 3, split=split)
    for proj, (a, b) in factors(lay, new).items():
        a0, b0 = factors(lay, clients[0])[proj]
        assert torch.allclose(b @ a, b0 @ a0, atol=1e-12)  # the product, either split
        if split == "closest":  # and the factors themselves
            assert torch.allclose(a, a0, atol=1e-12) and torch.allclose(b, b0, atol=1e-12)
    assert metrics["lora_truncation_error"] < 1e-12 and metrics["lora_product_error"] < 1e-12
    assert torch.allclose(new[-3:], clients[0][-3:])  # the head: the mean


def test_exact_is_fedavg_when_clients_share_a():
    # M = B̄ A has rank r: exact, and the closest split is FedAvg's (Ā = A, B' = B̄)
    lay = layout()
    w, clients = draw(lay, 3, seed=3, share_a=True)
    n = torch.tensor([1.0, 2.0, 5.0], dtype=torch.float64)
    new, metrics = exact_step(lay, w, clients, n)
    avg = w - make_aggregator("fedavg")(cohort(lay, w, clients), n, None)[0]
    assert torch.allclose(new, avg, atol=1e-12)
    assert metrics["lora_truncation_error"] < 1e-12


@pytest.mark.parametrize("split", ["closest", "balanced"])
def test_exact_is_the_best_rank_r_approximation(split):
    lay = layout()
    w, clients = draw(lay, 3, seed=4)
    n = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64)
    new, metrics = exact_step(lay, w, clients, n, split=split)
    mp = hand_mean_product(lay, clients, n / n.sum())
    trunc = total = 0.0
    for proj, (a, b) in factors(lay, new).items():
        u, s, vh = torch.linalg.svd(mp[proj])  # the full SVD of the [out, in] product
        best = u[:, :R] @ torch.diag(s[:R]) @ vh[:R]
        assert torch.allclose(b @ a, best, atol=1e-10)
        trunc, total = trunc + float((s[R:] ** 2).sum()), total + float((s ** 2).sum())
    assert math.isclose(metrics["lora_truncation_error"], math.sqrt(trunc / total),
                        rel_tol=1e-9)
    # three clients of rank 2 make a rank-5 mean product: something is truncated, and
    # less than FedIT's mean of the factors misses
    assert 0 < metrics["lora_truncation_error"] < metrics["lora_product_error"]


def test_exact_matches_floras_stacking():
    # FLoRA (ATP-1010/FederatedLLM, fed_utils/model_aggregation.py, stacking): the A
    # rows scaled by p_k and stacked, the B columns stacked unscaled; the product of
    # the stacks is the mean product that lora_exact factorises. One client's stack has
    # rank r, so there lora_exact's product is FLoRA's exactly.
    lay = layout()
    w, clients = draw(lay, 2, seed=5)
    n = torch.tensor([1.0, 3.0], dtype=torch.float64)
    p = n / n.sum()
    mp = hand_mean_product(lay, clients, p)
    worst = 0.0
    for proj in PROJ:
        a_st = torch.cat([pk * factors(lay, wk)[proj][0] for pk, wk in zip(p, clients,
                                                                             strict=True)])
        b_st = torch.cat([factors(lay, wk)[proj][1] for wk in clients], dim=1)
        worst = max(worst, float((b_st @ a_st - mp[proj]).abs().max()))
    assert worst < 1e-12
    # one client: FLoRA's stacked product is its own B A, which lora_exact keeps
    new, _ = exact_step(lay, w, clients[:1])
    for proj, (a, b) in factors(lay, new).items():
        a1, b1 = factors(lay, clients[0])[proj]
        assert torch.allclose(b @ a, b1 @ a1, atol=1e-12)


def test_exact_when_the_clients_a_cancel_in_the_mean():
    # A_2 = −A_1, B_2 = −B_1: FedAvg's Ā and B̄ are zero, the mean product is B_1 A_1
    # (rank r); the closest split has nothing to project, the balanced one carries it
    lay = layout(extra=False)
    w, (w1,) = draw(lay, 1, seed=7)
    new, metrics = exact_step(lay, w, [w1, -w1])
    for proj, (a, b) in factors(lay, new).items():
        a1, b1 = factors(lay, w1)[proj]
        assert torch.allclose(b @ a, b1 @ a1, atol=1e-12)
    assert metrics["lora_truncation_error"] < 1e-12
    assert math.isclose(metrics["lora_product_error"], 1.0, rel_tol=1e-12)  # B̄Ā = 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_exact_at_the_start_zero_b_is_finite(dtype):
    # LoRA's start: B = 0 on the server and on every client (no step taken yet): M = 0
    lay = layout(extra=False)
    w, clients = draw(lay, 3, seed=6)
    for v in [w, *clients]:
        for t in lay:
            if ".lora_B." in t.name:
                v[t.slice] = 0
    w, clients = w.to(dtype), [c.to(dtype) for c in clients]
    agg = LoRAExact()
    out, _, metrics = agg(cohort(lay, w, clients), torch.ones(3, dtype=dtype), agg.init(lay),
                          info=info(w, 3))
    assert torch.isfinite(out).all() and out.dtype == dtype
    a_bar = torch.stack(clients).mean(0)
    new = w - out
    for proj, (a, b) in factors(lay, new).items():
        assert float(b.abs().max()) == 0                      # B' = 0
        assert torch.allclose(a, factors(lay, a_bar)[proj][0], atol=1e-5)  # A' = Ā
    assert metrics == {"lora_truncation_error": 0.0, "lora_product_error": 0.0}
    # everything zero (A too): still finite, still zero
    z = torch.zeros(lay.size, dtype=dtype)
    out, _, _ = agg(torch.zeros(2, lay.size, dtype=dtype), torch.ones(2, dtype=dtype),
                    agg.init(lay), info=info(z, 2))
    assert torch.equal(out, torch.zeros_like(out))
    # the balanced split at M = 0 gives A' = 0 (its stated weakness), finite as well
    bal = LoRAExact(split="balanced")
    out, _, _ = bal(cohort(lay, w, clients), torch.ones(3, dtype=dtype), bal.init(lay),
                    info=info(w, 3))
    assert torch.isfinite(out).all()


def test_exact_without_pairs_is_the_mean_and_refuses_what_it_cannot_do():
    # B alone (FFA-LoRA's layout): the weighted mean, without the global model
    only_b = Layout([(f"{PROJ[0]}.lora_B.default.weight", (FOUT, R))])
    rows = torch.randn(3, only_b.size, dtype=torch.float64)
    n = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    out, _, metrics = LoRAExact()(rows, n, LoRAExact().init(only_b), info=None)
    assert torch.allclose(out, (n / n.sum()) @ rows) and metrics == {}
    with pytest.raises(ValueError, match=r"^aggregator\.options\.split: must be"):
        LoRAExact(split="svd")  # type: ignore[arg-type]
    lay = layout()
    w, clients = draw(lay, 2)
    agg = LoRAExact()
    with pytest.raises(ValueError, match=r"^lora_exact: needs the global model"):
        agg(cohort(lay, w, clients), torch.ones(2, dtype=torch.float64), agg.init(lay),
            info=None)
    assert LoRAExact().capabilities.requires == frozenset({"w"})
    assert not LoRAExact().capabilities.linear


def test_fedsa_lora_keeps_exactly_the_b_coordinates():
    lay = layout()
    b = torch.zeros(lay.size, dtype=torch.bool)
    for t in lay:
        if ".lora_B." in t.name:
            b[t.slice] = True
    assert torch.equal(FedSALoRA(lay).mask.bool(), b)
    a = torch.zeros_like(b)
    for t in lay:
        if ".lora_A." in t.name:
            a[t.slice] = True
    assert torch.equal(FedSALoRA(lay, keep="A").mask.bool(), a)  # the paper's ablation
    # the head (no adapter) is shared either way; a model without A or B is refused
    assert not FedSALoRA(lay).mask[-3:].any()
    with pytest.raises(ValueError, match=r"^client\.method: fedsa_lora needs LoRA adapters"):
        FedSALoRA(Layout([(f"{PROJ[0]}.lora_B.default.weight", (FOUT, R))]))
