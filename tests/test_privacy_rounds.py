"""When ε is computed, and the round events of Poisson cohorts (issue #55): central
DP reports ``dp_epsilon`` on evaluated rounds and the last, each equal to the
accountant's value for that round; ``privacy.target_epsilon`` stops a run where a
check of every round does (bisection over the planned rounds, any resume point);
``cohort_short`` under Poisson sampling with availability marks a round nobody was
drawn for."""

from __future__ import annotations

import copy
import itertools
from collections import Counter

import pytest

import fedloom
from conftest import TINY, stop_and_resume
from fedloom.accounting import Accountant
from fedloom.config import load_config
from fedloom.engine.experiment import Experiment
from fedloom.privacy import Accounting, Privacy, _affordable, epsilon_central, epsilon_local

CENTRAL = ["privacy.mode=central", "privacy.noise_multiplier=1.0", "privacy.clip=1.0"]


def test_central_epsilon_is_reported_on_evaluated_rounds_and_the_last_exactly():
    # RDP: milliseconds an ε (the PLD's values are exact the same way, seconds each)
    res = fedloom.run(copy.deepcopy(TINY), [*CENTRAL, "rounds=5", "eval.every=2",
                                            "privacy.accountant=rdp"])
    have = {m["round"]: m["dp_epsilon"] for m in res.metrics if "dp_epsilon" in m}
    assert sorted(have) == [2, 4, 5]  # every 2nd round, and the last
    for r, eps in have.items():  # the value a fresh accountant gives for r rounds
        assert eps == epsilon_central(r, num_clients=10, cohort=4, noise_multiplier=1.0,
                                      delta=1e-5, accountant="rdp")
        assert eps == Accountant("rdp", "fixed").epsilon(0.4, 1.0, r, 1e-5)
    assert res.summary["dp_epsilon"] == have[5]
    # those rounds are evaluated rounds: their test metrics are there too
    assert all(("test_acc" in m) == ("dp_epsilon" in m) for m in res.metrics)


def test_local_epsilon_is_reported_on_evaluated_rounds_of_the_busiest_client():
    over = ["privacy.mode=local", "privacy.clip=1.0", "privacy.accountant=rdp", "rounds=4",
            "eval.every=3"]
    res = fedloom.run(copy.deepcopy(TINY), over)
    assert [m["round"] for m in res.metrics if "dp_epsilon" in m] == [3, 4]
    exp = Experiment.from_config(load_config(copy.deepcopy(TINY), over))
    try:  # every client of TINY's cohorts sends: the busiest one's participations
        busiest = Counter(int(k) for r in range(4) for k in exp.sample_cohort(r)).most_common(1)
    finally:
        exp.close()
    assert res.summary["dp_epsilon"] == res.metrics[-1]["dp_epsilon"] == epsilon_local(
        busiest[0][1], noise_multiplier=1.0, delta=1e-5, accountant="rdp")


def _privacy(mode: str, target: float) -> Privacy:
    return Privacy(mode, clip=1.0, noise_multiplier=1.0, delta=1e-5, cohort_size=4,
                   num_clients=10, seed=0, target_epsilon=target,
                   accounting=Accounting("rdp"))


@pytest.mark.parametrize("mode,target", [("central", 8.0), ("central", 20.0),
                                         ("central", 1e6), ("local", 12.0),
                                         ("local", 30.0)])
def test_the_bisected_stop_is_the_every_round_check(mode, target):
    """TINY's accounting by RDP (central: q = 0.4, z = 1, fixed-size; local: the
    busiest client's participations): at each round of an 8-round run the stop
    decision with the planned rounds (bisection) equals the check of the next
    round's ε, message and all."""
    p = _privacy(mode, target)
    eps = [p.planned_epsilon(t) for t in range(10)]
    assert all(a <= b for a, b in itertools.pairwise(eps))  # ε grows with T
    for rounds in range(9):
        state = p.init()
        if p.local:  # client 0 took part in every round so far, client 1 in one
            state["participation"][0] = rounds
            state["participation"][1] = min(rounds, 1)
        assert p.stop_reason(state, rounds, planned=8) == p.stop_reason(state, rounds), rounds
    last = _affordable(p, 8)
    assert eps[last] <= target and (last == 8 or eps[last + 1] > target)


def test_target_epsilon_stops_a_resumed_run_where_the_uninterrupted_one_stops(tmp_path):
    # RDP, z = 1: ε(3) = 16.59 ≤ 18 < ε(4) = 19.16: rounds 1–3 run, the 4th would exceed it
    over = [*CENTRAL, "privacy.accountant=rdp", "privacy.target_epsilon=18", "rounds=6",
            "eval.every=2"]
    ref, res = stop_and_resume(copy.deepcopy(TINY), over, tmp_path / "run", stop_after=2)
    assert [m["round"] for m in ref.metrics] == [1, 2, 3]
    assert len(res.metrics) == 3 and res.summary["rounds"] == 3
    assert res.summary["dp_epsilon"] == ref.summary["dp_epsilon"] == pytest.approx(16.59,
                                                                                   abs=5e-3)
    assert "privacy.target_epsilon=18" in res.summary["stop_reason"]


def test_cohort_short_under_poisson_sampling_marks_an_empty_draw(tiny):
    """Poisson cohorts drawn from the available clients (availability 0.4, rate 0.4 of
    10 clients): fewer than cohort.size (4) available is no shortfall, since there is no
    size to fill; a round with nobody drawn is."""
    res = fedloom.run(tiny, ["cohort.sampling=poisson", "system.availability=0.4",
                             "rounds=12", "eval.every=12"])
    short = [m["cohort_short"] for m in res.metrics]
    assert short == [int(m["cohort_size"] == 0) for m in res.metrics]
    assert any(short)  # some round drew nobody
    # and some round had fewer than 4 available yet drew somebody: not short
    assert any(m["available_clients"] < 4 and m["cohort_size"] > 0 and not m["cohort_short"]
               for m in res.metrics)
    # fixed-size cohorts keep their meaning: fewer available than cohort.size
    fixed = fedloom.run(tiny, ["system.availability=0.4", "rounds=4", "eval.every=4"])
    assert [m["cohort_short"] for m in fixed.metrics] == [
        int(m["available_clients"] < 4) for m in fixed.metrics]
