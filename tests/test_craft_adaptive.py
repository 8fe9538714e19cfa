"""CRAFT's step modes and targets, SA-PEF's residual α schedule (issue 26).

Properties first (each can fail):

- ``norm_matched`` and ``rprop`` return, per layer group, a non-negative multiple
  of the ``fixed`` direction (the constraint-preserving property: for ``c > 0``
  every ``⟨u_i, c g⟩ = c ρ_i > 0``), of length ``τ·‖ḡ^q‖`` (``ḡ^q`` the group's
  weighted mean update; ``τ = 1`` for ``norm_matched``), finite on every
  adversarial cohort kind of the aggregator property suite, in float32 and float64,
  from a fresh state and after a round;
- ``targets="loss"`` with ``q = 0`` gives the data targets; with ``q > 0`` the
  alignments are in the ratio ``(n_i/n_j)(F_i/F_j)^q`` at full row rank;
- ``rprop``'s trust factor follows its rule (golden values below, derived by hand)
  and stays in its bounds;
- the residual α is in ``[0, alpha] ⊂ [0, 1]`` for any norms (NaN, 0, inf, huge);
- the states survive a checkpoint: a stopped and resumed run is bit-identical;
- every mode composes with a momentum and an Adam server (finite, the loss falls).
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conftest import stop_and_resume
from fedloom import CohortInfo, Layout, make_aggregator
from fedloom.aggregate.base import default_server_lr
from fedloom.aggregate.craft import CRAFT, CraftState
from fedloom.compress.feedback import make_feedback, residual_alpha
from fedloom.server_opt import ServerOptimizer
from test_aggregator_properties import KINDS, LAYOUT, make_cohort

MODES = ("norm_matched", "rprop")
_HYP = settings(max_examples=2, deadline=None, derandomize=True,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


def _norm(x: torch.Tensor) -> float:
    x = x.double()
    a = float(x.abs().max()) if x.numel() else 0.0
    return a * float((x / a).norm()) if a > 0 and math.isfinite(a) else a


def _mean(U: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    p = n.double() / n.double().sum()
    return p @ U.double()


# ------------------------------------------------------------------ options, server.lr
def test_options_are_validated_naming_the_field():
    for kw, field in [({"step": "adaptive"}, "step"), ({"targets": "fair"}, "targets"),
                      ({"step_up": 0.9}, "step_up"), ({"step_down": 0.0}, "step_down"),
                      ({"step_down": 1.5}, "step_down"), ({"step_min": 2.0}, "step_min"),
                      ({"step_max": math.inf}, "step_max"), ({"targets_q": -1}, "targets_q"),
                      ({"targets_q": math.nan}, "targets_q")]:
        with pytest.raises(ValueError, match=rf"^aggregator\.options\.{field}:"):
            CRAFT(**kw)
    with pytest.raises(ValueError, match="stepp"):
        make_aggregator("craft", stepp="rprop")
    with pytest.raises(ValueError, match=r"compression\.feedback\.options\.alpha_schedule"):
        make_feedback("sapef", alpha_schedule="adaptive")
    with pytest.raises(ValueError, match=r"compression\.feedback\.options\.alpha_kappa"):
        make_feedback("sapef", alpha_schedule="residual", alpha_kappa=0)


def test_auto_server_lr_follows_the_step_mode():
    assert default_server_lr("craft") == CRAFT.server_lr_for({}) == 1.0  # rprop's
    assert default_server_lr("craft", {"match_reference": True}) == 0.1  # the public code
    assert default_server_lr("craft", {"step": "fixed"}) == 0.1  # the public code's
    assert default_server_lr("craft", {"step": "norm_matched"}) == 1.0  # FedAvg's
    assert default_server_lr("craft", {"step": "rprop"}) == 1.0
    assert default_server_lr("fedavg", {"anything": 1}) == 1.0
    assert CRAFT(targets="loss").capabilities.requires == {"start_losses"}
    assert CRAFT().capabilities.requires == frozenset()


# ---------------------------------------------------------------- the scaling property
def _fixed_and_mode(mode: str, c, w, targets: str = "data"):
    """The fixed-mode output and the mode's output on cohort ``c`` (after ``w``)."""
    outs = []
    for step in ("fixed", mode):
        agg = make_aggregator("craft", step=step, targets=targets)
        state = agg.init(LAYOUT)
        if w is not None:
            _, state, _ = agg(w.U, w.n, state, info=w.info)
        out, new, metrics = agg(c.U, c.n, state, info=c.info)
        outs.append((out, state, new, metrics))
    return outs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_positive_rescaling_of_the_fixed_direction(mode, kind):
    """Per group: ``out^q = c^q g^q`` with ``c^q ≥ 0`` and ``‖out^q‖ = τ^q ‖ḡ^q‖``, so every
    usable client's alignment keeps its sign (and the ratios ρ_i/ρ_j) where ``c > 0``."""

    @_HYP
    @given(m=st.integers(2, 10), seed=st.integers(0, 2**31 - 1),
           dtype=st.sampled_from([torch.float32, torch.float64]), warm=st.booleans(),
           targets=st.sampled_from(["data", "loss"]))
    def check(m, seed, dtype, warm, targets):
        c = make_cohort(kind, m, seed, dtype)
        w = make_cohort(kind, m, seed + 1, dtype, round=0) if warm else None
        (g, _, _, _), (o, state, new, metrics) = _fixed_and_mode(mode, c, w, targets)
        assert o.shape == g.shape and o.dtype == dtype
        assert bool(torch.isfinite(o).all()), f"{mode}: non-finite on {c!r}"
        assert all(isinstance(v, float) for v in metrics.values())
        tau = new.trust if mode == "rprop" else torch.ones(len(state.groups))
        assert bool(((tau >= 0.1) & (tau <= 10.0)).all())
        tol = 1e-3 if dtype == torch.float32 else 1e-8
        for q, grp in enumerate(LAYOUT.groups):
            gq, oq = g[grp.slice].double(), o[grp.slice].double()
            want = float(tau[q]) * _norm(_mean(c.U[:, grp.slice], c.n))
            assert abs(_norm(oq) - want) <= tol * want + 1e-300, (
                f"{mode}: ‖out^q‖ = {_norm(oq):.6g}, want τ‖ḡ‖ = {want:.6g} on {c!r}")
            if _norm(oq) > 0 and _norm(gq) > 0:
                cos = float((oq / _norm(oq)) @ (gq / _norm(gq)))
                assert cos >= 1 - tol, f"{mode}: cos(out, fixed) = {cos:.8f} on {c!r}"
                # the alignments: same sign as the fixed direction's (ρ_i > 0 at full rank)
                U = c.U[:, grp.slice].double()
                norms = torch.stack([torch.tensor(_norm(r)) for r in U])
                use = norms > 0
                if int(use.sum()) >= 2:
                    Uu = U[use] / norms[use, None]
                    sv = torch.linalg.svdvals(Uu)
                    if Uu.shape[0] <= Uu.shape[1] and float(sv[-1] / sv[0]) >= 1e-3:
                        al = Uu @ (oq / _norm(oq))
                        assert float(al.min()) > 0, f"{mode}: a conflicting client on {c!r}"

    check()


