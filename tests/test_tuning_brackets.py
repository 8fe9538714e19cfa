"""Hyperband's brackets over a grid's trials (fedloom.tuning.hyperband_brackets, the
halving sampler's ``brackets: true``): the plan against Li et al.'s Table 1, and a
sweep on the fake runs of tests/test_tuning_halving.py, where a bracket that never
stops keeps the slow starter that one bracket of successive halving drops."""

import pytest

from fedloom.config import ConfigError
from fedloom.tuning import (
    Trial,
    halving_choice,
    halving_rungs,
    hyperband_brackets,
    load_protocol,
    plan_rounds,
)
from test_tuning_halving import LATE, _acc, _suite, _tune


def test_the_brackets_are_li_et_al_table_1():
    # Li et al. (JMLR 2018), Table 1: R = 81, η = 3 (r_min = 1, so s_max = 4); bracket s
    # starts n_s = ⌈5/(s+1) · 3^s⌉ = 81, 34, 15, 8, 5 trials at r_s = 81/3^s rounds
    b = hyperband_brackets(81 + 34 + 15 + 8 + 5, 81, 1, 3)
    assert [(len(idx), rungs) for idx, rungs in b] == [
        (81, [(1, 81), (3, 27), (9, 9), (27, 3), (81, 1)]),
        (34, [(3, 34), (9, 11), (27, 3), (81, 1)]),
        (15, [(9, 15), (27, 5), (81, 1)]),
        (8, [(27, 8), (81, 2)]),
        (5, [(81, 5)])]
    # every trial in exactly one bracket, in the grid's order
    assert [i for idx, _ in b for i in idx] == list(range(143))


def test_a_small_grid_repeats_the_brackets_and_the_last_may_be_short():
    b = hyperband_brackets(12, 30, 10, 3)  # s_max = 1: 3 trials from 10 rounds, 2 from 30
    assert b == [([0, 1, 2], [(10, 3), (30, 1)]), ([3, 4], [(30, 2)]),
                 ([5, 6, 7], [(10, 3), (30, 1)]), ([8, 9], [(30, 2)]),
                 ([10, 11], halving_rungs(2, 30, 10, 3))]
    # what it costs against the grid (12 × 30): 50 + 60 + 50 + 60 + 40 = 260 rounds
    assert sum(plan_rounds(r) for _, r in b) == 260
    # min_rounds above rounds / eta: only bracket 0 (n_0 = 1), repeated: the grid itself
    assert hyperband_brackets(4, 30, 20, 3) == [([i], [(30, 1)]) for i in range(4)]


def test_brackets_keep_the_slow_starter_that_one_bracket_drops(tmp_path, monkeypatch):
    one, c1, _ = _tune(_suite(tmp_path, out="one", min_rounds=3), monkeypatch)
    hb, c2, fake = _tune(_suite(tmp_path, out="hb", min_rounds=3, brackets=True), monkeypatch)
    by_lr = {t.params["client.lr"]: t for t in hb.trials[("s", "A")]}
    # successive halving (9 → 3 at 3 rounds → 1 at 9) stops the late bloomer at 3 rounds
    assert {t.params["client.lr"]: t for t in one.trials[("s", "A")]}[LATE].rounds == 3
    assert c1[("s", "A")] != {"client.lr": LATE}
    # with brackets (3 from 3 rounds, 2 from 9, 3 from 3, 1 from 9) the bracket that
    # never stops runs it to 9 rounds with no rung before
    plan = hb.tuning.protocol.plans[("s", "A")]
    assert [[(r["trials"], r["rounds"]) for r in b] for b in plan["brackets"]] == [
        [(3, 3), (1, 9)], [(2, 9)], [(3, 3), (1, 9)], [(1, 9)]]
    assert by_lr[LATE].rounds == 9 and by_lr[LATE].rung == 0
    # the choice is the best of every trial that reached the tuning rounds
    full = [t for t in by_lr.values() if t.rounds == 9]
    assert len(full) == 2 + 1 + 1 + 1
    assert max(full, key=lambda t: t.score).params == c2[("s", "A")]
    for lr, t in by_lr.items():
        assert t.score == pytest.approx(_acc(lr, t.rounds))
    # the budget: 3·3 + 1·6 (×2) + 2·9 + 1·9 = 57 rounds per seed, as run
    assert plan["client_rounds"] == 57 * 4 * 2 == plan["used"]
    ran = sum(e - s for f, lr, seed, s, e in fake.ran if f.startswith("A@")) * 4
    assert ran == plan["used"]


@pytest.mark.parametrize(("raw", "match"), [
    ({"sampler": "halving", "min_rounds": 1, "brackets": "yes"}, "brackets: needs true"),
    ({"sampler": "grid", "brackets": True}, "brackets: only with sampler: halving"),
])
def test_brackets_errors_name_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        load_protocol({"budget": 4, "seeds": [100], **raw}, "tuning", [1])


def test_the_choice_compares_every_bracket_that_ran_the_tuning_rounds():
    # q-FedAvg's brackets on docs/results/craft-hyperband.md: trial 1 was promoted to 30
    # rounds (rung 1, 75.00 %), trial 8 ran 30 rounds in a bracket with no stop (rung 0,
    # 85.35 %); the choice is the better of the two, not the one with the higher rung
    ts = [Trial(0, {}, {1: 0.5315}, rung=0, rounds=10),
          Trial(1, {}, {1: 0.7500}, rung=1, rounds=30),
          Trial(8, {}, {1: 0.8535}, rung=0, rounds=30)]
    assert halving_choice(ts, lower=False).index == 8
    # a tie at the tuning rounds goes to the earlier trial, whatever its bracket
    ts[1].scores = {1: 0.8535}
    assert halving_choice(ts, lower=False).index == 1
    # a trial stopped at its first rung never beats one that ran longer
    ts.append(Trial(11, {}, {1: 0.99}, rung=0, rounds=10))
    assert halving_choice(ts, lower=False).index == 1
