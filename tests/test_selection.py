"""Client selection (cohort.selection): uniform is the earlier sampling, power-of-choice
and Oort against re-implementations of the public code's rules on fixed inputs, and
every selector's contract (distinct available ids, server-side information only,
deterministic, resumed bit-identically)."""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

import fedloom
from conftest import stop_and_resume
from fedloom.config import ClientConfig, ConfigError, SystemConfig, load_config
from fedloom.engine import Experiment
from fedloom.engine.inputs import Schedule
from fedloom.registry import available, build
from fedloom.rng import Purpose, numpy_gen
from fedloom.selection import Feedback, Oort, PowerOfChoice
from fedloom.selection.power import top_losses
from fedloom.system import System

SYSTEM = {"profile": "lognormal", "speed": [300, 1.0], "up_bps": [3e4, 0.5],
          "latency_s": 0.1, "deadline_s": 3.0}


def _old_sample_cohort(seed: int, r: int, size: int, n: int, system: Any) -> torch.Tensor:
    """The cohort as fedloom drew it before selectors (Schedule.sample_cohort then)."""
    gen = numpy_gen(seed, r, -1, Purpose.COHORT)
    if system is not None and system.has_availability:
        return system.sample(r, gen, size)
    return torch.from_numpy(np.sort(gen.choice(n, size, replace=False))).long()


@pytest.mark.parametrize("availability", [None, 0.5, 0.15])
def test_uniform_is_the_earlier_sampling(availability):
    for seed in (0, 3, 11):
        for n, size in ((10, 4), (40, 10), (7, 7)):
            sysm = (System(SystemConfig(availability=availability), seed, n, 8, size)
                    if availability is not None else None)
            sched = Schedule(seed, 20, size, n, ClientConfig(), sysm,
                             build("selector", "uniform", {}, "cohort.selection.options"))
            state = sched.initial_selection()
            for r in range(12):
                cohort, state = sched.select(r, state)
                assert torch.equal(cohort, _old_sample_cohort(seed, r, size, n, sysm))
                assert torch.equal(sched.sample_cohort(r), cohort)
            assert state == {}


def _feedback(r: int, ids: np.ndarray, losses: np.ndarray, *, samples: int = 50,
              steps: int = 4, batch: int = 16, durations: np.ndarray | None = None,
              late: np.ndarray | None = None, deadline: float | None = None) -> Feedback:
    m = len(ids)
    return Feedback(r, np.asarray(ids, dtype=np.int64), np.asarray(losses, dtype=np.float64),
                    np.full(m, samples, dtype=np.int64), np.full(m, steps, dtype=np.int64),
                    batch, durations=durations,
                    late=np.asarray(late if late is not None else [], dtype=np.int64),
                    deadline_s=deadline)


# ----------------------------------------------------------------- power of choice
def _flgo_sample(available: list[int], candidate_draw: list[int], m: int,
                 loss_of: dict[int, float], *, as_written: bool = True) -> list[int]:
    """FLGo's Server.sample (flgo/algorithm/powerofchoice.py, WwZzz/easyFL 19de9fb)
    after its candidate draw: the sorted candidates' losses, argsort reversed, the
    first m. ``as_written``: it indexes the *available* list with those positions."""
    candidate_set = sorted(candidate_draw)
    losses = [loss_of[cid] for cid in candidate_set]
    sort_id = np.array(losses).argsort().tolist()
    sort_id.reverse()
    num_selected = min(m, len(available))
    pool = np.array(available) if as_written else np.array(candidate_set)
    return pool[sort_id][:num_selected].tolist()