def test_edges_zero_groups_one_client_zero_rows_non_finite():
    lay = Layout([("a.weight", (4, 3)), ("b.weight", (5,))], [["a.weight"], ["b.weight"]])
    gen = torch.Generator().manual_seed(0)
    n = torch.tensor([3.0, 5.0, 2.0])
    for mode in MODES:
        agg = CRAFT(step=mode)
        U = torch.randn(3, lay.size, generator=gen)
        U[:, 12:] = 0  # group b: every row zero
        out, _, _ = agg(U, n, agg.init(lay))
        assert bool(torch.isfinite(out).all()) and bool((out[12:] == 0).all())
        assert float(out[:12].norm()) > 0
        # one client: its own update (c = ‖g_1‖/‖g_1‖ = 1)
        one, _, _ = agg(U[:1], n[:1], agg.init(lay))
        torch.testing.assert_close(one, U[0], rtol=1e-6, atol=0)
        # opposite updates of equal weight: ḡ = 0, the group does not move
        V = torch.stack([U[0], -U[0]])
        zero, _, _ = agg(V, torch.tensor([1.0, 1.0]), agg.init(lay))
        assert bool((zero == 0).all())
        # all-zero updates: zeros; a huge cohort (float32 squares overflow): finite
        z, _, _ = agg(torch.zeros(3, lay.size), n, agg.init(lay))
        assert bool((z == 0).all())
        big, _, _ = agg(U * 1e30, n, agg.init(lay))
        assert bool(torch.isfinite(big).all()) and float(big.norm()) > 1e29
        # a non-finite row: a NaN direction (the engine rejects it), never a silent average
        bad = U.clone()
        bad[1, 0] = math.nan
        nan, _, _ = agg(bad, n, agg.init(lay))
        assert bool(torch.isnan(nan[:12]).all())


