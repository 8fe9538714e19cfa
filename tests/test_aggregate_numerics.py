"""Aggregator numerics at the edges of the floating-point range, and degenerate cohorts.

Each test states its reference: an exact one (active-set enumeration, rational
arithmetic) or a second computation of the same rule on rescaled input (the
rules below are homogeneous or scale-free, so ``c·U`` must give ``c·out`` or ``out``).
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from fedloom import CohortInfo, Layout, make_aggregator
from fedloom.aggregate.fedlf import min_norm_point

D = 24
LAYOUT = Layout([("a.weight", (4, 4)), ("a.bias", (4,)), ("b.weight", (4,))],
                [["a.weight", "a.bias"], ["b.weight"]])


def _info(m: int, seed: int = 0, lr: float = 0.1) -> CohortInfo:
    gen = torch.Generator().manual_seed(seed)
    return CohortInfo(clients=torch.arange(m), round=0, num_clients=20,
                      losses=torch.rand(m, generator=gen, dtype=torch.float64) + 0.5,
                      steps=torch.randint(1, 5, (m,), generator=gen), lr=lr, momentum=0.0,
                      start_losses=torch.rand(m, generator=gen, dtype=torch.float64) + 0.5)


def _rows(m: int, seed: int, kind: str = "independent") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    R = torch.randn(m, D, generator=gen, dtype=torch.float64)
    if kind == "correlated":
        R = 0.95 * torch.randn(D, generator=gen, dtype=torch.float64) + 0.3 * R
    return R


def _norm(x: torch.Tensor) -> float:
    """‖x‖ without squaring huge or tiny entries (the reference side of the tests)."""
    x = x.double()
    a = float(x.abs().max())
    return a * float((x / a).norm()) if a > 0 else 0.0


# --------------------------------------------------------------- FedLF's min-norm solver
def _exact_min_norm(Q: np.ndarray) -> np.ndarray:
    """min_{λ∈Δ} ‖λᵀQ‖ by enumerating active sets on the float64 rows divided by their
    largest norm (the optimum is a vertex of some face: its affine minimiser with λ ≥ 0)."""
    Qn = Q / np.linalg.norm(Q, axis=1).max()
    G = Qn @ Qn.T
    n = G.shape[0]
    best, best_x = np.inf, None
    for r in range(1, n + 1):
        for S in itertools.combinations(range(n), r):
            A = np.ones((r + 1, r + 1))
            A[:r, :r] = G[np.ix_(S, S)]
            A[r, r] = 0.0
            rhs = np.zeros(r + 1)
            rhs[r] = 1.0
            a = np.linalg.lstsq(A, rhs, rcond=None)[0][:r]
            if (a < -1e-12).any():
                continue
            x = a @ Qn[list(S)]
            v = float(x @ x)
            if v < best:
                best, best_x = v, x
    return best_x * np.linalg.norm(Q, axis=1).max()


def _hulls():
    gen = np.random.default_rng(5)
    base = gen.standard_normal((5, 6))
    yield "independent", base
    yield "near_collinear", base[0] + 1e-3 * base                         # cos ≈ 1 − 1e-6
    yield "rank_deficient", gen.standard_normal((5, 2)) @ gen.standard_normal((2, 6))
    yield "duplicated", np.vstack([base[:3], base[:2]])
    yield "spread", base * np.array([[1e-2], [1.0], [1e1], [3.0], [1e-1]])


@pytest.mark.parametrize("c", [1e-12, 1e-8, 1e-4, 1.0, 1e4, 1e6, 1e12])
def test_min_norm_point_is_scale_invariant(c):
    """The min-norm weights of c·Q are those of Q: ``λᵀ(cQ)`` matches the exact
    min-norm point of ``cQ`` to 1e-9·c·max‖q_i‖ (the solver's gap test stops at
    ‖x‖² − ⟨x, q_j⟩ ≤ 1e-12·max‖q‖², i.e. ~1e-12 relative; 1e-9 leaves room
    for near-collinear faces)."""
    for name, Q in _hulls():
        Qc = Q * c
        lam = min_norm_point(torch.from_numpy(Qc @ Qc.T)).numpy()
        ref = _exact_min_norm(Qc)
        err = float(np.abs(lam @ Qc - ref).max()) / (c * np.linalg.norm(Q, axis=1).max())
        assert err <= 1e-9, f"{name} at c = {c:g}: error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fedlf_is_homogeneous_over_the_range(dtype):
    """FedLF(c·U) = c·FedLF(U): every step is homogeneous (unit rows, a scale-free
    min-norm problem, a rescaling to ‖mean‖). Tolerance: 1e-9 relative in float64
    (min-norm solver ~1e-12), 1e-5 in float32 (the rows' rounding, ~1e-7, through a
    6 × 6 solve). Float32 c up to 1e12 keeps ‖c·U‖ ≤ ~1e13: rows ≥ 1e19 overflowed
    float32 squares before."""
    R, info = _rows(6, 1), _info(6, 1)
    cs = [1e-150, 1e-12, 1e12, 1e150] if dtype == torch.float64 else [1e-12, 1e12, 1e25]
    agg = make_aggregator("fedlf")
    ref, _, _ = agg(R.to(dtype), torch.ones(6, dtype=dtype), agg.init(LAYOUT), info=info)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    for c in cs:
        out, _, _ = agg((R * c).to(dtype), torch.ones(6, dtype=dtype), agg.init(LAYOUT),
                        info=info)
        diff = _norm(out.double() / c - ref.double())
        assert diff <= tol * _norm(ref), f"c = {c:g}: ‖out/c − ref‖ = {diff:.3g}"


def test_fedlf_float32_norms_spread_over_1e40():
    """Float32 rows of norms 1e-20 … 1e20: FedLF is finite and equals the float64
    computation on the same (exactly representable) rows, to 1e-5 relative (float32
    output rounding 6e-8 and the rows' own values are the same in both)."""
    s = torch.logspace(-20, 20, 5, dtype=torch.float64)[:, None]
    R = (_rows(5, 2) * s).float()
    info = _info(5, 2)
    agg = make_aggregator("fedlf")
    a, _, _ = agg(R, torch.ones(5), agg.init(LAYOUT), info=info)
    b, _, _ = agg(R.double(), torch.ones(5, dtype=torch.float64), agg.init(LAYOUT), info=info)
    assert bool(torch.isfinite(a).all())
    assert _norm(a.double() - b) <= 1e-5 * _norm(b)


# --------------------------------------------------------------------- CRAFT, tiny rows
def test_craft_mixed_path_keeps_tiny_float32_rows():
    """A float32 row of entries ~1e-24 (its float32 squares underflow) is a client
    like any other: its constraint ⟨u_i, g⟩ = ρ_i holds, measured in float64 on the
    returned g, and ``craft_max_violation`` reports that same violation; the output
    does not depend on the order of the rows. Before: the row was read as zero, the
    real violation was 0.27 while the metric said 7e-8."""
    R = _rows(5, 0)
    R[2] *= 1e-24
    n = torch.arange(1.0, 6.0)
    outs = []
    for perm in (torch.arange(5), torch.tensor([4, 2, 0, 3, 1])):
        agg = make_aggregator("craft", step="fixed", groups="global")
        out, _, met = agg(R[perm].float(), n[perm], agg.init(Layout.flat(D)))
        U = R[perm] / R[perm].norm(dim=1, keepdim=True)
        real = float((U @ out.double() - n[perm].double() / 15).abs().max())
        eps_g = torch.finfo(torch.float32).eps * float(out.double().norm())
        assert real <= 1e-6 + eps_g, f"real violation {real:.3g}"
        assert abs(met["craft_max_violation"] - real) <= 1e-6 + eps_g
        outs.append(out.double())
    assert float((outs[0] - outs[1]).abs().max()) <= 1e-6


# -------------------------------------------------------------- range: every rule
RULES = ["fedavg", "krum", "qfedavg", "fedfv", "fedlf", "config", "fednova", "afl", "median",
         "trimmed_mean", "coordmean", "craft", "craft:fixed"]
# "craft:fixed": CRAFT at the paper's step, whose output does not depend on c at all;
# "craft" (its default, rprop) is at the mean update's length: homogeneous
HOMOGENEOUS = {"fedavg", "krum", "fedfv", "fedlf", "config", "fednova", "median",
               "trimmed_mean", "coordmean", "craft"}
RANGE = [(torch.float64, 1e160), (torch.float64, 1e200), (torch.float64, 1e-170),
         (torch.float32, 1e19), (torch.float32, 1e30), (torch.float32, 1e-25)]


@pytest.mark.parametrize("name", RULES)
@pytest.mark.parametrize(("dtype", "c"), RANGE)
def test_every_rule_is_finite_and_scales_over_the_range(name, dtype, c):
    """Finite input of any size gives a finite output or a ValueError naming the rule,
    and the homogeneous rules give c·out(U) (to 1e-6 relative: float32 rounding of
    rows and output; the reference is the same rule at c = 1). Before: CRAFT, ConFIG,
    FedFV returned non-finite vectors at ‖g‖ ≳ 1e154 and Krum raised ZeroDivisionError."""
    R, info = _rows(6, 3, "correlated"), _info(6, 3)
    w = torch.arange(1.0, 7.0, dtype=dtype)
    rule, _, step = name.partition(":")
    agg = make_aggregator(rule, **({"step": step} if step else {}))
    try:
        out, _, met = agg((R * c).to(dtype), w, agg.init(LAYOUT), info=info)
    except ValueError as e:
        assert str(e).startswith(rule), e
        return
    assert bool(torch.isfinite(out).all()), f"{name}: non-finite output at c = {c:g}"
    assert all(isinstance(v, float) for v in met.values())
    ref, _, _ = agg(R.to(dtype), w, agg.init(LAYOUT), info=info)
    if name in HOMOGENEOUS:
        diff = _norm(out.double() / c - ref.double())
        assert diff <= 1e-6 * _norm(ref), f"{name}: ‖out/c − out(U)‖ = {diff:.3g}"
    elif name == "craft:fixed":
        assert _norm(out.double() - ref.double()) <= 1e-5 * _norm(ref)


def test_krum_huge_rows_select_as_at_unit_scale():
    """Krum on rows of norm ~1e200 (squares overflow float64) selects the same client
    as on the rows themselves; before it raised ZeroDivisionError."""
    R, info = _rows(7, 4), _info(7, 4)
    R[3] += 5.0  # an outlier
    agg = make_aggregator("krum", f=1)
    _, _, a = agg(R, torch.ones(7, dtype=torch.float64), None, info=info)
    _, _, b = agg(R * 1e200, torch.ones(7, dtype=torch.float64), None, info=info)
    assert a["krum_best_client"] == b["krum_best_client"]


# ------------------------------------------------------------------------- q-FedAvg
def _qfedavg_exact(R: torch.Tensor, F: torch.Tensor, q: int, L: float) -> torch.Tensor:
    """The public rule (easyFL ``algorithm/qfedavg.py``: F_k + 1e-10, Δ_k = L g_k,
    h_k = q F^(q−1)‖Δ_k‖² + L F^q) in exact rational arithmetic (integer q)."""
    rows = [[Fraction(float(x)) for x in r] for r in R.double()]
    Fs = [Fraction(float(f)) + Fraction(1e-10) for f in F.double()]
    Lf = Fraction(L)
    h = sum(q * f ** (q - 1) * Lf * Lf * sum(x * x for x in r) + Lf * f**q
            for f, r in zip(Fs, rows, strict=True))
    return torch.tensor([float(sum(f**q * Lf * r[j] for f, r in zip(Fs, rows, strict=True)) / h)
                         for j in range(R.shape[1])], dtype=torch.float64)


@pytest.mark.parametrize("q", [1, 2])
@pytest.mark.parametrize("c", [1e-3, 1e160, 1e-170])
def test_qfedavg_matches_the_exact_public_rule(q, c):
    """q-FedAvg equals the public rule computed in rational arithmetic, to 1e-13
    relative (a few float64 roundings per entry), from rows of 1e-3 to rows whose
    squares overflow float64 (before: the direction was 0 at ‖g‖ ≳ 1e154)."""
    R = _rows(4, 6) * c
    F = torch.tensor([1e-4, 3e-3, 1e-2, 0.0], dtype=torch.float64)  # a zero loss too
    info = CohortInfo(clients=torch.arange(4), round=0, num_clients=9, start_losses=F, lr=0.05)
    out, _, _ = make_aggregator("qfedavg", q=float(q))(R, torch.ones(4), None, info=info)
    ref = _qfedavg_exact(R, F, q, 1 / 0.05)
    assert _norm(out - ref) <= 1e-13 * _norm(ref)


# ---------------------------------------------------------------------- rank one
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("precision", ["mixed", "float64"])
def test_config_rank_one_with_cancelling_signs_is_zero(dtype, precision):
    """Rows v, −2v, 3v, −0.5v: U has rank one and 1 ⟂ its row space (signs + − + −),
    so U_cut⁺1 = 0 and ConFIG's direction is 0 in every order. Before: 0, 3.7, 7.4 or
    11 depending on the order (rounding of the eigenvectors)."""
    v = torch.randn(40, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    R = torch.stack([v, -2 * v, 3 * v, -0.5 * v]).to(dtype)
    agg = make_aggregator("config", precision=precision)
    for p in itertools.permutations(range(4)):
        out, _, met = agg(R[list(p)], torch.ones(4, dtype=dtype), None)
        assert float(out.abs().max()) == 0.0, (p, float(out.double().norm()))
        assert met["config_infeasible"] == 1.0


def test_config_rank_one_same_signs_is_the_mean():
    """Rows v, 2v, 3v (one direction, all signs equal): the exact answer is the
    projection of the mean on v, i.e. 2v, in every order (to 1e-6: float32 rows)."""
    v = torch.randn(40, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    R = torch.stack([v, 2 * v, 3 * v]).float()
    agg = make_aggregator("config")
    for p in itertools.permutations(range(3)):
        out, _, _ = agg(R[list(p)], torch.ones(3), None)
        assert float((out.double() - 2 * v).norm()) <= 1e-6 * math.sqrt(40) * float(v.norm())


def _rank_one(m: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(1, D, generator=gen, dtype=torch.float64)
    return torch.randn(m, 1, generator=gen, dtype=torch.float64) @ v, v[0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fedfv_rank_one_cohort_is_exact_and_order_free(dtype):
    """Rows ``a_i v`` (an outer product, numerical rank one): every FedFV projection
    acts along v, so the exact result is a multiple of v, and 0 where a projection
    removes the whole aggregate; in every order. Before: after such a projection the
    remainder (1.5e-17 of ‖v‖ in exact arithmetic on the rounded rows) was rescaled
    to ‖mean‖ (0.10 on make_cohort("low_rank", 5, 2) of the property suite), in a
    direction set by rounding. Tolerance: parallel to v to 1e-6 (float32 rows'
    direction is v's to ~eps32), orders agree to 1e-6·‖mean‖."""
    gen = torch.Generator().manual_seed(11)
    for seed in range(12):
        m = 3 + seed % 4
        R, v = _rank_one(m, seed)
        R = R.to(dtype)
        info = _info(m, seed)
        target = float(R.double().mean(0).norm())
        outs = []
        for _ in range(4):
            p = torch.randperm(m, generator=gen)
            agg = make_aggregator("fedfv", alpha=0.1, tau=1)
            pinfo = CohortInfo(clients=info.clients[p], round=0, num_clients=20,
                               start_losses=info.start_losses[p])
            out, _, _ = agg(R[p], torch.ones(m, dtype=dtype), agg.init(LAYOUT), info=pinfo)
            o = out.double()
            if float(o.norm()) > 0:
                cos = abs(float(o @ v)) / float(o.norm() * v.norm())
                assert cos >= 1 - 1e-6, f"seed {seed}: |cos(out, v)| = {cos:.6f}"
            outs.append(o)
        spread = max(float((o - outs[0]).norm()) for o in outs)
        assert spread <= 1e-6 * target, f"seed {seed}: orders differ by {spread:.3g}"


# ------------------------------------------------------------------ gram.py helpers
def test_row_scales_are_powers_of_two_that_bring_rows_into_range():
    """Each factor is 2^−e with max|s_i r_i| in [0.5, 1); zero and non-finite rows get 1;
    ``common`` gives one factor, from the largest entry."""
    from fedloom.aggregate.gram import row_scales

    R = torch.tensor([[3e200, -1.0], [1e-300, 0.0], [0.0, 0.0], [float("nan"), 1.0],
                      [0.75, 0.1]], dtype=torch.float64)
    s = row_scales(R)
    m, _ = torch.frexp(s)
    assert bool((m == 0.5).all())                      # exact powers of two
    top = (R[[0, 1, 4]] * s[[0, 1, 4], None]).abs().amax(1)
    assert bool(((top >= 0.5) & (top < 1)).all())
    assert float(s[2]) == 1.0 and float(s[3]) == 1.0
    c = row_scales(R[[0, 1, 4]], common=True)
    assert bool((c == c[0]).all()) and float((R[0] * c[0]).abs().max()) < 1


def test_safe_norm_neither_overflows_nor_underflows():
    """‖x‖ of entries 1e200 or 1e-200 (their squares are beyond float64) to 1e-15
    relative (x = c·(3, 4): the norm is 5c); a NaN entry gives NaN, a zero vector 0."""
    from fedloom.aggregate.gram import safe_norm

    for c in (1e200, 1e-200, 1.0):
        assert abs(safe_norm(torch.tensor([3.0, 4.0], dtype=torch.float64) * c) - 5 * c) <= (
            1e-15 * 5 * c)
    assert math.isnan(safe_norm(torch.tensor([1.0, float("nan")])))
    assert safe_norm(torch.zeros(3)) == 0.0


def test_out_of_range_tells_zero_rows_from_underflowed_ones():
    """A zero row is in range; a float32 row whose squares underflow to 0 is not, nor
    is a float64 Gram with an infinite entry."""
    from fedloom.aggregate.gram import gram, out_of_range

    R = torch.zeros(3, 8)
    R[0] = 1.0
    G, _ = gram(R, precision="mixed")
    assert not out_of_range(G, R, torch.float32)
    R[1] = 1e-24
    G, _ = gram(R, precision="mixed")
    assert out_of_range(G, R, torch.float32)
    H = torch.ones(2, 8, dtype=torch.float64) * 1e160
    assert out_of_range(gram(H)[0], H, torch.float64)
