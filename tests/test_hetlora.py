"""HetLoRA (issue #41 item 3, heterogeneous ranks): the rank truncation of a layout, the
zero-padded mean against the public baseline written out by hand (float64, no model),
then whole runs on tests/test_llm.py's tiny Llama."""

import math
from types import SimpleNamespace

import pytest
import torch

from fedloom.aggregate.base import CohortInfo, make_aggregator
from fedloom.client.hetlora import check_ranks
from fedloom.params import Layout

R, FIN, FOUT = 4, 5, 3
PROJ = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]


def layout():
    specs, groups = [], []
    for p in PROJ:
        a, b = f"{p}.lora_A.default.weight", f"{p}.lora_B.default.weight"
        specs += [(a, (R, FIN)), (b, (FOUT, R))]
        groups.append([a, b])
    specs.append(("score.weight", (2,)))
    groups.append(["score.weight"])
    return Layout(specs, groups)


def truncate(lay, vec, rank):
    """The client's model: each adapter's first ``rank`` terms, by name and shape."""
    t = {n: v.clone() for n, v in lay.unflatten(vec).items()}
    for n, v in t.items():
        if ".lora_A." in n:
            v[rank:] = 0
        elif ".lora_B." in n:
            v[:, rank:] = 0
    return lay.flatten(t)


def public_baseline(lay, models, ranks, p):
    """The public HetLoRA baseline (ATP-1010/FederatedLLM, fed_utils/model_aggregation.py,
    stacking=False with zero_padding=True, written out, not imported): each client's
    rank-r_k A [r_k, in] and B [out, r_k] zero-padded to the largest rank, then the
    sample-weighted mean of every tensor."""
    out = {}
    for k, (wk, rk) in enumerate(zip(models, ranks, strict=True)):
        for n, v in lay.unflatten(wk).items():
            if ".lora_A." in n:
                small = v[:rk]
                v = torch.nn.functional.pad(small, (0, 0, 0, R - rk))
            elif ".lora_B." in n:
                small = v[:, :rk]
                v = torch.nn.functional.pad(small, (0, R - rk))
            out[n] = out.get(n, 0) + p[k] * v
    return lay.flatten(out)


def cohort(seed=0, ranks=(1, 2, 4), m=5):
    """Global w, the clients' trained truncated models, their rows as the method sends
    them (zeros beyond their rank), sample counts; client c has ranks[c % len]."""
    lay = layout()
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(lay.size, generator=g, dtype=torch.float64)
    rk = [ranks[c % len(ranks)] for c in range(m)]
    models = [truncate(lay, w + 0.3 * torch.randn(lay.size, generator=g, dtype=torch.float64),
                       r) for r in rk]
    rows = torch.stack([torch.where(lay.lora_rank_cut(r), torch.zeros(()), w - wk)
                        for wk, r in zip(models, rk, strict=True)])
    n = torch.tensor([float(5 + 3 * c) for c in range(m)], dtype=torch.float64)
    info = CohortInfo(clients=torch.arange(m), round=0, num_clients=m, w=w)
    return SimpleNamespace(lay=lay, w=w, models=models, rk=rk, rows=rows, n=n, info=info)


def step(lay, rows, n, info, **opts):
    agg = make_aggregator("hetlora", **opts)
    out, _, metrics = agg(rows, n, agg.init(lay), info=info)
    return out, metrics


def test_rank_cut_is_the_trailing_terms_of_every_adapter():
    lay = layout()
    assert not lay.lora_rank_cut(R).any()
    for r in range(1, R):
        cut = lay.lora_rank_cut(r)
        for t in lay:
            part = cut[t.slice].view(t.shape)
            if ".lora_A." in t.name:
                assert not part[:r].any() and part[r:].all()
            elif ".lora_B." in t.name:
                assert not part[:, :r].any() and part[:, r:].all()
            else:
                assert not part.any()
        # a smaller rank holds fewer terms
        assert bool((lay.lora_rank_cut(r + 1) <= cut).all())


@pytest.mark.parametrize("ranks", [(1, 2, 4), (2,), (4,), (1, 3)])
def test_zero_padding_matches_the_public_baseline(ranks):
    c = cohort(ranks=ranks)
    out, metrics = step(c.lay, c.rows, c.n, c.info, ranks=list(ranks))
    new = c.w - out  # server.lr 1, the rule's default: the next global model
    want = public_baseline(c.lay, c.models, c.rk, c.n / c.n.sum())
    assert torch.allclose(new, want, atol=1e-12, rtol=0)
    assert metrics["hetlora_outside"] == 0


def test_without_pairs_or_at_full_rank_it_is_fedavg():
    rows = torch.randn(3, 4, dtype=torch.float64)
    n = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    info = CohortInfo(clients=torch.arange(3), round=0, num_clients=3, w=torch.zeros(4))
    out, _ = step(Layout([("w", (4,))]), rows, n, info)
    assert torch.allclose(out, (n / n.sum()) @ rows, atol=1e-15, rtol=0)


def test_default_ranks_are_a_quarter_a_half_and_all_of_r():
    assert check_ranks(layout(), None, "x") == (1, 2, 4)
    assert make_aggregator("hetlora").init(layout()).ranks == (1, 2, 4)


def test_all_clients_at_full_rank_is_fedavg():
    c = cohort(ranks=(R,))
    out, _ = step(c.lay, c.rows, c.n, c.info, ranks=[R])
    assert torch.allclose(out, (c.n / c.n.sum()) @ c.rows, atol=1e-15, rtol=0)


