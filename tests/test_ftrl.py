"""DP-FTRL (fedloom.ftrl): the banded factor (lower-triangular, b-banded, unit columns,
optimal), the tree's noise (prefix variance popcount(p) ≤ log2 p + 1) and its
sensitivity (brute force over the node matrix), BandMF with one band is DP-FedAvg's
noise bit for bit, the noise state is caught up after a skipped round and resumes bit
for bit, empty and NaN rounds, the accounting and its refusals."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import fedloom
from conftest import TINY, stop_and_resume
from fedloom.accounting import Accountant
from fedloom.config import ConfigError, load_config
from fedloom.engine.inputs import Schedule
from fedloom.ftrl import (
    BandMF,
    Correlated,
    Tree,
    _loss_grad,
    banded_gram,
    column_factor,
    prefix_gram,
    tree_nodes,
    tree_sensitivity2,
)
from fedloom.privacy import make_privacy, resolve_noise

# RDP: the checks here are of the mechanism's formula, not the library (the PLD's speed)
DP = ["privacy.mode=central", "privacy.noise_multiplier=1.0", "privacy.clip=1.0",
      "privacy.accountant=rdp"]


def _cfg(*overrides: str):
    return load_config(copy.deepcopy(TINY), list(overrides))


# ------------------------------------------------------------------ the banded factor
@pytest.mark.parametrize(("n", "b"), [(1, 1), (7, 1), (24, 4), (40, 7)])
def test_the_banded_factor_is_lower_banded_with_unit_columns(n, b):
    """C is lower-triangular with b bands, CᵀC = X, every column of norm 1 (the
    sensitivity of one participation), X's diagonal 1 and zero outside the band."""
    x = banded_gram(n, b)
    c = column_factor(x)
    i, j = np.indices((n, n))
    assert np.all(c[j > i] == 0)
    assert np.all(c[i - j >= b] == 0)
    assert np.all(x[abs(i - j) >= b] == 0) and np.allclose(np.diag(x), 1, atol=0)
    assert np.abs(c.T @ c - x).max() < 1e-12
    assert np.abs(np.linalg.norm(c, axis=0) - 1).max() < 1e-12


def test_the_banded_gram_is_the_optimum():
    """First-order optimality: the free entries of the gradient vanish (< 1e-6), and
    every feasible perturbation of X (symmetric, in the band, diagonal kept) raises
    the loss; more bands never lose (b = 1 is DP-FedAvg's I)."""
    n, b = 20, 4
    m = prefix_gram(n)
    x = banded_gram(n, b)
    loss, grad = _loss_grad(x, m)
    i, j = np.indices((n, n))
    free = (abs(i - j) < b) & (i != j)
    assert np.abs(grad[free]).max() < 1e-6
    rng = np.random.default_rng(0)
    for _ in range(20):
        e = rng.normal(size=(n, n)) * free
        e = (e + e.T) * 1e-3
        assert _loss_grad(x + e, m)[0] > loss
    losses = [_loss_grad(banded_gram(n, k), m)[0] for k in (1, 2, 4, 8)]
    assert losses[0] == pytest.approx(np.trace(m)) and all(np.diff(losses) < 0)


