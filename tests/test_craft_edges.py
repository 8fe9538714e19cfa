"""CRAFT's and ConFIG's default paths at the edges: the cohorts training produces (float32).

Each cohort is solved by CRAFT with its default options and compared with

- the exact answer: ``g* = ĝ + U_cut⁺(ρ − Uĝ)`` in float64 from the SVD of the
  unit rows, singular values below ``σ_cut = max(1e-3, 1e-6·σ_max)`` dropped
  (the documented cut; the cohorts keep every singular value at least a factor
  of 2 away from it, so the cut is not a matter of rounding);
- the public code's rule (``match_reference=True``: ``ĝ + pinv(U)(ρ − Uĝ)`` in
  float32 with ``torch.linalg.pinv``'s default tolerance).

Each cohort is solved in round 1 (``ĝ = 0``) and in round 2 against the
reference left by an earlier round. ConFIG is compared the same way with its
float64 truncated rule and the public ConFIG_update.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fedloom import Layout
from fedloom.aggregate.conflict_free import ConFIG
from fedloom.aggregate.craft import CRAFT

SV_FLOOR, RTOL, ATOL = 1e-3, 1e-6, 1e-6  # CRAFT's defaults
EPS32 = torch.finfo(torch.float32).eps


@dataclass
class Cohort:
    name: str
    R: torch.Tensor  # float32 updates, one row per client
    n: torch.Tensor  # client sizes (ρ ∝ n)
    feasible: bool   # the constraints can all hold (rows independent, or targets consistent)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def _collinear(m: int, d: int, cos: float, seed: int) -> torch.Tensor:
    """Rows of pairwise cosine ≈ ``cos``: a shared direction plus (near-)orthogonal noise."""
    g = _gen(seed)
    e = _unit(torch.randn(d, generator=g, dtype=torch.float64))
    noise = _unit(torch.randn(m, d, generator=g, dtype=torch.float64))
    return cos**0.5 * e + (1 - cos) ** 0.5 * noise


def cohorts() -> list[Cohort]:
    out = []

    def add(name, R, feasible, seed, n=None, rescale=True):
        g = _gen(seed + 1000)
        scale = 0.5 + torch.rand(R.shape[0], 1, generator=g, dtype=torch.float64)
        sizes = torch.randint(20, 400, (R.shape[0],), generator=g).double() if n is None else n
        out.append(Cohort(name, (R * scale if rescale else R).float(), sizes, feasible))

    def randn(m, d, seed):
        return torch.randn(m, d, generator=_gen(seed), dtype=torch.float64)

    add("independent", randn(8, 500, 1), True, 1)
    add("correlated cos 0.9", _collinear(8, 500, 0.9, 2), True, 2)
    add("near-collinear cos 0.9999", _collinear(8, 2000, 0.9999, 3), True, 3)
    anti = _collinear(9, 500, 0.95, 4)
    anti[:3] *= -1  # a third of the clients pull the other way
    add("anti-correlated", anti, True, 4)
    spread = torch.logspace(-3, 3, 8, dtype=torch.float64)[:, None]
    add("norms 1e-3 … 1e3", randn(8, 500, 5) * spread, True, 5)
    add("low rank (rank 4 of 20)", randn(20, 4, 6) @ randn(4, 500, 7), False, 6)
    add("more clients than width (12 × 8)", randn(12, 8, 8), False, 8)
    dup = randn(6, 300, 9)
    dup[1] = dup[0]
    add("duplicated rows, different ρ", dup, False, 9,
        n=torch.tensor([50.0, 200.0, 80.0, 120.0, 60.0, 90.0], dtype=torch.float64))
    add("duplicated rows, equal ρ", dup, True, 9,
        n=torch.tensor([50.0, 50.0, 80.0, 120.0, 60.0, 90.0], dtype=torch.float64))
    near = randn(6, 1000, 10)
    near[1] = near[0] + 1e-4 * randn(1, 1000, 11)[0]  # 1e-4 apart (relative)
    add("near-duplicates, different ρ", near, False, 10,
        n=torch.tensor([50.0, 200.0, 80.0, 120.0, 60.0, 90.0], dtype=torch.float64))
    # at d = 200 the public pinv keeps the 1e-4 direction (its tolerance is d·eps·σ_max)
    near = randn(6, 200, 14)
    near[1] = near[0] + 1e-4 * randn(1, 200, 15)[0]
    add("near-duplicates at d = 200", near, False, 14,
        n=torch.tensor([50.0, 200.0, 80.0, 120.0, 60.0, 90.0], dtype=torch.float64))
    zero = randn(6, 300, 12)
    zero[2] = 0
    add("a zero row", zero, True, 12)
    # opposite multiples of one direction (g and −g), built in float32: on this draw
    # ConFIG's λᵀGλ went negative (NaN) before the fix
    g = _gen(6)
    v, c = torch.randn(50, generator=g), torch.randn(5, generator=g)
    add("±multiples of one direction", (c[:, None] * v[None, :]).double(), False, 13,
        rescale=False)
    return out


def _usable(c: Cohort) -> tuple[torch.Tensor, torch.Tensor]:
    R = c.R.double()
    keep = R.norm(dim=1) > 0
    U = _unit(R[keep])
    rho = c.n[keep] / c.n[keep].sum()
    return U, rho


def _exact(U: torch.Tensor, rho: torch.Tensor, ref: torch.Tensor):
    """float64 ``ĝ + U_cut⁺ b`` from the SVD of ``U``; also ``σ_cut``, ``σ``, ``b``."""
    P, S, Qh = torch.linalg.svd(U, full_matrices=False)
    cut = max(SV_FLOOR, RTOL * float(S.max()))
    near = ((S > cut / 2) & (S < 2 * cut)).any()
    assert not near, "cohort has a singular value near the cut: the test would be ill-posed"
    keep = S > cut
    b = rho - U @ ref
    g = ref + Qh[keep].T @ ((P[:, keep].T @ b) / S[keep])
    return g, cut, S, b


def _solve_both_rounds(c: Cohort, **opts):
    """(g, metrics, ĝ) for round 1 (no reference) and round 2 (reference from an earlier round)."""
    d = c.R.shape[1]
    agg = CRAFT(step="fixed", groups="global", **opts)
    out = []
    state = agg.init(Layout.flat(d))
    g, _, met = agg(c.R, c.n.float(), state)
    out.append((g, met, torch.zeros(d, dtype=torch.float64)))
    earlier = torch.randn(4, d, generator=_gen(99)).float()
    _, state, _ = agg(earlier, torch.ones(4), agg.init(Layout.flat(d)))
    prev = state.previous.double()
    ref = (prev / prev.norm()).float().double()  # ĝ as the aggregator holds it (input dtype)
    g, _, met = agg(c.R, c.n.float(), state)
    out.append((g, met, ref))
    return out, state


ALL = cohorts()


def test_output_is_finite_and_obeys_the_norm_bound():
    """‖g − ĝ‖ ≤ ‖ρ − Uĝ‖/σ_cut (the docstring's bound), with either precision.

    Fails on the code before the fix: with precision="float64" the
    near-duplicates took a step of 2.4e3 against a bound of 4.9e2.
    """
    for c in ALL:
        U, rho = _usable(c)
        for precision in ("mixed", "float64"):
            for g, _, ref in _solve_both_rounds(c, precision=precision)[0]:
                assert torch.isfinite(g).all(), c.name
                _, cut, _, b = _exact(U, rho, ref)
                bound = float(b.norm()) / cut
                step = float((g.double() - ref).norm())
                assert step <= bound * (1 + 1e-5) + 1e-5, (c.name, precision, step, bound)


def test_full_rank_groups_meet_the_constraints_to_1e6():
    """Every group of full row rank at the cut: |⟨u_i, g⟩ − ρ_i| ≤ 1e-6, nobody conflicts.

    Measured by this test in float64 on the returned float32 g. Fails before the
    fix: near-collinear rows (cos 0.9999) were met to 2.5e-4 only.
    """
    for c in ALL:
        U, rho = _usable(c)
        for g, met, ref in _solve_both_rounds(c)[0]:
            _, cut, S, _ = _exact(U, rho, ref)
            if S.numel() < U.shape[0] or float(S.min()) <= cut:
                continue  # rank-deficient at the cut: see the least-squares tests
            viol = float((U @ g.double() - rho).abs().max())
            assert viol <= ATOL, (c.name, viol)
            assert met["craft_max_violation"] <= ATOL, c.name
            assert met["craft_min_alignment"] > 0, c.name
            assert met["craft_infeasible_groups"] == 0, c.name


def test_result_is_the_exact_minimum_norm_or_least_squares_solution():
    """g equals the float64 truncated solution g* (KKT: g − ĝ in the row space of U,
    and U(g − g*) = 0 on the kept directions), to what the constraints' 1e-6 allows:
    ‖g − g*‖ ≤ 2√k·1e-6/σ_min,kept + 1e-5‖g*‖.

    Fails before the fix (relative error ‖g − g*‖/‖g*‖): low rank 19, more clients
    than width 2.0, duplicates 0.88 (spurious eigenvalues of the mixed Gram),
    near-collinear 3.8e-3.
    """
    for c in ALL:
        U, rho = _usable(c)
        for g, _, ref in _solve_both_rounds(c)[0]:
            g_star, cut, S, _ = _exact(U, rho, ref)
            s_kept = float(S[S > cut].min())
            tol = 2 * U.shape[0] ** 0.5 * ATOL / s_kept + 1e-5 * float(g_star.norm())
            err = float((g.double() - g_star).norm())
            assert err <= tol, (c.name, err, tol)
            # KKT of min ½‖g − ĝ‖² s.t. Ug = ρ (or its least-squares form): g − ĝ ∈ rowspace(U)
            delta = g.double() - ref
            Q, _ = torch.linalg.qr(U.T)
            off = float((delta - Q @ (Q.T @ delta)).norm())
            assert off <= 4 * EPS32 * float(g.double().norm()) + 1e-7, (c.name, off)


def test_infeasible_groups_are_counted_and_only_those():
    """Dependent rows whose targets disagree → counted in craft_infeasible_groups;
    consistent targets on dependent rows (duplicates with equal ρ) meet the
    constraints and are not counted.

    Fails before the fix: duplicates with different ρ were not counted (mixed),
    near-duplicates not counted with precision="float64", and consistent
    duplicates counted (float64).
    """
    for c in ALL:
        for precision in ("mixed", "float64"):
            for _g, met, _ in _solve_both_rounds(c, precision=precision)[0]:
                expected = 0 if c.feasible else 1
                assert met["craft_infeasible_groups"] == expected, (c.name, precision)
                if c.feasible:
                    assert met["craft_max_violation"] <= ATOL, (c.name, precision)


def test_never_worse_than_the_public_rule():
    """The public code's output (match_reference) never dominates the default's:
    either the default meets the constraints at least as well (to 1e-6, the
    guarantee), or its step is no longer. (The public rule keeps near-duplicate
    directions at small d, meeting them with a step 1e3× longer; at larger d it
    drops whole near-collinear cohorts, missing the constraints by 1e-2.)

    Fails before the fix: rank-deficient groups had both a larger violation and a
    longer step than the public code (low rank: 0.31 and 0.52 against 0.093 and 0.12).
    """
    for c in ALL:
        U, rho = _usable(c)
        ours, _ = _solve_both_rounds(c)
        public, _ = _solve_both_rounds(c, match_reference=True)
        for (g, _, ref), (gp, _, _) in zip(ours, public, strict=True):
            v = float((U @ g.double() - rho).abs().max())
            vp = float((U @ gp.double() - rho).abs().max())
            step, step_p = float((g.double() - ref).norm()), float((gp.double() - ref).norm())
            assert v <= max(vp, ATOL) or step <= step_p * (1 + 1e-6), (c.name, v, vp, step, step_p)


def test_one_client_gives_its_update_and_overflowing_float32_is_solved_in_float64():
    """One usable client: its raw update (the public rule). Rows of size 1e25 overflow
    the float32 Gram (1e50): the group is solved in float64, not a LinAlgError.

    The second half fails before the fix (torch.linalg.LinAlgError from eigh).
    """
    R = torch.zeros(3, 40)
    R[1] = torch.arange(40.0)
    agg = CRAFT(step="fixed", groups="global")
    g, _, _ = agg(R, torch.ones(3), agg.init(Layout.flat(40)))
    assert torch.equal(g, R[1])
    c = ALL[0]
    big = c.R * 1e25
    g1, _, _ = agg(c.R, c.n.float(), agg.init(Layout.flat(c.R.shape[1])))
    g2, _, met = agg(big, c.n.float(), agg.init(Layout.flat(c.R.shape[1])))
    # the problem only sees directions: scaling every update leaves g unchanged
    assert torch.isfinite(g2).all() and met["craft_max_violation"] <= ATOL
    assert torch.allclose(g2, g1, rtol=0, atol=1e-5 * float(g1.norm()))


@pytest.mark.parametrize("m", [2, 5])
def test_layer_groups_each_get_the_fallback(m):
    """Per-layer solve: a near-collinear layer and a well-conditioned layer in one
    model; each group meets its constraints (the fallback is per group).

    Fails before the fix (the near-collinear layer met to 1.9e-3 and 8.9e-3 only).
    """
    layout = Layout([("a.weight", (40, 50)), ("b.weight", (10, 30))],
                    [["a.weight"], ["b.weight"]])
    R = torch.cat([_collinear(m, 2000, 0.99999, 20 + m), torch.randn(m, 300, generator=_gen(m),
                                                                      dtype=torch.float64)], 1)
    R = R.float()
    n = torch.arange(1.0, m + 1)
    agg = CRAFT(step="fixed")
    g, _, met = agg(R, n, agg.init(layout))
    for grp in layout.groups:
        U = _unit(R[:, grp.slice].double())
        assert float((U @ g[grp.slice].double() - n.double() / n.sum()).abs().max()) <= ATOL
    assert met["craft_max_violation"] <= ATOL and met["craft_infeasible_groups"] == 0


# ------------------------------------------------------------------------ ConFIG
def _config_exact(c: Cohort, length: str = "mean") -> torch.Tensor:
    """float64 ConFIG with the documented cut: ĝ ∝ U_cut⁺1, |g| = mean (or sum) of ⟨g_i, ĝ⟩."""
    R = c.R.double()
    R = R[R.norm(dim=1) > 0]
    U = _unit(R)
    P, S, Qh = torch.linalg.svd(U, full_matrices=False)
    cut = max(SV_FLOOR, RTOL * float(S.max()))
    assert not ((S > cut / 2) & (S < 2 * cut)).any()
    keep = S > cut
    gu = Qh[keep].T @ ((P[:, keep].T @ torch.ones(U.shape[0], dtype=torch.float64)) / S[keep])
    unit = gu / gu.norm()
    proj = R @ unit
    return (proj.sum() if length == "sum" else proj.mean()) * unit


def _public_config(grads: torch.Tensor) -> torch.Tensor:
    """tum-pbs/ConFIG ``ConFIG_update`` (EqualWeight, ProjectionLength) with
    ``use_least_square=False``: ``pinv(units) @ 1``, then the sum of projections."""
    units = torch.nan_to_num(grads / grads.norm(dim=1).unsqueeze(1), 0)
    best = torch.linalg.pinv(units) @ torch.ones(grads.shape[0], dtype=grads.dtype)
    unit = best / best.norm()
    return torch.stack([torch.dot(g_i, unit) for g_i in grads]).sum() * unit


def test_config_is_finite_bounded_and_equals_the_float64_rule():
    """ConFIG (default length="mean") on every cohort: finite, ‖g‖ ≤ mean‖g_i‖
    (Cauchy–Schwarz on the mean of projections onto a unit vector), equal to the
    float64 truncated rule to 2e-4, and at equal angles to every client where
    the rows have full rank at the cut (conflict-free: all ⟨g_i, g⟩ > 0).

    Fails before the fix: ±multiples of one direction gave NaN (λᵀGλ < 0), low-rank
    rows and more clients than width a length 1e-7 of the exact one.
    """
    for c in ALL:
        g, _, _ = ConFIG()(c.R, c.n.float(), None)
        assert torch.isfinite(g).all(), c.name
        R = c.R.double()
        R = R[R.norm(dim=1) > 0]
        assert float(g.double().norm()) <= float(R.norm(dim=1).mean()) * (1 + 1e-6), c.name
        exact = _config_exact(c)
        err = float((g.double() - exact).norm() / exact.norm())
        assert err <= 2e-4, (c.name, err)
        S = torch.linalg.svdvals(_unit(R))
        if S.numel() == R.shape[0] and float(S.min()) > SV_FLOOR:
            cos = (R @ g.double()) / (R.norm(dim=1) * g.double().norm())
            assert (cos > 0).all(), c.name
            assert float(cos.max() - cos.min()) <= 1e-5, c.name


def test_config_sum_matches_the_public_rule():
    """length="sum" is the public ConFIG_update; compared on every cohort where the
    public pinv's tolerance (max(m, d)·eps·σ_max) keeps the same directions as the
    documented cut (all of them here). Max relative difference measured: 2.0e-4
    (near-collinear: the public float32 pinv's own distance to the float64 rule),
    ≤ 3.3e-6 elsewhere.

    Fails before the fix: low rank and more clients than width (relative
    difference 1.0: the length had shrunk 1e7×).
    """
    compared = 0
    for c in ALL:
        R = c.R.double()
        S = torch.linalg.svdvals(_unit(R[R.norm(dim=1) > 0]))
        pub_cut = max(R.shape) * EPS32 * float(S.max())
        ours_cut = max(SV_FLOOR, RTOL * float(S.max()))
        lo, hi = min(pub_cut, ours_cut), max(pub_cut, ours_cut)
        if ((S > lo) & (S <= hi)).any():
            continue  # the two rules keep different directions by design
        compared += 1
        g, _, _ = ConFIG(length="sum")(c.R, c.n.float(), None)
        pub = _public_config(c.R).double()
        err = float((g.double() - pub).norm() / pub.norm())
        assert err <= 1e-3, (c.name, err)
    assert compared >= 8


def test_config_reports_rows_with_no_equal_angle_direction():
    """``config_infeasible``: 1 where no direction makes equal angles with every client
    (g and −g; more clients than width), 0 where one exists (duplicates included)."""
    by_name = {c.name: c for c in ALL}
    expect = {"±multiples of one direction": 1.0, "more clients than width (12 × 8)": 1.0,
              "duplicated rows, different ρ": 0.0, "independent": 0.0,
              "near-collinear cos 0.9999": 0.0}
    for name, flag in expect.items():
        c = by_name[name]
        _, _, met = ConFIG()(c.R, c.n.float(), None)
        assert met["config_infeasible"] == flag, name