def test_power_of_choice_takes_the_highest_losses_as_flgo():
    rng = np.random.default_rng(7)
    for _ in range(20):
        n, m = 30, 5
        available = sorted(rng.choice(n, 18, replace=False).tolist())
        loss_of = {k: float(v) for k, v in enumerate(rng.permutation(n) * 0.1 + 0.05)}
        losses = np.array([loss_of[k] for k in range(n)])
        # d = N (FLGo's default): every available client is a candidate; the same ids
        ours = top_losses(np.array(available), losses[available], m)
        assert sorted(_flgo_sample(available, available, m, loss_of)) == ours.tolist()
        sel = PowerOfChoice(0)
        got, _ = sel.select(3, np.array(available), m, {"loss": losses},
                            np.random.default_rng(1))
        assert got.tolist() == ours.tolist()
        # d < N: the candidates drawn by the round's generator; FLGo's rule with the
        # candidates indexed gives the same ids (as written it indexes the available list)
        sel = PowerOfChoice(8)
        gen = np.random.default_rng(5)
        cand = sel.candidates(np.array(available), m, np.random.default_rng(5))
        got, _ = sel.select(3, np.array(available), m, {"loss": losses}, gen)
        fixed = _flgo_sample(available, cand.tolist(), m, loss_of, as_written=False)
        assert sorted(fixed) == got.tolist()
        assert set(got.tolist()) <= set(cand.tolist())
        assert losses[got].min() >= np.sort(losses[cand])[::-1][m - 1]
    # FLGo as written picks clients it did not rank when d < N
    available = list(range(10, 20))
    loss_of = {k: float(k) for k in range(20)}
    assert _flgo_sample(available, [11, 13, 15], 2, loss_of) == [12, 11]
    assert _flgo_sample(available, [11, 13, 15], 2, loss_of, as_written=False) == [15, 13]


def test_power_of_choice_tries_every_client_once_then_ranks_by_last_loss():
    sel = PowerOfChoice(0)
    state = sel.init(6)
    seen: list[int] = []
    for r in range(3):
        got, state = sel.select(r, np.arange(6), 2, state, numpy_gen(0, r, -1, "cohort"))
        seen += got.tolist()
        state = sel.observe(state, _feedback(r, got, [float(k) for k in got]))
    assert sorted(seen) == list(range(6))              # unknown losses (+inf) first
    got, _ = sel.select(3, np.arange(6), 2, state, numpy_gen(0, 3, -1, "cohort"))
    assert got.tolist() == [4, 5]                      # then the highest reported
    # a non-finite report changes nothing
    assert np.isinf(sel.observe(sel.init(3), _feedback(0, np.array([1]), [np.nan]))["loss"][1])


# ---------------------------------------------------------------------------- Oort
class _FedScaleOort:
    """The parts of FedScale's _training_selector.getTopK (thirdparty/oort/oort.py,
    SymbioticLab/FedScale 3e5ba36) that do not draw at random, as it computes them:
    the pacer, the preferred duration, the scores and the exploitation pool."""

    def __init__(self, arms: OrderedDict, round_threshold=30.0, round_penalty=2.0,
                 clip_bound=0.9, cut_off_util=0.05, pacer_step=20, pacer_delta=5.0):
        self.totalArms = arms
        self.round_threshold = round_threshold
        self.round_penalty = round_penalty
        self.clip_bound = clip_bound
        self.cut_off_util = cut_off_util
        self.pacer_step = pacer_step
        self.pacer_delta = pacer_delta
        self.exploitUtilHistory: list[float] = []
        self.exploitClients: list[int] = []
        self.successfulClients: set[int] = set()
        self.training_round = 0

    def calculateSumUtil(self, clientList):
        cnt, cntUtil = 1e-4, 0
        for client in clientList:
            if client in self.successfulClients:
                cnt += 1
                cntUtil += self.totalArms[client]["reward"]
        return cntUtil / cnt

    def pacer(self):
        self.exploitUtilHistory.append(self.calculateSumUtil(self.exploitClients))
        self.successfulClients = set()
        step = self.pacer_step
        if self.training_round >= 2 * step and self.training_round % step == 0:
            last = sum(self.exploitUtilHistory[-2 * step:-step])
            now = sum(self.exploitUtilHistory[-step:])
            if abs(now - last) <= last * 0.1:
                self.round_threshold = min(100., self.round_threshold + self.pacer_delta)
            elif abs(now - last) >= last * 5:
                self.round_threshold = max(self.pacer_delta,
                                           self.round_threshold - self.pacer_delta)

    @staticmethod
    def get_norm(aList, clip_bound=0.95, thres=1e-4):
        aList.sort()
        clip_value = aList[min(int(len(aList) * clip_bound), len(aList) - 1)]
        _max = aList[-1]
        _min = aList[0] * 0.999
        _range = max(_max - _min, thres)
        return float(_max), float(_min), float(_range), float(clip_value)

    def scores(self, cur_time, feasible):
        client_list = list(self.totalArms.keys())
        orderedKeys = [x for x in client_list if int(x) in feasible]
        if self.round_threshold < 100.:
            sortedDuration = sorted([self.totalArms[key]["duration"] for key in client_list])
            self.round_prefer_duration = sortedDuration[
                min(int(len(sortedDuration) * self.round_threshold / 100.),
                    len(sortedDuration) - 1)]
        else:
            self.round_prefer_duration = float("inf")
        moving_reward = [self.totalArms[c]["reward"] for c in orderedKeys
                         if self.totalArms[c]["reward"] > 0]
        _, min_reward, range_reward, clip_value = self.get_norm(moving_reward, self.clip_bound)
        scores = {}
        for key in orderedKeys:
            if self.totalArms[key]["count"] > 0:
                creward = min(self.totalArms[key]["reward"], clip_value)
                sc = (creward - min_reward) / float(range_reward) \
                    + math.sqrt(0.1 * math.log(cur_time) / self.totalArms[key]["time_stamp"])
                clientDuration = self.totalArms[key]["duration"]
                if clientDuration > self.round_prefer_duration:
                    sc *= ((float(self.round_prefer_duration) / max(1e-4, clientDuration))
                           ** self.round_penalty)
                scores[key] = abs(sc)
        return scores

    def pool(self, scores, exploitLen):
        sortedClientUtil = sorted(scores, key=scores.get, reverse=True)
        cut_off_util = scores[sortedClientUtil[exploitLen]] * self.cut_off_util
        tempPickedClients = []
        for clientId in sortedClientUtil:
            if scores[clientId] < cut_off_util and len(tempPickedClients) > 10. * exploitLen:
                break
            tempPickedClients.append(clientId)
        return sortedClientUtil, tempPickedClients