# ----------------------------------------------------------------------------- targets
def _info(losses):
    m = len(losses)
    return CohortInfo(clients=torch.arange(m), round=0, num_clients=10,
                      start_losses=torch.tensor(losses, dtype=torch.float64))


def test_loss_targets_weigh_clients_by_their_start_loss():
    gen = torch.Generator().manual_seed(4)
    lay = Layout([("w", (40,))], [["w"]])
    U = torch.randn(4, 40, generator=gen, dtype=torch.float64)  # full row rank
    n = torch.tensor([10.0, 20.0, 30.0, 40.0], dtype=torch.float64)
    F = [0.5, 2.0, 1.0, 4.0]
    unit = U / U.norm(dim=1, keepdim=True)
    # the direction as solved (step fixed): its alignments are the targets
    data, _, _ = CRAFT(step="fixed")(U, n, CRAFT().init(lay))
    q0, _, _ = CRAFT(step="fixed", targets="loss", targets_q=0)(U, n, CRAFT().init(lay),
                                                               info=_info(F))
    torch.testing.assert_close(q0, data, rtol=1e-12, atol=1e-12)
    for q in (1.0, 2.0):
        agg = CRAFT(step="fixed", targets="loss", targets_q=q)
        g, _, _ = agg(U, n, agg.init(lay), info=_info(F))
        rho = n * torch.tensor(F, dtype=torch.float64) ** q
        torch.testing.assert_close(unit @ g, rho / rho.sum(), rtol=1e-9, atol=1e-12)
    # a huge q or loss: no overflow; a non-finite loss counts as the largest finite one
    for losses, q in [([1e300, 1.0, 2.0, 3.0], 50.0), ([math.inf, 1.0, 4.0, math.nan], 1.0),
                      ([0.0, 0.0, 0.0, 0.0], 3.0)]:
        agg = CRAFT(step="fixed", targets="loss", targets_q=q)
        g, _, m = agg(U, n, agg.init(lay), info=_info(losses))
        # ρ_i down to e^-700 of the largest: met to the solver's atol (1e-6), not resolved
        assert bool(torch.isfinite(g).all()) and m["craft_min_alignment"] > -1e-6
        assert m["craft_max_violation"] <= 1e-6
    g, _, _ = CRAFT(step="fixed", targets="loss")(U, n, CRAFT().init(lay),
                                                  info=_info([math.inf, 1.0, 4.0, math.nan]))
    rho = n * torch.tensor([4.0, 1.0, 4.0, 4.0], dtype=torch.float64)
    torch.testing.assert_close(unit @ g, rho / rho.sum(), rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="losses >= 0"):
        CRAFT(targets="loss")(U, n, CRAFT().init(lay), info=_info([-1.0, 1.0, 1.0, 1.0]))
    with pytest.raises(ValueError, match="start losses"):
        CRAFT(targets="loss")(U, n, CRAFT().init(lay))


