"""FedFV, FedLF and AFL against independent NumPy re-derivations of their public rules.

Each reference below is written from the paper's algorithm and the behaviour of
the authors' public code (FedFV and AFL: github.com/WwZzz/easyFL; FedLF:
github.com/zibinpan/FedLF), in plain NumPy float64, with none of fedloom's
Gram-matrix tricks: FedFV projects explicit vectors, FedLF's min-norm point is
found exactly by enumerating active sets.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from fedloom import CohortInfo, Layout, make_aggregator
from fedloom.aggregate.fedfv import kept_count
from fedloom.aggregate.fedlf import min_norm_point as fedloom_min_norm_point


def _info(ids, losses, round_=0, num_clients=None, lr=None):
    ids = torch.as_tensor(ids, dtype=torch.int64)
    return CohortInfo(clients=ids, round=round_,
                      num_clients=num_clients or int(ids.max()) + 1,
                      start_losses=torch.as_tensor(losses, dtype=torch.float64), lr=lr)


# --------------------------------------------------------------------------- FedFV
def ref_fedfv(rounds, alpha, tau):
    """FedFV, public rule, over a sequence of rounds ``(client ids, G [m, d], losses)``.

    Returns the server step ``g_t`` of every round (rounds numbered from 1).
    """
    latest = {}  # client → (round it last sent, its update)
    steps = []
    for t, (ids, G, losses) in enumerate(rounds, start=1):
        for cid, g in zip(ids, G, strict=True):
            latest[int(cid)] = (t, g)
        m = len(G)
        asc = sorted(range(m), key=lambda k: losses[k])  # Python's sort is stable
        first_kept = math.ceil((m - 1) * (1 - alpha)) if alpha > 0 else m
        kept = set(asc[first_kept:])
        projected = []
        for i in range(m):
            gi = G[i].copy()
            if i not in kept:
                for j in asc:
                    if j != i and G[j] @ gi < 0:
                        gi = gi - (G[j] @ gi) / (G[j] @ G[j]) * G[j]
            projected.append(gi)
        g = np.mean(projected, axis=0)
        if t >= tau:
            for k in range(tau - 1, -1, -1):
                conflicting = [v for _, (s, v) in sorted(latest.items())
                               if s == t - k and g @ v < 0]
                if conflicting:
                    gc = np.sum(conflicting, axis=0)
                    if g @ gc < 0:
                        g = g - (g @ gc) / (gc @ gc) * gc
        steps.append(g / np.linalg.norm(g) * np.linalg.norm(G.mean(axis=0)))
    return steps


def _fedloom_rounds(agg, rounds, d):
    state = agg.init(Layout.flat(d))
    out = []
    for r, (ids, G, losses) in enumerate(rounds):
        g, state, _ = agg(torch.from_numpy(G), torch.ones(len(G)), state,
                          info=_info(ids, losses, round_=r, num_clients=30))
        out.append(g.numpy())
    return out


def _random_rounds(rng, m, d, n_rounds, population=30):
    rounds = []
    for _ in range(n_rounds):
        ids = rng.choice(population, size=m, replace=False)
        # a shared direction plus client noise: some pairs conflict, most do not
        G = 0.3 * rng.standard_normal(d) + rng.standard_normal((m, d))
        rounds.append((ids, G, rng.uniform(0.1, 3.0, size=m)))
    return rounds


def test_fedfv_kept_count_is_the_public_expression():
    # m − ⌈(m − 1)(1 − α)⌉; at α = 0.3: m = 4 → 4 − ⌈2.1⌉ = 1, m = 7 → 7 − ⌈4.2⌉ = 2,
    # m = 14 → 14 − ⌈9.1⌉ = 4 (⌈αm⌉ would give 2, 3, 5)
    assert [kept_count(m, 0.3) for m in (4, 7, 14)] == [1, 2, 4]
    assert kept_count(10, 0.0) == 0 and kept_count(10, 1.0) == 10 and kept_count(1, 0.5) == 1


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.3, 0.5, 1.0])
def test_fedfv_equals_public_rule_round_one(alpha):
    rng = np.random.default_rng(0)
    for m in (2, 3, 4, 5, 7, 14):
        for tau in (0, 1):
            rounds = _random_rounds(rng, m, 12, 1)
            agg = make_aggregator("fedfv", alpha=alpha, tau=tau)
            got = _fedloom_rounds(agg, rounds, 12)
            want = ref_fedfv(rounds, alpha, tau)
            assert np.abs(got[0] - want[0]).max() < 1e-6, (m, tau)


@pytest.mark.parametrize("tau", [2, 3])
def test_fedfv_equals_public_rule_with_history(tau):
    # Five rounds of 7 clients out of 12: clients recur, so the "latest round only"
    # bookkeeping matters; rounds t < τ skip the external step, as the public code.
    rng = np.random.default_rng(tau)
    for alpha in (0.0, 0.3):
        rounds = _random_rounds(rng, 7, 10, 5, population=12)
        agg = make_aggregator("fedfv", alpha=alpha, tau=tau)
        got = _fedloom_rounds(agg, rounds, 10)
        want = ref_fedfv(rounds, alpha, tau)
        for t, (a, b) in enumerate(zip(got, want, strict=True)):
            assert np.abs(a - b).max() < 1e-6, (alpha, t)
        # history size: at most the clients of the last τ − 1 rounds
        state = agg.init(Layout.flat(10))
        for r, (ids, G, losses) in enumerate(rounds):
            _, state, _ = agg(torch.from_numpy(G), torch.ones(7), state,
                              info=_info(ids, losses, round_=r, num_clients=12))
            assert state["rows"].shape[0] <= (tau - 1) * 7
            assert len(set(state["clients"].tolist())) == state["rows"].shape[0]


def test_fedfv_external_step_uses_the_current_clients():
    # τ = 1, α = 1 (every client keeps its update): rows g1 = [1, 0], g2 = [0, 1],
    # g3 = [-1, -0.2]; mean = [0, 0.8/3]; ⟨mean, g_k⟩ = [0, 0.27, -0.053]: only g3 conflicts,
    # g ← mean − ⟨mean, g3⟩/‖g3‖² g3, then rescaled to ‖mean‖. The former rule had no
    # history at round 1 and returned the mean itself.
    G = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, -0.2]])
    rounds = [(np.arange(3), G, np.array([1.0, 2.0, 3.0]))]
    got = _fedloom_rounds(make_aggregator("fedfv", alpha=1.0, tau=1), rounds, 2)[0]
    mean = G.mean(0)
    g = mean - (mean @ G[2]) / (G[2] @ G[2]) * G[2]
    g = g / np.linalg.norm(g) * np.linalg.norm(mean)
    assert np.abs(got - g).max() < 1e-12
    assert got @ G[2] >= -1e-12  # the conflict with client 3 is gone


def test_fedfv_rejects_bad_tau():
    with pytest.raises(ValueError, match=r"aggregator\.options\.tau"):
        make_aggregator("fedfv", tau=-1)
    with pytest.raises(ValueError, match=r"aggregator\.options\.tau"):
        make_aggregator("fedfv", tau=1.5)


# --------------------------------------------------------------------------- FedLF
def min_norm_point(P):
    """``argmin_{λ∈Δ} λᵀPλ`` exactly, by enumerating the active set (small P only).

    For each support S, the KKT system ``[P_S 1; 1ᵀ 0][λ; ν] = [0; 1]`` (least squares
    when singular) gives a candidate; the optimum is a feasible one with
    ``(Pλ)_j ≥ λᵀPλ`` for every j. Returns the candidate of least objective among those.
    """
    n = P.shape[0]
    best, best_val = None, np.inf
    for k in range(1, n + 1):
        for S in itertools.combinations(range(n), k):
            S = list(S)
            A = np.zeros((k + 1, k + 1))
            A[:k, :k] = P[np.ix_(S, S)]
            A[:k, k] = A[k, :k] = 1.0
            rhs = np.zeros(k + 1)
            rhs[k] = 1.0
            sol = np.linalg.lstsq(A, rhs, rcond=None)[0]
            lam = np.zeros(n)
            lam[S] = sol[:k]
            if lam.min() < -1e-12 or abs(lam.sum() - 1) > 1e-9:
                continue
            lam = np.clip(lam, 0, None)
            lam /= lam.sum()
            val = lam @ P @ lam
            if (P @ lam).min() >= val - 1e-9 * max(1.0, P.diagonal().max()) and val < best_val:
                best, best_val = lam, val
    assert best is not None
    return best


def test_min_norm_point_is_exact_on_hard_gram_matrices():
    # Rank-deficient (more rows than columns), norms spread over 1e-3 … 1e3, a shared
    # offset (the hull far from 0), nearly duplicated rows: the solver's point λᵀQ equals
    # the exhaustive search's to 1e-9 relative to the largest row, and λ is in the simplex.
    rng = np.random.default_rng(1)
    for trial in range(80):
        n, d = int(rng.integers(2, 7)), int(rng.integers(1, 8))
        Q = rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-3, 3, (n, 1))
        if trial % 3 == 0:
            Q += 3 * rng.standard_normal(d)
        if trial % 5 == 0:
            Q[1] = Q[0] * (1 + 1e-9)
        P = Q @ Q.T
        lam = fedloom_min_norm_point(torch.from_numpy(P)).numpy()
        assert lam.min() >= 0 and abs(lam.sum() - 1) < 1e-12
        err = np.abs((lam - min_norm_point(P)) @ Q).max()
        assert err <= 1e-9 * np.sqrt(P.diagonal().max()), trial


def ref_fedlf(U, losses, spans, equal_sign=None):
    """FedLF's direction, public rule; ``equal_sign=+1`` replays the public code's
    float32 rounding case ``h = δ·1, δ > 0`` (equal losses)."""
    m = len(U)
    p = np.full(m, 1 / np.sqrt(m))
    ln = np.linalg.norm(losses)
    h = ((losses @ p) * losses / ln - p * ln) / ln**2
    if equal_sign is not None:
        h = equal_sign * np.ones(m)
    d = []
    for a, b in spans:
        R = U[:, a:b]
        norms = np.linalg.norm(R, axis=1)
        mu = norms.mean()
        Q = R / norms[:, None] * mu
        f = h @ Q
        Q = np.vstack([Q, f / np.linalg.norm(f) * mu])
        d.append(min_norm_point(Q @ Q.T) @ Q)
    d = np.concatenate(d)
    return d / np.linalg.norm(d) * np.linalg.norm(U.mean(axis=0))


# a two-layer model's tensors: weight [3, 4], bias [3], weight [2, 3], bias [2]
_SPECS = [("a.weight", (3, 4)), ("a.bias", (3,)), ("b.weight", (2, 3)), ("b.bias", (2,))]
_LAYOUT = Layout(_SPECS, [["a.weight", "a.bias"], ["b.weight", "b.bias"]])
_TENSORS = [(0, 12), (12, 15), (15, 21), (21, 23)]
_LAYERS = [(0, 15), (15, 23)]


def _fedlf(U, losses, **opts):
    agg = make_aggregator("fedlf", **opts)
    out, _, _ = agg(torch.from_numpy(U), torch.ones(len(U)), agg.init(_LAYOUT),
                    info=_info(np.arange(len(U)), losses))
    return out.numpy()


@pytest.mark.parametrize("m", [2, 3, 4, 5])
def test_fedlf_default_is_per_tensor_public_rule(m):
    rng = np.random.default_rng(m)
    for _ in range(5):
        U = 0.5 * rng.standard_normal(23) + rng.standard_normal((m, 23))
        losses = rng.uniform(0.2, 2.5, size=m)
        want = ref_fedlf(U, losses, _TENSORS)
        assert np.abs(_fedlf(U, losses) - want).max() < 1e-6
        assert np.abs(_fedlf(U, losses, groups="tensor") - want).max() < 1e-6
        # the per-layer option is the same rule on the layer groups
        want_layer = ref_fedlf(U, losses, _LAYERS)
        assert np.abs(_fedlf(U, losses, groups="layer") - want_layer).max() < 1e-6


def test_fedlf_equal_losses_match_the_public_code_case_that_is_defined():
    # Equal losses: the public h is δ·1 with δ float32 noise; δ > 0 appends the row
    # μ(1ᵀQ)/‖1ᵀQ‖, which leaves the min-norm point where it is. fedloom must give that
    # result (finite), with either grouping.
    rng = np.random.default_rng(11)
    for m in (2, 3, 4):
        U = rng.standard_normal((m, 23))
        losses = np.full(m, 0.7)
        got = _fedlf(U, losses)
        assert np.isfinite(got).all()
        assert np.abs(got - ref_fedlf(U, losses, _TENSORS, equal_sign=1.0)).max() < 1e-6
        got_l = _fedlf(U, losses, groups="layer")
        assert np.abs(got_l - ref_fedlf(U, losses, _LAYERS, equal_sign=1.0)).max() < 1e-6


def test_fedlf_every_client_agrees_with_the_direction_in_every_tensor():
    # The min-norm point d_q satisfies ⟨Q_i^q, d_q⟩ ≥ ‖d_q‖² ≥ 0, so no client conflicts with
    # any group of the direction (the property the public code's final guard checks).
    rng = np.random.default_rng(5)
    U = rng.standard_normal((5, 23))
    losses = rng.uniform(0.2, 2.5, size=5)
    d = _fedlf(U, losses)
    for a, b in _TENSORS:
        assert (U[:, a:b] @ d[a:b]).min() > -1e-9


def test_fedlf_rejects_unknown_grouping():
    with pytest.raises(ValueError, match=r"aggregator\.options\.groups"):
        make_aggregator("fedlf", groups="module")


# --------------------------------------------------------------------------- AFL
def _simplex(v):
    """Euclidean projection onto the simplex: shift by θ chosen so the clipped sum is 1."""
    u = np.sort(v)[::-1]
    k = max(j for j in range(1, len(v) + 1) if u[j - 1] + (1 - u[:j].sum()) / j > 0)
    return np.maximum(v + (1 - u[:k].sum()) / k, 0)


def ref_afl(w0, updates_per_round, losses_per_round, lr, gamma_lambda=0.01):
    """The public AFL server: ĝ_k = (w − w_k)/η, w ← w − η Σ λ_k ĝ_k, λ ← Π(λ + γ_λ F)."""
    N = len(losses_per_round[0])
    lam, w, ws, lams = np.full(N, 1 / N), w0.copy(), [], []
    for U, F in zip(updates_per_round, losses_per_round, strict=True):
        grads = U / lr
        w = w - lr * (lam @ grads)
        lam = _simplex(lam + gamma_lambda * F)
        ws.append(w.copy())
        lams.append(lam.copy())
    return ws, lams


def test_afl_defaults_take_the_public_steps():
    # Two rounds, N = 4, η_l = 0.05: with the default options and server.lr = 1 the model
    # and λ follow the public server exactly.
    rng = np.random.default_rng(3)
    N, d, lr = 4, 6, 0.05
    w0 = rng.standard_normal(d)
    ups = [lr * rng.standard_normal((N, d)) for _ in range(2)]
    losses = [rng.uniform(0.5, 2.5, N) for _ in range(2)]
    want_w, want_lam = ref_afl(w0, ups, losses, lr)
    agg = make_aggregator("afl")
    lam, w = agg.init(Layout.flat(d)), torch.from_numpy(w0)
    for r in range(2):
        direction, lam, _ = agg(torch.from_numpy(ups[r]), torch.ones(N), lam,
                                info=_info(np.arange(N), losses[r], round_=r, lr=lr))
        w = w - 1.0 * direction  # the engine's default server step, server.lr = 1
        assert np.abs(w.numpy() - want_w[r]).max() < 1e-12
        assert np.abs(lam.numpy() - want_lam[r]).max() < 1e-12


def test_afl_lambda_moves_by_the_public_step():
    # From uniform λ, losses inside the simplex's interior move λ by γ_λ (F − mean F)
    # with γ_λ = 0.01: F = [1, 2, 3] → λ = 1/3 + 0.01·[-1, 0, 1]. (The former default
    # γ_λ = 0.1 moved it ten times as far.)
    agg = make_aggregator("afl")
    _, lam, _ = agg(torch.eye(3, dtype=torch.float64), torch.ones(3), None,
                    info=_info([0, 1, 2], [1.0, 2.0, 3.0], lr=0.1))
    want = torch.tensor([1 / 3 - 0.01, 1 / 3, 1 / 3 + 0.01], dtype=torch.float64)
    assert torch.allclose(lam, want, atol=1e-15, rtol=0)


def test_fedfv_history_survives_a_checkpoint(tmp_path):
    # τ = 3 keeps the previous rounds' client updates as state; the engine's checkpoint is
    # torch.save of it. Saving after round 2 and loading must continue exactly.
    rng = np.random.default_rng(9)
    rounds = _random_rounds(rng, 5, 8, 4, population=8)
    agg = make_aggregator("fedfv", alpha=0.3, tau=3)
    want = _fedloom_rounds(agg, rounds, 8)
    state = agg.init(Layout.flat(8))
    for r in range(4):
        if r == 2:
            torch.save({"agg_state": state}, tmp_path / "ck.pt")
            state = torch.load(tmp_path / "ck.pt", weights_only=False)["agg_state"]
        ids, G, losses = rounds[r]
        g, state, _ = agg(torch.from_numpy(G), torch.ones(5), state,
                          info=_info(ids, losses, round_=r, num_clients=8))
        assert np.array_equal(g.numpy(), want[r])
