"""``oort``: guided participant selection (Lai et al., "Oort: Efficient Federated
Learning via Guided Participant Selection", OSDI 2021).

An explored client's utility is ``U_k = |B_k| · sqrt(mean_{i∈B_k} loss_i²) · (T/t_k)^α``
(the last factor only when ``t_k > T``), ``|B_k|`` the samples it trained on, ``t_k`` its
round duration, ``T`` the ``round_threshold``-th percentile of the known durations. The
selection score, as the public code computes it (``_training_selector.getTopK`` of
``thirdparty/oort/oort.py`` in github.com/SymbioticLab/FedScale, commit 3e5ba36):

    s_k = |(min(U_k, c) − u_min)/u_range + sqrt(0.1 · ln R / τ_k)| · (T/t_k)^α [t_k > T]

An exploration share ``ε ← max(ε·decay, ε_min)`` of the places goes to clients that
never trained; the rest are drawn from the best-scored pool ``∝ s_k``; a pacer widens
or narrows ``T``. Defaults are FedScale's (``fedscale/cloud/config_parser.py``).

Checked against the public code (``tests/test_selection.py``): a re-implementation
of FedScale's ``getTopK`` scoring, pool and pacer as it computes them, on fixed arms
(rewards, durations, time stamps, counts), gives the same scores (max difference
0.0), the same ranking and exploitation pool, and the same pacer thresholds.

Departures: the loss is the client's one reported mean loss; unexplored clients are drawn
uniformly (no ``sample_window``); the round's generator for every draw; guards where the
public code indexes past the end or returns too few; no noise on the utilities.
The score's terms, what it is told, each default and departure in full:
docs/howto/systems.md (Oort in detail).
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import numpy as np

from fedloom.registry import Range, register
from fedloom.selection.base import Feedback, fill_uniform

__all__ = ["Oort", "oort"]


class Oort:
    """Oort's training selector. State per client: ``reward`` (its last utility,
    NaN before it trains), ``duration`` (NaN: unknown), ``stamp`` (round of its last
    report, from 1; 0: never), ``count`` (reports), ``success`` (reported since the
    last selection); and ``exploit`` (last round's exploited ids), ``history`` (the
    pacer's per-round exploitation utilities), ``exploration``, ``threshold``."""

    def __init__(self, *, exploration_factor: float = 0.9, exploration_decay: float = 0.98,
                 exploration_min: float = 0.3, round_threshold: float = 30.0,
                 round_penalty: float = 2.0, clip_bound: float = 0.9,
                 cut_off_util: float = 0.05, pacer_step: int = 20, pacer_delta: float = 5.0,
                 blacklist_rounds: int = -1, blacklist_max_len: float = 0.3) -> None:
        self.exploration_factor = exploration_factor
        self.decay = exploration_decay
        self.exploration_min = exploration_min
        self.round_threshold = round_threshold
        self.penalty = round_penalty
        self.clip_bound = clip_bound
        self.cut_off = cut_off_util
        self.pacer_step = int(pacer_step)
        self.pacer_delta = pacer_delta
        self.blacklist_rounds = int(blacklist_rounds)
        self.blacklist_max_len = blacklist_max_len

    def constructor_arguments(self) -> dict[str, Any]:
        """The constructor's arguments (three are kept under shorter names)."""
        return {"exploration_factor": self.exploration_factor,
                "exploration_decay": self.decay, "exploration_min": self.exploration_min,
                "round_threshold": self.round_threshold, "round_penalty": self.penalty,
                "clip_bound": self.clip_bound, "cut_off_util": self.cut_off,
                "pacer_step": self.pacer_step, "pacer_delta": self.pacer_delta,
                "blacklist_rounds": self.blacklist_rounds,
                "blacklist_max_len": self.blacklist_max_len}

    def init(self, num_clients: int) -> dict[str, Any]:
        return {"reward": np.full(num_clients, np.nan), "duration": np.full(num_clients, np.nan),
                "stamp": np.zeros(num_clients, dtype=np.int64),
                "count": np.zeros(num_clients, dtype=np.int64),
                "success": np.zeros(num_clients, dtype=bool),
                "exploit": np.zeros(0, dtype=np.int64), "history": np.zeros(0),
                "exploration": float(self.exploration_factor),
                "threshold": float(self.round_threshold)}

    # ------------------------------------------------------------------ parts
    def blacklist(self, count: np.ndarray) -> np.ndarray:
        """Clients with more than ``blacklist_rounds`` reports, most first, at most
        ``blacklist_max_len`` of all (none when ``blacklist_rounds`` is −1)."""
        if self.blacklist_rounds < 0:
            return np.zeros(0, dtype=np.int64)
        order = np.argsort(-count, kind="stable")
        over = order[count[order] > self.blacklist_rounds]
        return over[: int(self.blacklist_max_len * len(count))].astype(np.int64)

    def pace(self, state: dict[str, Any], cur: int) -> tuple[np.ndarray, float]:
        """The pacer at round ``cur`` (from 1): the new history and threshold."""
        ex = state["exploit"]
        ok = ex[state["success"][ex]]
        cnt, total = 1e-4, 0.0
        for u in state["reward"][ok].tolist():  # in the public code's order of additions
            cnt += 1
            total += u
        util = total / cnt
        step = self.pacer_step
        history = np.append(state["history"], util)[-2 * step:]
        threshold = float(state["threshold"])
        if cur >= 2 * step and cur % step == 0:
            last = sum(float(u) for u in history[-2 * step:-step])
            now = sum(float(u) for u in history[-step:])
            if abs(now - last) <= last * 0.1:
                threshold = min(100.0, threshold + self.pacer_delta)
            elif abs(now - last) >= last * 5:
                threshold = max(self.pacer_delta, threshold - self.pacer_delta)
        return history, threshold

    @staticmethod
    def preferred_duration(duration: np.ndarray, threshold: float) -> float:
        """``T``: the ``threshold``-th percentile of the known durations (∞ at 100)."""
        known = sorted(float(t) for t in duration[~np.isnan(duration)])
        if threshold >= 100.0 or not known:
            return math.inf
        return known[min(int(len(known) * threshold / 100.0), len(known) - 1)]

    def scores(self, ids: np.ndarray, state: dict[str, Any], cur: int, pref: float
               ) -> np.ndarray:
        """``s_k`` of the explored clients ``ids`` at round ``cur`` (from 1)."""
        reward, duration, stamp = state["reward"], state["duration"], state["stamp"]
        pos = sorted(float(u) for u in reward[ids] if u > 0)
        if pos:
            clip = pos[min(int(len(pos) * self.clip_bound), len(pos) - 1)]
            lo = pos[0] * 0.999
            span = max(pos[-1] - lo, 1e-4)
        else:
            clip, lo, span = 0.0, 0.0, 1.0
        out = np.empty(len(ids))
        for i, k in enumerate(ids.tolist()):
            sc = ((min(float(reward[k]), clip) - lo) / span
                  + math.sqrt(0.1 * math.log(cur) / int(stamp[k])))
            t = float(duration[k])
            if t > pref:
                sc *= (pref / max(1e-4, t)) ** self.penalty
            out[i] = abs(sc)
        return out

    def pool(self, scores: np.ndarray, exploit_len: int) -> np.ndarray:
        """Positions (into ``scores``) of the exploitation pool, best first."""
        order = np.argsort(-scores, kind="stable")
        cut = (scores[order[exploit_len]] * self.cut_off if exploit_len < len(order) else 0.0)
        taken: list[int] = []
        for i in order.tolist():
            if scores[i] < cut and len(taken) > 10 * exploit_len:
                break
            taken.append(i)
        return np.asarray(taken, dtype=np.int64)

    # --------------------------------------------------------------- protocol
    def select(self, r: int, candidates: np.ndarray, size: int, state: dict[str, Any],
               gen: np.random.Generator) -> tuple[np.ndarray, dict[str, Any]]:
        if len(candidates) <= size:
            return np.sort(candidates).astype(np.int64), state
        cur = r + 1
        count = state["count"]
        black = self.blacklist(count)
        feasible = np.setdiff1d(candidates, black)
        history, threshold = self.pace(state, cur)
        pref = self.preferred_duration(state["duration"], threshold)
        explored = feasible[count[feasible] > 0]
        sc = self.scores(explored, state, cur, pref)
        exploration = max(float(state["exploration"]) * self.decay, self.exploration_min)
        exploit_len = min(size - int(size * exploration), len(explored))
        exploit = np.zeros(0, dtype=np.int64)
        if exploit_len > 0:
            pool = self.pool(sc, exploit_len)
            w = sc[pool]
            total = float(sum(float(x) for x in w))
            p = w / total if total > 0 and np.count_nonzero(w) >= exploit_len else None
            exploit = gen.choice(explored[pool], exploit_len, replace=False, p=p).astype(np.int64)
        unexplored = candidates[count[candidates] == 0]
        explore = np.zeros(0, dtype=np.int64)
        if len(unexplored):
            n = min(len(unexplored), size - len(exploit))
            explore = gen.choice(unexplored, n, replace=False).astype(np.int64)
        picked = np.concatenate([explore, exploit])
        picked = fill_uniform(picked, feasible, size, gen)
        picked = fill_uniform(picked, candidates, size, gen)
        new = {**state, "success": np.zeros_like(state["success"]), "exploit": exploit,
               "history": history, "exploration": exploration, "threshold": threshold}
        return np.sort(picked).astype(np.int64), new

    def observe(self, state: dict[str, Any], feedback: Feedback) -> dict[str, Any]:
        fb = feedback
        if not (len(fb.clients) or len(fb.late)):
            return state
        reward, duration = state["reward"].copy(), state["duration"].copy()
        stamp, count = state["stamp"].copy(), state["count"].copy()
        success = state["success"].copy()
        stamp_now = fb.round + 1
        trained = np.minimum(fb.samples, fb.steps * fb.batch_size).astype(np.float64)
        utils = trained * np.abs(fb.losses)
        ok = np.isfinite(utils)
        ids = fb.clients[ok]
        reward[ids] = utils[ok]
        if fb.durations is not None:
            duration[ids] = fb.durations[ok]
        stamp[ids] = stamp_now
        count[ids] += 1
        success[ids] = True
        if len(fb.late):
            weights = fb.samples[ok].astype(np.float64)
            if weights.sum() > 0:
                reward[fb.late] = float((weights / weights.sum() * utils[ok]).sum())
            if fb.deadline_s is not None:
                duration[fb.late] = fb.deadline_s
            stamp[fb.late] = stamp_now
            count[fb.late] += 1
        return {**state, "reward": reward, "duration": duration, "stamp": stamp,
                "count": count, "success": success}


@register("selector", "oort")
def oort(exploration_factor: Annotated[float, Range(ge=0, le=1)] = 0.9,
         exploration_decay: Annotated[float, Range(ge=0, le=1)] = 0.98,
         exploration_min: Annotated[float, Range(ge=0, le=1)] = 0.3,
         round_threshold: Annotated[float, Range(gt=0, le=100)] = 30.0,
         round_penalty: Annotated[float, Range(ge=0)] = 2.0,
         clip_bound: Annotated[float, Range(ge=0, le=1)] = 0.9,
         cut_off_util: Annotated[float, Range(ge=0)] = 0.05,
         pacer_step: Annotated[int, Range(ge=1)] = 20,
         pacer_delta: Annotated[float, Range(ge=0)] = 5.0,
         blacklist_rounds: Annotated[int, Range(ge=-1)] = -1,
         blacklist_max_len: Annotated[float, Range(ge=0, le=1)] = 0.3) -> Oort:
    """Oort (Lai et al., OSDI 2021): statistical utility from the reported loss, the
    time penalty ``(T/t_k)^round_penalty``, decaying exploration and the pacer;
    FedScale's defaults.

    Reference:
        paper: Lai et al., "Oort: Efficient Federated Learning via Guided Participant
            Selection", OSDI 2021.
        code: SymbioticLab/FedScale ``thirdparty/oort/oort.py`` (scores, pool and
            pacer equal on fixed inputs, max difference 0.0; tests/test_selection.py).
        departures: the utility from the one reported mean loss; unexplored clients
            drawn uniformly (their size and speed are unknown before they report);
            the round's generator; guards where the public code fails (module
            docstring).
    """
    return Oort(exploration_factor=exploration_factor, exploration_decay=exploration_decay,
                exploration_min=exploration_min, round_threshold=round_threshold,
                round_penalty=round_penalty, clip_bound=clip_bound, cut_off_util=cut_off_util,
                pacer_step=pacer_step, pacer_delta=pacer_delta,
                blacklist_rounds=blacklist_rounds, blacklist_max_len=blacklist_max_len)