# ------------------------------------------------------------------------------- rprop
def test_rprop_trust_factor_golden():
    """One group, orthonormal updates, equal weights. Round 1: no previous step, τ = 1,
    ‖out‖ = ‖ḡ‖. Round 2: the clients pull along it (⟨ḡ, s⟩ > 0): τ = 1.2. Round 3:
    they pull back: τ = 1.2·0.5 = 0.6. Then 30 agreeing rounds: τ = min(100, 0.6·1.2^30)
    = 100 (step_max, its default), and 20 reversing rounds: max(0.1, 100·0.5^20) = 0.1
    (step_min); at step_max 10 (the cap before the default moved), 20 agreeing: 10."""
    lay = Layout([("w", (3,))], [["w"]])
    agg = CRAFT(step="rprop")
    e = torch.eye(3, dtype=torch.float64)
    n = torch.ones(2, dtype=torch.float64)
    state = agg.init(lay)
    U = torch.stack([e[0], e[1]])        # ḡ = (½, ½, 0), ‖ḡ‖ = 1/√2
    out, state, m = agg(U, n, state)
    assert m["craft_trust"] == 1.0
    assert abs(float(out.norm()) - 2**-0.5) < 1e-12
    out, state, m = agg(U, n, state)     # same pull: agrees
    assert abs(m["craft_trust"] - 1.2) < 1e-12
    assert abs(float(out.norm()) - 1.2 * 2**-0.5) < 1e-12
    out, state, m = agg(-U, n, state)    # reversed: overshoot
    assert abs(m["craft_trust"] - 0.6) < 1e-12
    low = agg.init(lay)
    for _ in range(30):
        _, state, m = agg(-U, n, state)
    assert m["craft_trust"] == 100.0
    sign = 1.0
    for _ in range(20):
        sign = -sign
        _, state, m = agg(sign * U, n, state)
    assert m["craft_trust"] == pytest.approx(0.1)
    capped = CRAFT(step="rprop", step_max=10)
    for _ in range(20):
        _, low, m = capped(-U, n, low)
    assert m["craft_trust"] == 10.0


def test_state_survives_a_checkpoint_and_an_old_one_loads():
    gen = torch.Generator().manual_seed(1)
    agg = CRAFT(step="rprop", targets="loss")
    state = agg.init(LAYOUT)
    cohorts = [(torch.randn(5, LAYOUT.size, generator=gen), torch.rand(5, generator=gen) + 1,
                _info((torch.rand(5, generator=gen) + 0.5).tolist())) for _ in range(4)]
    for U, n, info in cohorts[:2]:
        _, state, _ = agg(U, n, state, info=info)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    a, b = state, loaded
    for U, n, info in cohorts[2:]:
        oa, a, _ = agg(U, n, a, info=info)
        ob, b, _ = agg(U, n, b, info=info)
        assert torch.equal(oa, ob) and torch.equal(a.trust, b.trust)
    # a CraftState pickled before `trust` existed (no such attribute): τ starts at 1
    old = CraftState(state.groups, state.previous)
    del old.__dict__["trust"]
    buf = io.BytesIO()
    torch.save(old, buf)
    buf.seek(0)
    revived = torch.load(buf, weights_only=False)
    assert revived.trust is None
    out, _, m = agg(*cohorts[2][:2], revived, info=cohorts[2][2])
    assert bool(torch.isfinite(out).all()) and m["craft_trust"] in (0.5, 1.0, 1.2)


def test_engine_resume_is_bit_identical(tiny, tmp_path):
    ov = ["rounds=3", "checkpoint.every=1", "eval.every=3", "aggregator.name=craft",
          "aggregator.options.step=rprop", "aggregator.options.targets=loss",
          "compression.name=topk", "compression.options.ratio=0.1",
          "compression.feedback=sapef", "compression.feedback.options.alpha_schedule=residual"]
    ref, res = stop_and_resume(tiny, ov, tmp_path / "r")
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    assert ref.config.server.lr == 1.0  # server.lr: auto for rprop
    last = ref.metrics[-1]
    assert 0.1 <= last["craft_trust"] <= 10 and 0 <= last["alpha_next"] <= 0.85


# ------------------------------------------------------- with momentum and Adam servers
def _federated_least_squares(agg, opt: ServerOptimizer, rounds: int = 40
                             ) -> tuple[list[float], float]:
    """6 clients, each least squares on its own shifted targets, 5 local GD steps;
    returns the global loss per round (the mean of the clients') and its minimum."""
    gen = torch.Generator().manual_seed(7)
    lay = Layout([("a.weight", (3, 4)), ("a.bias", (3,)), ("b.weight", (2, 3))],
                 [["a.weight", "a.bias"], ["b.weight"]])
    d = lay.size
    A = [torch.randn(20, d, generator=gen, dtype=torch.float64) for _ in range(6)]
    y = [a @ torch.randn(d, generator=gen, dtype=torch.float64) * 0.5 + 1.0 for a in A]
    n = torch.tensor([20.0, 35, 10, 50, 25, 40], dtype=torch.float64)

    def loss(w, k):
        return 0.5 * float(((A[k] @ w - y[k]) ** 2).mean())

    # equal client sizes (20 rows each): the global minimiser is the stacked least squares
    w_star = torch.linalg.lstsq(torch.cat(A), torch.cat(y).unsqueeze(1)).solution.squeeze(1)
    f_star = sum(loss(w_star, k) for k in range(6)) / 6
    w = torch.zeros(d, dtype=torch.float64)
    state, ostate = agg.init(lay), opt.init(w)
    history = [sum(loss(w, k) for k in range(6)) / 6]
    for r in range(rounds):
        rows, starts = [], []
        for k in range(6):
            x = w.clone()
            starts.append(loss(w, k))
            for _ in range(5):
                x = x - 0.02 * A[k].T @ (A[k] @ x - y[k]) / len(y[k])
            rows.append(w - x)
        info = CohortInfo(clients=torch.arange(6), round=r, num_clients=6,
                          start_losses=torch.tensor(starts, dtype=torch.float64))
        direction, state, _ = agg(torch.stack(rows), n, state, info=info)
        assert bool(torch.isfinite(direction).all())
        w, ostate = opt.step(w, direction, ostate)
        history.append(sum(loss(w, k) for k in range(6)) / 6)
    return history, f_star


