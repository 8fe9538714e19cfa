"""CRAFT: constraints, minimum-norm correction, edge cases, reference path."""

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fedloom import Layout, make_aggregator
from fedloom.aggregate.craft import CRAFT


def _rows(m, d, seed, dtype=torch.float64):
    return torch.randn(m, d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _unit(R):
    return R / R.norm(dim=1, keepdim=True)


def _rho(n):
    return n / n.sum()


@settings(max_examples=60, deadline=None)
@given(m=st.integers(2, 8), extra=st.integers(0, 30), seed=st.integers(0, 10**6),
       with_ref=st.booleans())
def test_constraints_hold_and_correction_is_minimum_norm(m, extra, seed, with_ref):
    d = m + extra
    R = _rows(m, d, seed) * torch.rand(m, 1, generator=torch.Generator().manual_seed(seed + 1),
                                       dtype=torch.float64).add(0.1)
    n = torch.randint(1, 100, (m,), generator=torch.Generator().manual_seed(seed + 2)).double()
    U = _unit(R)
    assume(torch.linalg.matrix_rank(U) == m and torch.linalg.svdvals(U).min() > 1e-4)
    craft = CRAFT(step="fixed", groups="global")
    state = craft.init(Layout.flat(d))
    if with_ref:  # a previous aggregate gives the reference ĝ
        _, state, _ = craft(_rows(m, d, seed + 3), n, state)
    ref = state.previous / state.previous.norm() if with_ref else torch.zeros(d, dtype=R.dtype)
    g, _, metrics = craft(R, n, state)
    # 1. the constraints U g = ρ hold (no client conflicts with g)
    assert torch.allclose(U @ g, _rho(n), atol=1e-8, rtol=0)
    assert metrics["craft_max_violation"] < 1e-8
    assert metrics["craft_min_alignment"] > 0
    assert metrics["craft_infeasible_groups"] == 0
    # 2. KKT of min ½‖g − ĝ‖² s.t. Ug = ρ: g − ĝ lies in the row space of U
    delta = g - ref
    Q, _ = torch.linalg.qr(U.T)
    assert torch.allclose(Q @ (Q.T @ delta), delta, atol=1e-8)
    # 3. the closed form ĝ + U⁺(ρ − Uĝ)
    assert torch.allclose(g, ref + torch.linalg.pinv(U) @ (_rho(n) - U @ ref), atol=1e-8)


def test_layer_mode_solves_each_group():
    layout = Layout([("l1.weight", (3, 4)), ("l1.bias", (3,)), ("l2.weight", (2, 3)),
                     ("l2.bias", (2,))], [["l1.weight", "l1.bias"], ["l2.weight", "l2.bias"]])
    R = _rows(4, layout.size, 0)
    n = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    agg = make_aggregator("craft", step="fixed", groups="layer")
    g, _, metrics = agg(R, n, agg.init(layout))
    for grp in layout.groups:
        Ug = _unit(R[:, grp.slice]) @ g[grp.slice]
        assert torch.allclose(Ug, _rho(n), atol=1e-10)
    assert metrics["craft_max_violation"] < 1e-10
    # global mode: one problem over the whole vector, so only the global constraints hold
    glob = make_aggregator("craft", step="fixed", groups="global")
    gg, _, _ = glob(R, n, agg.init(layout.regroup("global")))
    assert torch.allclose(_unit(R) @ gg, _rho(n), atol=1e-10)


def test_zero_rows_are_dropped_and_rho_renormalised():
    R = _rows(4, 10, 1)
    R[2] = 0
    n = torch.tensor([1.0, 1.0, 5.0, 2.0], dtype=torch.float64)
    agg = CRAFT(step="fixed", groups="global")
    g, _, _ = agg(R, n, agg.init(Layout.flat(10)))
    keep = [0, 1, 3]
    rho = n[keep] / n[keep].sum()  # the zero row's share is redistributed
    assert torch.allclose(_unit(R[keep]) @ g, rho, atol=1e-10)


def test_single_usable_client_returns_its_raw_update_and_all_zero_gives_zero():
    R = torch.zeros(3, 6, dtype=torch.float64)
    R[1] = torch.arange(6.0)
    agg = CRAFT(step="fixed", groups="global")
    g, _, _ = agg(R, torch.ones(3, dtype=torch.float64), agg.init(Layout.flat(6)))
    assert torch.equal(g, R[1])
    z, _, _ = agg(torch.zeros(3, 6, dtype=torch.float64), torch.ones(3, dtype=torch.float64),
                  agg.init(Layout.flat(6)))
    assert torch.equal(z, torch.zeros(6, dtype=torch.float64))


def test_more_clients_than_width_is_least_squares_and_reported():
    m, d = 6, 4
    R = _rows(m, d, 2)
    n = torch.arange(1.0, m + 1, dtype=torch.float64)
    agg = CRAFT(step="fixed", groups="global")
    g, _, metrics = agg(R, n, agg.init(Layout.flat(d)))
    U = _unit(R)
    assert metrics["craft_infeasible_groups"] == 1
    assert metrics["craft_max_violation"] > 1e-3  # the constraints cannot all hold
    assert torch.allclose(g, torch.linalg.pinv(U) @ _rho(n), atol=1e-10)  # least squares


def test_near_collinear_clients_still_meet_constraints_in_float64():
    base = _rows(1, 50, 3)
    # directions 1e-2 apart: singular values 1.1e-2, 1.3e-2 of U, ten times the
    # default cut sv_floor = 1e-3, so the constraints are met exactly
    R = base.repeat(3, 1) + 1e-2 * _rows(3, 50, 4)
    n = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    agg = CRAFT(step="fixed", groups="global")
    g, _, metrics = agg(R, n, agg.init(Layout.flat(50)))
    assert metrics["craft_max_violation"] < 1e-8
    # exact agreement costs a long step along the clients' small differences
    assert g.norm() > 10
    # a coarse tolerance treats the differences as noise: least squares, violation reported
    coarse = CRAFT(step="fixed", groups="global", rtol=1e-2)
    g2, _, m2 = coarse(R, n, coarse.init(Layout.flat(50)))
    assert m2["craft_infeasible_groups"] == 1 and m2["craft_max_violation"] > 1e-3
    assert g2.norm() < g.norm()
    # directions 1e-4 apart (singular values ~1e-4 < sv_floor): the same least squares
    # by default, with a step bounded by ‖ρ‖/sv_floor instead of ~1e3
    R3 = base.repeat(3, 1) + 1e-4 * _rows(3, 50, 4)
    g3, _, m3 = agg(R3, n, agg.init(Layout.flat(50)))
    assert m3["craft_infeasible_groups"] == 1 and g3.norm() < 1
    exact = CRAFT(step="fixed", groups="global", sv_floor=0.0)
    g4, _, m4 = exact(R3, n, exact.init(Layout.flat(50)))
    assert m4["craft_max_violation"] < 1e-6 and g4.norm() > 1e3


def test_float32_mixed_precision_gram_meets_constraints_to_float32_accuracy():
    R = _rows(10, 20000, 5, dtype=torch.float32)
    n = torch.arange(1.0, 11.0)
    for precision in ("float64", "mixed"):
        agg = CRAFT(step="fixed", groups="global", precision=precision, chunk=4096)
        g, _, metrics = agg(R, n, agg.init(Layout.flat(20000)))
        assert g.dtype == torch.float32
        assert metrics["craft_max_violation"] <= 1e-6, precision


def test_match_reference_equals_public_float32_pinv_formula():
    """The public code: ĝ + pinv(U)(ρ − Uĝ) in float32, U = rows/‖rows‖ (nan → 0)."""
    layout = Layout([("a.weight", (5, 8)), ("a.bias", (5,)), ("b.weight", (3, 5))],
                    [["a.weight", "a.bias"], ["b.weight"]])
    gen = torch.Generator().manual_seed(7)
    n = torch.tensor([3.0, 1.0, 2.0, 5.0])
    agg = make_aggregator("craft", match_reference=True)
    state = agg.init(layout)
    prev = None
    for _ in range(3):
        R = torch.randn(4, layout.size, generator=gen)
        g, state, _ = agg(R, n, state)
        parts = []
        for grp in layout.groups:
            Rq = R[:, grp.slice]
            U = torch.nan_to_num(Rq / torch.linalg.vector_norm(Rq, dim=1, keepdim=True))
            if prev is None:
                ref = torch.zeros(grp.size)
            else:
                ref = prev[grp.slice] / torch.linalg.vector_norm(prev[grp.slice])
            rho = n / n.sum()
            parts.append(ref + torch.linalg.pinv(U) @ (rho - U @ ref))
        expected = torch.cat(parts)
        assert g.dtype == torch.float32
        assert torch.equal(g, expected)
        prev = expected


def test_bad_options():
    with pytest.raises(ValueError, match="groups"):
        make_aggregator("craft", step="fixed", groups="neuron")
    with pytest.raises(ValueError, match="rtol"):
        make_aggregator("craft", rtol=0)
    with pytest.raises(ValueError, match="sv_floor"):
        make_aggregator("craft", sv_floor=-1.0)
    with pytest.raises(ValueError, match="atol"):
        make_aggregator("craft", atol=0.0)
