"""Conformance suite: every registered aggregator obeys the shared properties."""

import pytest
import torch

from fedloom import CohortInfo, Layout, make_aggregator
from fedloom.registry import available

D = 30
LAYOUT = Layout([("a.weight", (4, 5)), ("a.bias", (4,)), ("b.weight", (6,))],
                [["a.weight", "a.bias"], ["b.weight"]])
# Options a rule is checked at: FLAME without its noise (tests/test_defences.py checks it).
OPTIONS = {"flame": {"lam": 0.0}}
# Rules whose output for m identical updates is that update.
# (FLTrust: with the server's reference update equal to that update.)
MEAN_LIKE = {"fedavg", "fednova", "fedfv", "config", "fedlf", "coordmean", "bulyan",
             "geometric_median", "flame", "fltrust"}


def _cohort(m=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    U = torch.randn(m, D, generator=gen, dtype=torch.float64)
    n = torch.randint(5, 50, (m,), generator=gen).double()
    info = CohortInfo(
        clients=torch.arange(m), round=0, num_clients=20,
        losses=torch.rand(m, generator=gen, dtype=torch.float64) + 0.5,
        steps=torch.randint(1, 10, (m,), generator=gen),
        lr=0.1, momentum=0.0,
        start_losses=torch.rand(m, generator=gen, dtype=torch.float64) + 0.5,
        # the server's reference update (FLTrust): the rows' mean, to which some row
        # has a positive cosine (Σ_i g_i · mean = m ‖mean‖²)
        reference=U.mean(0),
    )
    return U, n, info


def _permute(info: CohortInfo, perm):
    return CohortInfo(
        clients=info.clients[perm], round=info.round, num_clients=info.num_clients,
        losses=info.losses[perm], steps=info.steps[perm], lr=info.lr, momentum=info.momentum,
        start_losses=info.start_losses[perm], reference=info.reference,
    )


@pytest.fixture(params=available("aggregator"))
def name(request):
    return request.param


def test_shape_finite_and_state_threads_through(name):
    agg = make_aggregator(name, **OPTIONS.get(name, {}))
    state = agg.init(LAYOUT)
    for r in range(3):
        U, n, info = _cohort(seed=r)
        out, state, metrics = agg(U, n, state, info=info)
        assert out.shape == (D,) and out.dtype == U.dtype
        assert torch.isfinite(out).all()
        assert all(isinstance(v, float) for v in metrics.values())


def test_permutation_invariant(name):
    U, n, info = _cohort(m=7, seed=3)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    agg = make_aggregator(name, **OPTIONS.get(name, {}))
    # second round, so that stateful rules (CRAFT's reference, FedFV's history) are exercised
    s0 = agg.init(LAYOUT)
    _, s1, _ = agg(U * 0.5 + 0.1, n, s0, info=info)
    a, _, _ = agg(U, n, s1, info=info)
    b, _, _ = agg(U[perm], n[perm], s1, info=_permute(info, perm))
    assert torch.allclose(a, b, atol=1e-9, rtol=1e-9)


def test_identical_updates(name):
    U, n, info = _cohort(m=5, seed=4)
    info = CohortInfo(**{**info.__dict__, "start_losses": torch.full((5,), 0.7,
                                                                      dtype=torch.float64),
                         "steps": torch.full((5,), 3), "reference": U[0]})
    g = U[0]
    rows = g.repeat(5, 1)
    agg = make_aggregator(name, **OPTIONS.get(name, {}))
    out, _, _ = agg(rows, n, agg.init(LAYOUT), info=info)
    # CRAFT's per-layer mode rescales each group on its own: parallel group by group.
    for grp in LAYOUT.groups:
        o, h = out[grp.slice], g[grp.slice]
        assert torch.dot(o, h) / (o.norm() * h.norm()) > 1 - 1e-9
    if name in MEAN_LIKE:
        assert torch.allclose(out, g, atol=1e-9)


def test_rejects_unknown_option(name):
    with pytest.raises(ValueError, match=r"aggregator\.options\.bogus"):
        make_aggregator(name, bogus=1)