@pytest.mark.parametrize(("step", "opt", "lr", "cap"), [
    # the docstring's composition rules: norm-matched takes FedAvgM's step (0.1 at
    # β = 0.9); fixed (unit-length groups) and rprop at τ ≤ 10 a ~10× smaller one, rprop
    # at its default τ ≤ 100 a ~100× smaller one; Adam its own 0.01 whatever the mode
    ("fixed", "momentum", 0.001, None), ("norm_matched", "momentum", 0.1, None),
    ("rprop", "momentum", 0.01, 10.0), ("rprop", "momentum", 0.001, None),
    ("fixed", "adam", 0.01, None), ("norm_matched", "adam", 0.01, None),
    ("rprop", "adam", 0.01, None)])
def test_every_mode_composes_with_momentum_and_adam(step, opt, lr, cap):
    """Finite every round, and the global loss's gap to its minimum at least 20 % smaller
    after 40 rounds (the clients' optima differ: the federated fixed point is not w*)."""
    for targets in ("data", "loss"):
        agg = CRAFT(step=step, targets=targets, **({"step_max": cap} if cap else {}))
        h, f_star = _federated_least_squares(agg, ServerOptimizer(opt, lr=lr))
        assert all(math.isfinite(v) for v in h)
        assert h[-1] - f_star < 0.8 * (h[0] - f_star), (
            f"{step}+{opt}: loss {h[0]:.4g} → {h[-1]:.4g} (minimum {f_star:.4g})")


# ------------------------------------------------------------------- SA-PEF residual α
_NORM = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(0.0),
                  st.floats(1e300, 1e308), st.floats(0, 1e-300))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(pairs=st.lists(st.tuples(_NORM, _NORM), max_size=12),
       alpha=st.floats(0, 1), kappa=st.floats(1e-6, 1e6))
def test_residual_alpha_stays_in_bounds(pairs, alpha, kappa):
    a = residual_alpha([p for p, _ in pairs], [r for _, r in pairs], alpha, kappa)
    assert a is None or 0.0 <= a <= alpha <= 1.0
    usable = [(p, r) for p, r in pairs if p == p and r == r and 0 <= p < math.inf
              and 0 <= r < math.inf and (p, r) != (0.0, 0.0)]
    assert (a is None) == (not usable)


def test_residual_alpha_rule():
    # median of ratios 0.5, 1, 2 is 1: κ = 0.4 → 0.4; κ = 2 → min(0.85, 2) = 0.85
    assert residual_alpha([1, 2, 2], [2, 2, 1], 0.85, 0.4) == pytest.approx(0.4)
    assert residual_alpha([1, 2, 2], [2, 2, 1], 0.85, 2.0) == 0.85
    assert residual_alpha([1.0], [0.0], 0.6, 1.0) == 0.6       # no residual: α_max
    assert residual_alpha([0.0], [3.0], 0.6, 1.0) == 0.0       # no progress: EF
    assert residual_alpha([math.nan], [1.0], 0.6, 1.0) is None  # keep the previous α
    fb = make_feedback("sapef", alpha=0.8, alpha_schedule="residual", alpha_kappa=0.5)
    assert fb.alpha(0.1, 10, {}) == 0.8   # before any estimate: alpha
    assert fb.alpha(0.1, 10, {"alpha_residual": 0.3}) == 0.3
