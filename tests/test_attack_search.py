"""MinMax and MinSum (Shejwalkar & Houmansadr, NDSS 2021): the γ search, golden values
derived by hand beside each, and the properties the attacks promise."""

import pytest
import torch

from fedloom.attack import MinMax, MinSum, RoundView
from fedloom.attack.omniscient import gamma_search


def view(honest: list[list[float]], b: int = 2) -> RoundView:
    h = torch.tensor(honest, dtype=torch.float64)
    own = torch.full((b, h.shape[1]), 7.0, dtype=torch.float64)
    return RoundView(0, 0, tuple(range(100, 100 + b)), own, h, h.shape[0] + b)


H = [[0.0], [1.0], [5.0]]  # μ = 2, sign(μ) = 1; pairwise ‖·‖²: 1, 25, 16; row sums 26, 17, 41


def test_minmax_golden_gamma():
    # max_i (2 − γ − h_i)² = (γ + 3)² ≤ max pairwise 25  ⇒  γ = 2, the row 2 − 2 = 0
    rows = MinMax(direction="sign")(view(H))
    assert rows.shape == (2, 1)
    assert torch.allclose(rows, torch.zeros(2, 1, dtype=torch.float64), atol=5e-5, rtol=0)


def test_minsum_golden_gamma_is_the_public_codes_min():
    # Σ_i (2 − γ − h_i)² = 3γ² + 14 ≤ min_i Σ_j ‖h_i − h_j‖² = 17  ⇒  γ = 1, row 1
    # (the paper's max_i, 41, would give γ = 3)
    rows = MinSum(direction="sign")(view(H))
    assert torch.allclose(rows, torch.ones(2, 1, dtype=torch.float64), atol=5e-5, rtol=0)


def test_unit_vec_and_std_directions():
    # two points (0,0), (2,0): μ = (1,0), unit vector (1,0); MinMax (1+γ)² ≤ 4 ⇒ γ = 1;
    # MinSum (1−γ)² + (1+γ)² ≤ 4 ⇒ γ = 1: both send (0, 0)
    two = [[0.0, 0.0], [2.0, 0.0]]
    for attack in (MinMax(), MinSum()):
        assert torch.allclose(attack(view(two)), torch.zeros(2, 2, dtype=torch.float64),
                              atol=5e-5, rtol=0)
    # std: σ = (√2, 0), MinMax (1 + √2γ)² ≤ 4 ⇒ γ = 1/√2, row (0, 0) again
    assert torch.allclose(MinMax(direction="std")(view(two)),
                          torch.zeros(2, 2, dtype=torch.float64), atol=5e-5, rtol=0)


def test_the_row_stays_within_the_honest_spread():
    """On random rows the chosen γ is feasible and γ + 5·tol is not (the search stops
    within a few tol of the largest γ)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(9, 50, generator=g, dtype=torch.float64) + 0.3
    v = RoundView(1, 2, (1, 2, 3), torch.zeros(3, 50, dtype=torch.float64), h, 12)
    mean = h.mean(0)
    p = mean / mean.norm()
    bound = torch.cdist(h, h).square().max()
    row = MinMax()(v)
    assert torch.equal(row[0], row[1]) and torch.equal(row[0], row[2])  # one computation
    gamma = float((mean - row[0]) @ p)
    assert gamma > 0
    assert (h - row[0]).square().sum(1).max() <= bound
    assert (h - (mean - (gamma + 5e-5) * p)).square().sum(1).max() > bound


def test_gamma_search_edges():
    assert gamma_search(lambda g: False, 10.0, 1e-5) == 0.0   # nothing feasible: μ itself
    assert gamma_search(lambda g: True, 10.0, 1e-5) == pytest.approx(20.0, abs=1e-4)
    assert gamma_search(lambda g: g <= 3.3, 10.0, 1e-9) == pytest.approx(3.3, abs=1e-8)


def test_no_honest_row_uses_the_colluders_and_nan_rows_are_not_seen():
    own = torch.tensor([[0.0], [1.0], [5.0]], dtype=torch.float64)
    v = RoundView(0, 0, (1, 2, 3), own, torch.zeros(0, 1, dtype=torch.float64), 3)
    assert torch.allclose(MinSum(direction="sign")(v), torch.ones(3, 1, dtype=torch.float64),
                          atol=5e-5)
    # knowledge: colluders reads the attackers' own rows even when honest ones exist
    v2 = RoundView(0, 0, (1, 2, 3), own, torch.full((4, 1), 100.0, dtype=torch.float64), 7)
    assert torch.allclose(MinSum(direction="sign", knowledge="colluders")(v2),
                          torch.ones(3, 1, dtype=torch.float64), atol=5e-5)
    # a non-finite own row is left out of the colluders' estimate
    nan = torch.cat([own, torch.full((1, 1), float("nan"), dtype=torch.float64)])
    v3 = RoundView(0, 0, (1, 2, 3, 4), nan, torch.zeros(0, 1, dtype=torch.float64), 4)
    assert torch.allclose(MinSum(direction="sign")(v3), torch.ones(4, 1, dtype=torch.float64),
                          atol=5e-5)


@pytest.mark.parametrize(("kw", "field"), [
    ({"direction": "up"}, "attack.options.direction"),
    ({"gamma_init": 0}, "attack.options.gamma_init"),
    ({"tol": float("nan")}, "attack.options.tol"),
    ({"knowledge": "all"}, "attack.options.knowledge"),
])
def test_bad_options_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        MinMax(**kw)