def _arms(rng: np.random.Generator, n: int) -> tuple[OrderedDict, dict[str, Any]]:
    """n arms that have all trained, as FedScale's dicts and as Oort's state."""
    reward = rng.lognormal(3.0, 1.0, n)
    duration = rng.lognormal(1.0, 0.8, n)
    stamp = rng.integers(1, 40, n)
    count = rng.integers(1, 6, n)
    arms = OrderedDict((k, {"reward": float(reward[k]), "duration": float(duration[k]),
                            "time_stamp": int(stamp[k]), "count": int(count[k])})
                       for k in range(n))
    state = Oort().init(n)
    state.update(reward=reward, duration=duration, stamp=stamp.astype(np.int64),
                 count=count.astype(np.int64))
    return arms, state


def test_oort_scores_pool_and_pacer_equal_fedscale():
    rng = np.random.default_rng(11)
    worst = 0.0
    for _ in range(25):
        n = int(rng.integers(20, 120))
        arms, state = _arms(rng, n)
        threshold = float(rng.choice([10.0, 30.0, 100.0]))
        ref = _FedScaleOort(arms, round_threshold=threshold)
        oort = Oort(round_threshold=threshold)
        feasible = np.sort(rng.choice(n, int(rng.integers(10, n)), replace=False))
        cur = int(rng.integers(40, 200))
        want = ref.scores(cur, set(feasible.tolist()))
        pref = oort.preferred_duration(state["duration"], threshold)
        assert pref == ref.round_prefer_duration
        got = oort.scores(feasible, state, cur, pref)
        assert list(want) == feasible.tolist()
        diff = np.abs(got - np.array([want[k] for k in feasible.tolist()]))
        worst = max(worst, float(diff.max()))
        exploit_len = int(rng.integers(1, min(10, len(feasible) - 1)))
        order, pool = ref.pool(want, exploit_len)
        assert feasible[oort.pool(got, exploit_len)].tolist() == pool
        assert feasible[np.argsort(-got, kind="stable")].tolist() == order
    assert worst == 0.0  # the docstring's "max difference 0.0"
    # the pacer: the same thresholds round after round
    n = 30
    arms, state = _arms(rng, n)
    ref = _FedScaleOort(arms, pacer_step=3)
    oort = Oort(pacer_step=3)
    for cur in range(1, 60):
        exploit = rng.choice(n, 4, replace=False)
        ok = exploit[rng.random(4) < 0.8]
        # rewards that flatten, then jump: both branches of the pacer are taken
        new = rng.lognormal(3.0, 0.05 if cur < 30 else 2.0, len(ok))
        for k, u in zip(ok.tolist(), new.tolist(), strict=True):
            arms[k]["reward"] = u
            state["reward"][k] = u
        ref.exploitClients, ref.successfulClients = exploit.tolist(), set(ok.tolist())
        state["exploit"] = exploit.astype(np.int64)
        state["success"] = np.isin(np.arange(n), ok)
        ref.training_round = cur
        ref.pacer()
        state["history"], state["threshold"] = oort.pace(state, cur)
        assert state["threshold"] == ref.round_threshold
        assert state["history"].tolist() == ref.exploitUtilHistory[-6:]
    assert len({*ref.exploitUtilHistory}) > 1 and ref.round_threshold != 30.0