def test_the_online_inverse_is_c_inverse_and_needs_b_minus_1_rows():
    """``BandMF.step`` fed z_0..z_{n-1} with the last b−1 outputs gives C⁻¹z."""
    n, b, d = 30, 5, 3
    band = BandMF(n, b)
    z = torch.randn(n, d, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    past = torch.zeros(0, d, dtype=torch.float64)
    out = []
    for t in range(n):
        w = band.step(t, z[t], past)
        out.append(w)
        past = torch.cat([past, w[None]])[-(b - 1):]
    want = np.linalg.solve(band.c, z.numpy())
    assert np.abs(torch.stack(out).numpy() - want).max() < 1e-10
    with pytest.raises(ValueError, match="built for 30 rounds"):
        band.step(n, z[0], past)


def test_bad_arguments_are_one_line():
    with pytest.raises(ValueError, match="n: must be"):
        banded_gram(0, 1)
    with pytest.raises(ValueError, match="bands: must be"):
        banded_gram(5, 0)


# ------------------------------------------------------------------ the tree
def test_tree_nodes_decompose_the_prefix():
    for p in range(1, 70):
        nodes = tree_nodes(p)
        assert len(nodes) == bin(p).count("1")
        starts = [end - (1 << lev) + 1 for lev, end in nodes]
        assert starts[0] == 1 and nodes[-1][1] == p
        assert all(s == e + 1 for s, (_, e) in zip(starts[1:], nodes, strict=False))


def test_tree_prefix_noise_variance_grows_as_log2():
    """The noise on the prefix sum after p rounds, the sum of the released increments
    (n_p: telescoping), has variance popcount(p) per coordinate (≤ ⌊log₂ p⌋ + 1),
    where DP-FedAvg's independent noise sums to variance p: within 6 % on 20,000
    coordinates (the sample variance's sd there is 1 %)."""
    d, tree = 20_000, Tree(seed=0, restart=None)
    total = torch.zeros(d, dtype=torch.float64)
    prev = torch.zeros(d, dtype=torch.float64)
    for p in range(1, 65):
        cur = tree.prefix(0, p, d)
        total += cur - prev
        prev = cur
        if p in (1, 3, 7, 15, 31, 63, 64):
            var = float(total.var())
            assert var == pytest.approx(bin(p).count("1"), rel=0.06), p
            assert var <= (math.log2(p) + 1) * 1.06
    assert float(total.var()) == pytest.approx(1.0, rel=0.06)  # p = 64: one node


def _node_matrix(rounds: int, restart: int | None) -> np.ndarray:
    """Rows: the released nodes (0/1 over the rounds they sum), for brute force."""
    seg = restart or rounds
    rows = []
    for s0 in range(0, rounds, seg):
        done = min(seg, rounds - s0)
        for lev in range(done.bit_length()):
            for end in range(1 << lev, done + 1, 1 << lev):
                row = np.zeros(rounds)
                row[s0 + end - (1 << lev):s0 + end] = 1
                rows.append(row)
    return np.array(rows)


@pytest.mark.parametrize(("rounds", "groups", "restart"),
                         [(1, 1, None), (16, 1000, None), (13, 1, None), (20, 3, None),
                          (32, 4, 8), (27, 5, 10)])
def test_tree_sensitivity_is_the_node_matrix_s(rounds, groups, restart):
    """``tree_sensitivity2`` is max over groups of ‖Σ_{r in the group} column r‖² of the
    released nodes' matrix (brute force); one participation costs ⌊log₂ T⌋ + 1."""
    a = _node_matrix(rounds, restart)
    want = max(float(np.sum(a[:, g::groups].sum(axis=1) ** 2))
               for g in range(min(groups, rounds)))
    assert tree_sensitivity2(rounds, groups, restart) == want
    if groups >= rounds and restart is None:
        assert want == math.floor(math.log2(rounds)) + 1


# ------------------------------------------------------------------ the noise state
@pytest.mark.parametrize("kind", ["tree", "bandmf"])
def test_a_stale_state_is_caught_up(kind):
    """Round 5's noise from the state after round 2 (rounds 3, 4 kept the old state, as
    a skipped step does) is the noise from the state after round 4."""
    mech = Correlated(kind, rounds=12, seed=4, groups=3, restart=4 if kind == "tree" else None)
    d = 6

    def draw(t):
        return torch.randn(d, generator=torch.Generator().manual_seed(100 + t),
                           dtype=torch.float64)

    state = mech.init()
    states = []
    for r in range(6):
        w, new = mech.noise(state, r, d, draw)
        state = {**state, **new}
        states.append((w, state))
    stale = states[2][1]
    w5, _ = mech.noise(stale, 5, d, draw)
    assert torch.equal(w5, states[5][0])
    mech.check(state)
    with pytest.raises(ValueError, match="past round"):
        mech.noise(state, 2, d, draw)
    with pytest.raises(ValueError, match="ftrl_noise"):
        mech.check({**state, "ftrl_noise": torch.full((1, d), math.nan, dtype=torch.float64)})


def test_bandmf_with_one_band_is_dp_fedavgs_noise():
    """bands = groups = 1: C = I, so every round's noise is DP-FedAvg's draw and the
    model is the same bits (the accounting differs: no amplification is claimed)."""
    a = fedloom.run(copy.deepcopy(TINY), [*DP, "rounds=3"])
    b = fedloom.run(copy.deepcopy(TINY), [*DP, "rounds=3", "privacy.mechanism=bandmf"])
    assert a.summary["model_sha256"] == b.summary["model_sha256"]
    assert b.summary["dp_epsilon"] == pytest.approx(
        Accountant("rdp").epsilon(1.0, 1.0, 3, 1e-5))


@pytest.mark.parametrize("extra", [
    ["privacy.mechanism=bandmf", "privacy.ftrl.groups=2", "cohort.sampling=poisson",
     "cohort.rate=0.5", "server.optimizer=momentum"],
    ["privacy.mechanism=tree", "privacy.ftrl.restart_every=2", "privacy.ftrl.groups=2"],
], ids=["bandmf", "tree"])
def test_resume_is_bit_identical(extra, tmp_path):
    """Stopped after round 2 and resumed: the noise state (in the checkpoint) gives the
    uninterrupted run's model."""
    ref, res = stop_and_resume(copy.deepcopy(TINY), [*DP, "rounds=4", *extra],
                               tmp_path / "run")
    assert ref.summary["model_sha256"] == res.summary["model_sha256"]
    assert ref.summary["dp_epsilon"] == res.summary["dp_epsilon"]


def test_groups_restrict_each_rounds_cohort():
    """Round r's cohort is drawn from the clients k = r (mod groups) only, fixed-size
    and Poisson (there at the rate within the group)."""
    for rate in (None, 0.5):
        sched = Schedule(0, 12, 2, 20, client=None, rate=rate, groups=3)
        seen = set()
        for r in range(12):
            ids = sched.sample_cohort(r).tolist()
            assert all(k % 3 == r % 3 for k in ids)
            assert rate is not None or len(ids) == 2
            seen.update(ids)
        assert len(seen) > 6


# ------------------------------------------------------------------ empty and NaN rounds
def test_an_empty_or_rejected_round_still_releases_the_correlated_noise():
    """No accepted row (a NaN update is rejected): Δ = σC·w_r / m̄ and the state moves
    on, as with rows; the rejected row adds nothing."""
    cfg = _cfg(*DP, "rounds=4", "privacy.mechanism=bandmf", "privacy.ftrl.groups=2")
    priv = make_privacy(cfg, 10)
    d = 5
    rows = torch.full((2, d), math.nan, dtype=torch.float64)
    ok = torch.zeros(2, dtype=torch.bool)
    state = priv.init()
    agg, new, _ = priv.aggregate(rows.clone(), ok, state, 0)
    w, _ = priv.correlated.noise(state, 0, d, lambda t: _draw(cfg.seed, d, t))
    assert torch.equal(agg, (w / priv.cohort_size).to(agg.dtype))
    assert new["ftrl_round"] == 1 and torch.isfinite(agg).all()


def _draw(seed, d, t):
    from fedloom.rng import Purpose, torch_gen
    return torch.randn(d, generator=torch_gen(seed, t, -1, Purpose.DP_NOISE),
                       dtype=torch.float64)


# ------------------------------------------------------------------ accounting
def test_the_accounting():
    """bandmf under Poisson: k = ⌈T/groups⌉ Poisson-sampled Gaussians at the group's
    rate; without: one Gaussian of multiplier z/√k; the tree: z/√s."""
    pois = make_privacy(_cfg(*DP, "rounds=10", "privacy.mechanism=bandmf",
                             "privacy.ftrl.groups=3", "cohort.sampling=poisson",
                             "cohort.rate=0.2"), 12)
    assert pois.planned_epsilon(10) == pytest.approx(
        Accountant("rdp").epsilon(0.2, 1.0, 4, 1e-5))
    fixed = make_privacy(_cfg(*DP, "rounds=10", "privacy.mechanism=bandmf",
                              "privacy.ftrl.groups=3"), 12)
    assert fixed.planned_epsilon(10) == pytest.approx(
        Accountant("rdp").epsilon(1.0, 1.0 / 2, 1, 1e-5))
    tree = make_privacy(_cfg(*DP, "rounds=10", "privacy.mechanism=tree",
                             "privacy.ftrl.groups=3"), 12)
    s = tree_sensitivity2(10, 3, None)
    assert tree.planned_epsilon(10) == pytest.approx(
        Accountant("rdp").epsilon(1.0, 1.0 / math.sqrt(s), 1, 1e-5))
    assert tree.record()["mechanism"] == "tree"


@pytest.mark.parametrize("mech", ["tree", "bandmf"])
def test_noise_auto_meets_the_target(mech):
    cfg = resolve_noise(_cfg("privacy.mode=central", "privacy.noise_multiplier=auto",
                             "privacy.target_epsilon=2.0", "rounds=12", "privacy.accountant=rdp",
                             f"privacy.mechanism={mech}", "privacy.ftrl.groups=4",
                             "cohort.size=2"))
    priv = make_privacy(cfg, 10)
    eps = priv.planned_epsilon(12)
    assert eps <= 2.0 and eps == pytest.approx(2.0, rel=5e-3)


@pytest.mark.parametrize(("extra", "field"), [
    (["privacy.mode=local", "privacy.mechanism=tree"], "privacy.mechanism"),
    (["privacy.mechanism=bandmf", "privacy.adaptive_clip.enabled=true"],
     "privacy.adaptive_clip.enabled"),
    (["privacy.mechanism=tree", "privacy.neighbours=replace_one"], "privacy.neighbours"),
    (["privacy.mechanism=tree", "server.secure_aggregation=true"],
     "server.secure_aggregation"),
    (["privacy.ftrl.groups=2"], "privacy.ftrl.groups"),
    (["privacy.mechanism=bandmf", "privacy.ftrl.groups=2", "privacy.ftrl.bands=3"],
     "privacy.ftrl.bands"),
    (["privacy.mechanism=bandmf", "privacy.ftrl.groups=11"], "privacy.ftrl.groups"),
    (["privacy.mechanism=bandmf", "privacy.ftrl.groups=2", "cohort.sampling=poisson"],
     "cohort.rate"),
    (["privacy.mechanism=tree", "privacy.ftrl.bands=2"], "privacy.ftrl.bands"),
    (["privacy.mechanism=bandmf", "privacy.ftrl.restart_every=2"],
     "privacy.ftrl.restart_every"),
    (["privacy.mechanism=tree", "privacy.accounting_cohort=100"],
     "privacy.accounting_cohort"),
    (["privacy.mechanism=tree", "privacy.ftrl.groups=3"], "cohort.size"),
])
def test_refusals_are_one_line(extra, field):
    mode = [] if any(e.startswith("privacy.mode") for e in extra) else ["privacy.mode=central"]
    with pytest.raises(ConfigError) as e:
        make_privacy(_cfg(*mode, *extra), 10)
    assert str(e.value).startswith(field) and "\n" not in str(e.value)
