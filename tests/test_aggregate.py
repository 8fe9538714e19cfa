import pytest
import torch

from fedloom import Layout, make_aggregator
from fedloom.server_opt import ServerOptimizer


def test_fedavg_golden_three_clients():
    # g1 = [1, 0, 2], g2 = [0, 3, 0], g3 = [-1, 1, 1]; n = [1, 2, 1] → p = [1/4, 1/2, 1/4].
    # agg = [1/4 - 1/4, 3/2 + 1/4, 2/4 + 1/4] = [0, 1.75, 0.75]  (exact in binary).
    U = torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0], [-1.0, 1.0, 1.0]])
    n = torch.tensor([1.0, 2.0, 1.0])
    agg = make_aggregator("fedavg")
    out, _, _ = agg(U, n, agg.init(Layout.flat(3)))
    assert torch.equal(out, torch.tensor([0.0, 1.75, 0.75]))
    # unweighted: [0, 4/3, 1]
    out2, _, _ = make_aggregator("fedavg", weighted=False)(U, n, None)
    assert torch.allclose(out2, torch.tensor([0.0, 4 / 3, 1.0]))


def test_fedavg_permutation_invariant_and_affine():
    gen = torch.Generator().manual_seed(0)
    U = torch.randn(6, 50, generator=gen, dtype=torch.float64)
    n = torch.randint(1, 100, (6,), generator=gen).double()
    agg = make_aggregator("fedavg")
    a, _, _ = agg(U, n, None)
    perm = torch.randperm(6, generator=gen)
    b, _, _ = agg(U[perm], n[perm], None)
    assert torch.allclose(a, b, atol=1e-14)
    # identical rows → that row
    c, _, _ = agg(U[:1].repeat(4, 1), n[:4], None)
    assert torch.allclose(c, U[0], atol=1e-14)


def test_make_aggregator_rejects_unknown_option_and_name():
    with pytest.raises(ValueError, match=r"aggregator\.options\.beta"):
        make_aggregator("fedavg", beta=1)
    with pytest.raises(KeyError, match="unknown aggregator"):
        make_aggregator("nope")


def test_server_optimizers_golden_one_step():
    w = torch.tensor([1.0, -2.0], dtype=torch.float64)
    g = torch.tensor([0.5, -1.0], dtype=torch.float64)
    sgd = ServerOptimizer("sgd", lr=0.1)
    assert torch.allclose(sgd.step(w, g, sgd.init(w))[0], w - 0.1 * g)
    mom = ServerOptimizer("momentum", lr=0.1, momentum=0.9)
    s = mom.init(w)
    w1, s = mom.step(w, g, s)
    w2, s = mom.step(w1, g, s)
    # v1 = g, v2 = 0.9 g + g = 1.9 g → w2 = w - 0.1 g - 0.19 g
    assert torch.allclose(w2, w - 0.29 * g)
    adam = ServerOptimizer("adam", lr=0.01, beta1=0.9, beta2=0.99, eps=1e-3)
    w1, s = adam.step(w, g, adam.init(w))
    # m = 0.1 g, v = 0.99·τ² + 0.01 g² → w1 = w − η m / (√v + τ)
    m = 0.1 * g
    v = 0.99 * 1e-6 + 0.01 * g * g
    assert torch.allclose(w1, w - 0.01 * m / (v.sqrt() + 1e-3))
    yogi = ServerOptimizer("yogi", lr=0.01, beta1=0.9, beta2=0.99, eps=1e-3)
    w1, s = yogi.step(w, g, yogi.init(w))
    # v0 = τ² < g², so sign(v0 − g²) = −1 and v = τ² + 0.01 g²
    v = 1e-6 + 0.01 * g * g
    assert torch.allclose(w1, w - 0.01 * m / (v.sqrt() + 1e-3))
    ada = ServerOptimizer("adagrad", lr=0.01, eps=1e-3)
    w1, s = ada.step(w, g, ada.init(w))
    assert torch.allclose(w1, w - 0.01 * g / ((1e-6 + g * g).sqrt() + 1e-3))