def test_oort_utility_and_time_penalty_from_feedback():
    oort = Oort(round_threshold=50.0)
    state = oort.init(6)
    fb = _feedback(0, np.array([0, 1, 2, 3]), [0.5, -2.0, 1.0, 4.0], samples=40, steps=2,
                   batch=16, durations=np.array([1.0, 2.0, 3.0, 10.0]),
                   late=np.array([5]), deadline=6.0)
    state = oort.observe(state, fb)
    # |B_k| = min(n_k, steps·batch) = 32; utility = |B_k|·|loss|
    assert state["reward"][:4].tolist() == [16.0, 64.0, 32.0, 128.0]
    assert state["reward"][5] == pytest.approx(np.mean([16.0, 64.0, 32.0, 128.0]))
    assert state["duration"][[0, 3, 5]].tolist() == [1.0, 10.0, 6.0]
    assert state["stamp"].tolist() == [1, 1, 1, 1, 0, 1] and state["count"][4] == 0
    # T = the 50th percentile of the known durations (1, 2, 3, 6, 10) = 3: the slowest
    # arm is scored with the penalty (T/t)^2
    pref = oort.preferred_duration(state["duration"], 50.0)
    assert pref == 3.0
    ids = np.array([0, 1, 2, 3])
    plain = Oort(round_threshold=100.0).scores(ids, state, 5, math.inf)
    got = oort.scores(ids, state, 5, pref)
    assert got[:3].tolist() == plain[:3].tolist()
    assert got[3] == pytest.approx(plain[3] * (3.0 / 10.0) ** 2)


def test_oort_explores_the_unexplored_then_exploits():
    oort = Oort(exploration_factor=0.5, exploration_decay=1.0, exploration_min=0.5)
    state = oort.init(20)
    got, state = oort.select(0, np.arange(20), 4, state, numpy_gen(0, 0, -1, "cohort"))
    assert len(got) == 4  # all exploration: nobody has trained
    state = oort.observe(state, _feedback(0, got, [1.0, 2.0, 3.0, 9.0]))
    got2, state = oort.select(1, np.arange(20), 4, state, numpy_gen(0, 1, -1, "cohort"))
    # two places exploit (from the 4 explored), two explore (never trained)
    assert len(set(got2.tolist()) & set(got.tolist())) == 2
    assert state["exploit"].tolist() and set(state["exploit"].tolist()) <= set(got.tolist())


# --------------------------------------------------------------- every selector
@pytest.mark.parametrize("name", available("selector"))
def test_every_selector_returns_size_distinct_available_ids(name):
    rng = np.random.default_rng(3)
    sel = build("selector", name, {}, "cohort.selection.options")
    n = 25
    state = sel.init(n)
    for r in range(40):
        size = int(rng.integers(1, 12))
        cand = np.sort(rng.choice(n, int(rng.integers(0, n + 1)), replace=False)).astype(np.int64)
        got, state = sel.select(r, cand, size, state, numpy_gen(1, r, -1, "cohort"))
        assert got.dtype == np.int64 and got.ndim == 1
        assert len(set(got.tolist())) == len(got) == min(size, len(cand))
        assert set(got.tolist()) <= set(cand.tolist())
        keep = got[rng.random(len(got)) < 0.8]
        late = np.setdiff1d(got, keep)
        state = sel.observe(state, _feedback(r, keep, rng.lognormal(0, 1, len(keep)),
                                             durations=rng.lognormal(1, 1, len(keep)),
                                             late=late, deadline=5.0))


class Spy:
    """A selector that records what it is handed (for the test below)."""

    calls: ClassVar[list[tuple[str, tuple[Any, ...]]]] = []

    def init(self, num_clients):
        return {"n": num_clients}

    def select(self, r, candidates, size, state, gen):
        Spy.calls.append(("select", (r, candidates, size, state, gen)))
        return np.sort(gen.choice(candidates, min(size, len(candidates)), replace=False)), state

    def observe(self, state, feedback):
        Spy.calls.append(("observe", (state, feedback)))
        return state


