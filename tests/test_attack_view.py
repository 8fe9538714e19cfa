"""The attack stage on hand-made rounds: what reaches the attack, NaN and duplicate
rows, one honest row, a plug-in that returns the wrong shape, the dtype kept."""

import numpy as np
import pytest
import torch

from fedloom.attack import ALIE, IPM, Attack, MinMax, RoundView, SignFlip
from fedloom.job import ClientResult


def _round(rows: list[list[float]], dtype: torch.dtype = torch.float32) -> list[ClientResult]:
    return [ClientResult(k, torch.tensor(r, dtype=dtype), 10, 0.0, 1)
            for k, r in enumerate(rows)]


def test_an_honest_nan_row_is_not_seen_and_attackers_share_one_row():
    res = _round([[1.0, 2.0], [float("nan"), 0.0], [3.0, 4.0], [9.0, 9.0], [7.0, 7.0]])
    Attack(frozenset({3, 4}), IPM(epsilon=1.0), seed=0).round(res, 0)
    # honest, finite: rows 0 and 2, mean (2, 3); the NaN row is screened by the server
    assert res[3].update.tolist() == [-2.0, -3.0] == res[4].update.tolist()
    assert res[0].update.tolist() == [1.0, 2.0] and res[1].update[0].isnan()
    assert res[3].update.dtype == torch.float32


def test_what_the_attack_is_shown():
    seen: list[RoundView] = []

    class Spy:
        sees = "own"

        def __call__(self, view: RoundView) -> torch.Tensor:
            seen.append(view)
            return view.own

    res = _round([[1.0], [2.0], [3.0]], torch.float64)
    Attack(frozenset({2, 0}), Spy(), seed=5).round(res, 7)
    (v,) = seen
    assert v.clients == (0, 2) and v.round == 7 and v.seed == 5 and v.cohort == 3
    assert v.own.tolist() == [[1.0], [3.0]] and v.honest.shape == (0, 1)  # sees own only
    assert [r.update.item() for r in res] == [1.0, 2.0, 3.0]


def test_no_attacker_in_the_round_calls_nothing():
    class Boom:
        sees = "honest"

        def __call__(self, view: RoundView) -> torch.Tensor:
            raise AssertionError("called")

    res = _round([[1.0], [2.0]])
    Attack(frozenset({5}), Boom()).round(res, 0)
    assert [r.update.item() for r in res] == [1.0, 2.0]


def test_duplicate_honest_rows_leave_minmax_no_room():
    """Every honest row the same: the largest pairwise distance is 0, so γ = 0 and the
    attackers send μ itself (exactly: the distances are taken from differences)."""
    res = _round([[0.3, -1.7]] * 4 + [[5.0, 5.0]], torch.float64)
    Attack(frozenset({4}), MinMax(direction="sign")).round(res, 0)
    assert res[4].update.tolist() == [0.3, -1.7]


def test_alie_on_one_honest_row_sends_it():
    res = _round([[0.5, 0.25], [8.0, 8.0]], torch.float64)
    Attack(frozenset({1}), ALIE(z=3.0)).round(res, 0)
    assert res[1].update.tolist() == [0.5, 0.25]  # σ = 0 with one row


def test_a_round_of_attackers_only_uses_their_own_updates():
    res = _round([[1.0, 1.0], [3.0, 5.0]], torch.float64)
    Attack(frozenset({0, 1}), SignFlip(reference="honest_mean")).round(res, 0)
    assert res[0].update.tolist() == [-2.0, -3.0] == res[1].update.tolist()


def test_a_wrong_shape_or_not_an_attack_is_one_line():
    class Short:
        sees = "own"

        def __call__(self, view: RoundView) -> torch.Tensor:
            return view.own[:1]

    with pytest.raises(ValueError, match=r"^attack: Short gave rows of shape \(1, 1\), "
                                         r"expected \(2, 1\)$"):
        Attack(frozenset({0, 1}), Short()).round(_round([[1.0], [2.0]]), 0)
    with pytest.raises(ValueError, match=r"^attack: int is not an attack"):
        Attack(frozenset({0}), 3)  # type: ignore[arg-type]


def test_the_backdoor_trigger_and_labels():
    """A 2 × 2 checkerboard of (high, low) in the top-left corner of every channel; a
    flat sample takes it in its first 4 features; the chosen fraction of each attacker's
    samples carries it with the target label, the rest and the others are untouched."""
    from fedloom.attack.data import Backdoor, stamp

    img = torch.zeros(1, 2, 3, 3)
    out = stamp(img, 2, 9.0, -1.0)
    assert out[0, :, :2, :2].tolist() == [[[9.0, -1.0], [-1.0, 9.0]]] * 2
    assert not out[0, :, 2:, :].any() and not out[0, :, :, 2:].any() and not img.any()
    assert stamp(torch.zeros(1, 5), 2, 9.0, -1.0).tolist() == [[9.0, -1.0, -1.0, 9.0, 0.0]]
    x, y = torch.rand(20, 1, 4, 4), torch.arange(20) % 3
    parts = {0: np.arange(10)}
    bd = Backdoor(target=2, fraction=0.5, size=2)
    px, py = bd.poison(x, y, parts, 3, seed=1)
    pattern = stamp(x[:1], 2, float(x.max()), float(x.min()))[0, :, :2, :2]
    marked = [i for i in range(20) if torch.equal(px[i, :, :2, :2], pattern)]
    assert len(marked) == 5 and all(i < 10 for i in marked)  # half of client 0's ten
    assert all(int(py[i]) == 2 for i in marked)
    rest = [i for i in range(20) if i not in marked]
    assert torch.equal(px[rest], x[rest]) and torch.equal(py[rest], y[rest])
    (xs, ys), = bd.test_sets(x, y).values()
    assert xs.shape[0] == int((y != 2).sum()) and bool((ys == 2).all())
    assert float(xs[0, 0, 0, 0]) == float(x.max()) and float(xs[0, 0, 0, 1]) == float(x.min())


@pytest.mark.parametrize("name", ["sign_flip", "gaussian", "alie", "minmax", "optimal_ipm",
                                  "mimic", "canary", "scaling", "inf"])
def test_every_attack_returns_rows_on_the_updates_device_and_dtype(name, device):
    """The stage puts each row back on its update's device and dtype (CUDA where there
    is one: the noise and the canaries' directions are drawn on the CPU)."""
    from fedloom.registry import build

    attack = build("attack", name, {}, "attack.options")
    rows = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) + 0.1
    res = [ClientResult(k, rows[k].to(device), 10, 0.0, 1) for k in range(6)]
    Attack(frozenset({1, 4}), attack, seed=2).round(res, 3)
    for r in res:
        assert r.update.device.type == device and r.update.dtype == torch.float32
    assert torch.equal(res[0].update.cpu(), rows[0])  # honest rows untouched