def test_holders_average_each_term_over_the_clients_that_hold_it():
    c = cohort(ranks=(1, 2), m=4)
    lay, rows = c.lay, c.rows
    out, _ = step(lay, rows, c.n, c.info, ranks=[1, 2], pad="holders")
    p = c.n / c.n.sum()
    a = lay[f"{PROJ[0]}.lora_A.default.weight"]
    av = out[a.slice].view(a.shape)
    rows_a = rows[:, a.slice].view(-1, *a.shape)
    # term 0: every client; term 1: the rank-2 clients (odd ids); terms 2, 3: nobody
    assert torch.allclose(av[0], torch.einsum("k,ki->i", p, rows_a[:, 0]))
    odd = torch.tensor([1, 3])
    assert torch.allclose(av[1], torch.einsum("k,ki->i", p[odd] / p[odd].sum(), rows_a[odd, 1]))
    assert not av[2:].any()


def test_what_a_client_sends_beyond_its_rank_is_left_out_and_measured():
    c = cohort()
    lay, rows, n, info, rk = c.lay, c.rows, c.n, c.info, c.rk
    _, m0 = step(lay, rows, n, info, ranks=[1, 2, 4])
    noisy = rows + 0.01 * torch.randn(rows.shape, generator=torch.Generator().manual_seed(1),
                                      dtype=rows.dtype)
    kept = torch.stack([torch.where(lay.lora_rank_cut(r), rows[k], noisy[k])
                        for k, r in enumerate(rk)])
    out, m1 = step(lay, noisy, n, info, ranks=[1, 2, 4])
    before = noisy.clone()
    assert torch.allclose(out, step(lay, kept, n, info, ranks=[1, 2, 4])[0], atol=1e-15)
    assert torch.equal(noisy, before)  # the caller's rows are not written
    assert m0["hetlora_outside"] == 0 and 0 < m1["hetlora_outside"] < 1


def test_refusals_name_the_option():
    lay = layout()
    no_pairs = Layout([("w", (4,))])
    with pytest.raises(ValueError, match=r"aggregator.options.ranks: each rank .* rank 4"):
        make_aggregator("hetlora", ranks=[2, 5]).init(lay)
    with pytest.raises(ValueError, match=r"aggregator.options.pad"):
        make_aggregator("hetlora", pad="mean")
    with pytest.raises(ValueError, match=r"aggregator.options.ranks: a non-empty list"):
        make_aggregator("hetlora", ranks=[])
    for bad in ([0], [1.5], [True], "2", []):
        with pytest.raises(ValueError, match=r"client.method.options.ranks"):
            check_ranks(lay, bad, "client.method.options.ranks")
    with pytest.raises(ValueError, match=r"client.method.options.ranks: heterogeneous ranks"):
        check_ranks(no_pairs, [1], "client.method.options.ranks")


# ------------------------------------------------------------------ whole runs (tiny Llama)
def _llm():
    pytest.importorskip("transformers", reason="the llm extra (transformers) is not installed")
    pytest.importorskip("peft", reason="the llm extra (peft) is not installed")
    import test_lora_runs

    return test_lora_runs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    llm = _llm()
    return llm.test_llm.corpus.__wrapped__(tmp_path_factory)


def _run(corpus, **over):
    import fedloom

    return fedloom.run(_llm().config(corpus, rounds=2, **over))


def test_full_rank_is_plain_local_training(corpus):
    from test_llm import RANK

    plain = _run(corpus)
    het = _run(corpus, client={"lr": 0.5, "steps": 2, "batch_size": 4,
                               "method": {"name": "hetlora", "options": {"ranks": [RANK]}}})
    assert torch.equal(plain.w, het.w)


def test_rank_one_clients_leave_the_other_terms_to_padding(corpus):
    client = {"lr": 0.5, "steps": 2, "batch_size": 4,
              "method": {"name": "hetlora", "options": {"ranks": [1]}}}
    import fedloom

    zero = _run(corpus, client=client, aggregator={"name": "hetlora", "options": {"ranks": [1]}})
    holders = {"name": "hetlora", "options": {"ranks": [1], "pad": "holders"}}
    held = _run(corpus, client=client, aggregator=holders)
    once = fedloom.run(_llm().config(corpus, rounds=1, client=client, aggregator=holders))
    for t in zero.layout:
        if ".lora_A." in t.name:
            a0, a1, a2 = (r.w[t.slice].view(t.shape) for r in (zero, once, held))
            assert a0[0].any() and not a0[1:].any()  # zero-padded: no client holds term 1
            # where nobody holds a term it keeps its initial (random) value
            assert a1[1:].any() and torch.equal(a1[1:], a2[1:])
            assert not torch.equal(a1[0], a2[0])      # term 0 trained
    assert all(m["hetlora_outside"] == 0 for m in zero.metrics)


def test_composes_with_compression_and_resumes_bit_identically(corpus, tmp_path):
    from conftest import stop_and_resume

    cfg = _llm().config(
        corpus, rounds=3,
        client={"lr": 0.5, "steps": 2, "batch_size": 4,
                "method": {"name": "hetlora", "options": {"ranks": [1, 2]}}},
        aggregator={"name": "hetlora", "options": {"ranks": [1, 2]}},
        compression={"name": "topk", "options": {"ratio": 0.25}, "feedback": "ef"},
        checkpoint={"every": 1})
    ref, res = stop_and_resume(cfg, [], tmp_path / "run")
    assert torch.equal(ref.w, res.w)
    last = ref.metrics[-1]
    assert math.isfinite(last["test_loss"]) and last["rejected_rounds_total"] == 0