def test_a_selector_sees_only_what_the_server_knows(tiny):
    Spy.calls.clear()
    cfg = copy.deepcopy(tiny)
    cfg["system"] = dict(SYSTEM)
    cfg["cohort"]["selection"] = "test_selection:Spy"
    res = fedloom.run(cfg)
    # a class attribute sees the check at the door's two rounds first (on a copy;
    # fedloom.selection.checks), then the run's three
    probe, calls = Spy.calls[:4], Spy.calls[4:]
    assert [c[0] for c in probe] == ["select", "observe"] * 2
    assert [c[0] for c in calls] == ["select", "observe"] * 3
    for kind, args in calls:
        if kind == "select":
            r, cand, size, state, gen = args
            assert isinstance(r, int) and isinstance(size, int) and state == {"n": 10}
            assert isinstance(cand, np.ndarray) and cand.tolist() == list(range(10))
            assert isinstance(gen, np.random.Generator)
            continue
        _, fb = args
        assert isinstance(fb, Feedback)
        for v in vars(fb).values():  # numbers and id arrays only: no tensor, no data
            assert v is None or isinstance(v, (int, float, np.ndarray))
            assert not isinstance(v, np.ndarray) or v.ndim == 1
        m = res.metrics[fb.round]
        w = fb.samples.astype(np.float64)
        assert float((fb.losses * w).sum() / w.sum()) == pytest.approx(m["train_loss"])
        assert fb.durations is not None and len(fb.durations) == len(fb.clients)
        assert fb.deadline_s == 3.0 and fb.batch_size == 16


# ------------------------------------------------------------- runs and resume
def _cohorts(cfg: dict[str, Any]) -> list[list[int]]:
    exp = Experiment.from_config(load_config(cfg))
    try:
        st, out = exp.init(), []
        for r in range(cfg["rounds"]):
            out.append(exp.schedule.select(r, st.selection_state)[0].tolist())
            st, _ = exp.round(st)
        return out
    finally:
        exp.close()


@pytest.mark.parametrize("selection", ["power_of_choice",
                                       {"name": "oort", "options": {"pacer_step": 1}}])
def test_selectors_are_deterministic_and_resume_bit_identically(tiny, tmp_path, selection):
    cfg = copy.deepcopy(tiny)
    cfg["rounds"] = 5
    cfg["data"]["num_clients"] = 12
    cfg["system"] = dict(SYSTEM)
    cfg["cohort"]["selection"] = selection
    a, b = _cohorts(cfg), _cohorts(cfg)
    assert a == b
    uniform = _cohorts({**cfg, "cohort": {"size": 4}})
    assert a != uniform  # the selector chose, not the uniform draw
    ref, res = stop_and_resume(cfg, [], tmp_path / "run", stop_after=2)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    drop = ("train_s", "agg_s", "wall_s")
    assert ([{k: v for k, v in m.items() if k not in drop} for m in res.metrics]
            == [{k: v for k, v in m.items() if k not in drop} for m in ref.metrics])


def test_the_config_section(tiny):
    cfg = load_config(tiny, ["cohort.selection=oort",
                             "cohort.selection.options.round_penalty=1.5"])
    assert cfg.cohort.selection.name == "oort"
    assert cfg.cohort.selection.options == {"round_penalty": 1.5}
    assert load_config(tiny).cohort.selection.name == "uniform"
    with pytest.raises(ConfigError, match=r"cohort\.selection\.options\.alpha"):
        load_config(tiny, ["cohort.selection=oort", "cohort.selection.options.alpha=2"])
    with pytest.raises(ConfigError, match=r"cohort\.selection\.options\.d"):
        load_config(tiny, ["cohort.selection=power_of_choice",
                           "cohort.selection.options.d=-1"])
    with pytest.raises(ConfigError, match=r"cohort\.selection\.name"):
        load_config(tiny, ["cohort.selection=nope"])


def test_privacy_and_secure_aggregation_keep_the_uniform_cohort(tiny):
    for ov in (["privacy.mode=central", "privacy.clip=1.0", "server.lr=1.0"],
               ["privacy.mode=local", "privacy.clip=1.0", "server.lr=1.0"]):
        with pytest.raises(ConfigError, match=r"cohort\.selection"):
            Experiment.from_config(load_config(tiny, [*ov, "cohort.selection=oort"]))
    Experiment.from_config(load_config(tiny, ["privacy.mode=central", "privacy.clip=1.0",
                                  "server.lr=1.0"])).close()
