"""IPM and ALIE with their factor searched against a model of the server's rule
(ByzFL's ``Optimal_InnerProductManipulation`` and ``Optimal_ALittleIsEnough``).

The attackers (omniscient: they see every honest update ``H`` of the round, or with
``knowledge: colluders`` their own) pick the factor ``τ`` of IPM's ``−τ·μ`` or ALIE's
``μ + τ·σ`` that drives the rule's output furthest from the honest mean:
``max_τ ‖R(clip(H ∪ {row(τ)}^b)) − μ‖``, ``R`` the modelled rule (``rule``: ``mean``,
``median`` or ``trimmed_mean`` cutting ``trim`` values a side, the round's ``b`` when
left out), ``clip`` ByzFL's static clipping pre-aggregation (each vector to norm ≤ c;
``null``: none), ``b`` the attackers of the round. The search is ByzFL's: from
``start``, step ``delta`` up while the distance grows (doubling the step), then
``evals`` evaluations in all, each step times ``ratio``.
"""

from __future__ import annotations

import torch

from fedloom.attack.base import RoundView, choice, number, reference_of
from fedloom.attack.omniscient import KNOWLEDGE, _stats
from fedloom.registry import register

__all__ = ["OptimalALIE", "OptimalIPM", "rule_of"]

RULES = ("mean", "median", "trimmed_mean")


def rule_of(name: str, rows: torch.Tensor, trim: int) -> torch.Tensor:
    """The modelled rule on ``rows``: their mean, coordinate-wise median (the mean of
    the two middle values for an even count, as NumPy's) or trimmed mean."""
    if name == "mean":
        return rows.mean(dim=0)
    s = torch.sort(rows, dim=0).values
    n = s.shape[0]
    if name == "median":
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    if 2 * trim >= n:
        raise ValueError(f"attack.options.trim: cutting {trim} a side leaves nothing of "
                         f"{n} rows")
    return s[trim : n - trim].mean(dim=0) if trim else s.mean(dim=0)


class _Searched:
    """The search of the module docstring; subclasses give ``row(μ, σ, τ)``."""

    def __init__(self, rule: str = "mean", trim: int | None = None, clip: float | None = 2.0,
                 evals: int = 20, start: float = 0.0, delta: float = 10.0, ratio: float = 0.8,
                 knowledge: str = "honest") -> None:
        self.rule = choice("rule", rule, RULES)
        if trim is not None and (isinstance(trim, bool) or not isinstance(trim, int)
                                 or trim < 0):
            raise ValueError(f"attack.options.trim: must be an integer ≥ 0, got {trim!r}")
        self.trim = trim
        self.clip = None if clip is None else number("clip", clip, low=0)
        if isinstance(evals, bool) or not isinstance(evals, int) or evals < 1:
            raise ValueError(f"attack.options.evals: must be an integer ≥ 1, got {evals!r}")
        self.evals = evals
        self.start = number("start", start)
        self.delta = number("delta", delta)
        if self.delta == 0:
            raise ValueError("attack.options.delta: must not be 0")
        self.ratio = number("ratio", ratio, low=0.5, strict=True, high=1)
        if self.ratio == 1:
            raise ValueError("attack.options.ratio: must be below 1, got 1")
        self.knowledge = choice("knowledge", knowledge, KNOWLEDGE)
        self.sees = "honest" if self.knowledge == "honest" else "colluders"

    def row(self, mean: torch.Tensor, std: torch.Tensor, tau: float) -> torch.Tensor:
        raise NotImplementedError

    def _distance(self, ref: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, b: int,
                  tau: float) -> float:
        rows = torch.cat([ref, self.row(mean, std, tau).expand(b, -1)])
        if self.clip is not None:
            norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True)
            rows = torch.where(norms > self.clip, rows * (self.clip / norms), rows)
        out = rule_of(self.rule, rows, b if self.trim is None else self.trim)
        return float(torch.linalg.vector_norm(out - mean))

    def search(self, ref: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, b: int) -> float:
        """The factor ``τ`` ByzFL's expansion and contraction find (``evals`` in all)."""
        best = self.start
        best_y = self._distance(ref, mean, std, b, best)
        delta, left = self.delta, self.evals - 1
        while left > 0:  # expansion: double the step while the distance grows
            y = self._distance(ref, mean, std, b, best + delta)
            left -= 1
            if y > best_y:
                best, best_y, delta = best + delta, y, delta * 2
            else:
                delta *= self.ratio
                break
        while left > 0:  # contraction: the remaining evaluations, each step shrunk
            y = self._distance(ref, mean, std, b, best + delta)
            left -= 1
            if y > best_y:
                best, best_y = best + delta, y
            delta *= self.ratio
        return best

    def __call__(self, view: RoundView) -> torch.Tensor:
        ref = reference_of(view, self.knowledge)
        if ref.shape[0] == 0:
            return view.own.clone()
        mean, std = _stats(ref, ref.shape[1])
        tau = self.search(ref, mean, std, len(view.clients))
        return self.row(mean, std, tau).expand_as(view.own).clone()


class OptimalIPM(_Searched):
    """IPM's ``−τ·μ`` with ``τ`` searched (module docstring).

    Reference:
        paper: Xie, Koyejo & Gupta, UAI 2019 (IPM); Allouah et al., "Fixing by Mixing",
            AISTATS 2023 and ByzFL (the factor searched against the rule).
        code: ByzFL 0.0.11 ``byzfl.Optimal_InnerProductManipulation`` with ``agg`` Average,
            Median or TrMean(f), ``pre_agg_list`` [], [Clipping(2)] or [Clipping(40)], on 7
            honest rows of d = 1,000, f = 3, float64 (tests/test_attack_byzfl.py): the
            rows agree to 1e-15 of their norm (1.9e-9 on rows of norm 1.8e8, where the
            mean's search doubles τ every evaluation); where the modelled clip makes the
            distance flat in τ the τ found rides on last bits in both, and the clipped
            rows agree to 1.4e-15.
        departures: the rule is a model of the server's (mean, median, trimmed mean),
            not the run's aggregator itself; the defaults are ByzFL's.
    """

    def row(self, mean: torch.Tensor, std: torch.Tensor, tau: float) -> torch.Tensor:
        return mean * (-tau)


register("attack", "optimal_ipm")(OptimalIPM)


class OptimalALIE(_Searched):
    """ALIE's ``μ + τ·σ`` with ``τ`` searched (module docstring).

    Reference:
        paper: Baruch, Baruch & Goldberg, NeurIPS 2019 (ALIE); Allouah et al., AISTATS
            2023 and ByzFL (the factor searched against the rule).
        code: ByzFL 0.0.11 ``byzfl.Optimal_ALittleIsEnough``, on the inputs of
            :class:`OptimalIPM`: the rows agree to 1e-15 of their norm (1.9e-9 on norm
            1.7e8; tests/test_attack_byzfl.py).
        departures: as :class:`OptimalIPM`.
    """

    def row(self, mean: torch.Tensor, std: torch.Tensor, tau: float) -> torch.Tensor:
        return mean + tau * std


register("attack", "optimal_alie")(OptimalALIE)
