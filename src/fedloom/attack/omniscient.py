"""Attacks computed from the honest clients' updates of the round: ALIE, IPM (FoE),
Mimic, MinMax and MinSum.

Each sees every honest update of the round (``knowledge: honest``, the omniscient
attacker of the papers and of ByzFL; the default) or only the Byzantine clients' own
honest updates, pooled (``knowledge: colluders``, the papers' weaker attacker); a
round without such rows uses the other set (:func:`fedloom.attack.base.reference_of`).
All the round's attackers send one row, computed once, in float64. Below, ``H`` is
that set of ``h`` rows, ``μ`` its mean and ``σ`` its per-coordinate sample standard
deviation (``ddof = 1``; 0 with one row).
"""

from __future__ import annotations

from collections.abc import Callable
from statistics import NormalDist

import torch

from fedloom.attack.base import RoundView, choice, number, reference_of
from fedloom.registry import register

__all__ = ["ALIE", "IPM", "Mimic", "MinMax", "MinSum", "alie_z", "gamma_search"]

KNOWLEDGE = ("honest", "colluders")


def _stats(ref: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``μ`` and ``σ`` of ``ref`` (zeros for no row; ``σ = 0`` for one)."""
    if ref.shape[0] == 0:
        z = ref.new_zeros(d)
        return z, z
    mean = ref.mean(dim=0)
    std = ref.std(dim=0, correction=1) if ref.shape[0] > 1 else torch.zeros_like(mean)
    return mean, std


def _same_row(row: torch.Tensor, view: RoundView) -> torch.Tensor:
    return row.expand_as(view.own).clone()


def alie_z(n: int, f: int) -> float:
    """Baruch et al.'s ``z_max``: ``s = ⌊n/2 + 1⌋ − f`` supporters needed, then
    ``z = Φ⁻¹((n − s)/n)``, the probability clipped to ``[1e-12, 1 − 1e-12]`` (when the
    attackers are a majority, ``s ≤ 0``)."""
    s = (n // 2 + 1) - f
    p = min(max((n - s) / n, 1e-12), 1 - 1e-12)
    return NormalDist().inv_cdf(p)


class ALIE:
    """A little is enough: ``μ + z·σ``, ``z`` given or the paper's ``z_max`` of the round
    (``n`` the clients reporting, ``f`` the attackers among them: :func:`alie_z`).

    Reference:
        paper: Baruch, Baruch & Goldberg, "A Little Is Enough: Circumventing Defenses
            For Distributed Learning", NeurIPS 2019 (Algorithm 3; z_max, §4).
        code: ByzFL 0.0.11 ``byzfl.ALittleIsEnough(tau=z)``: max |difference| 8.9e-16 at
            z = 1.5, 4.4e-16 at z = 0.25 and at z_max(10, 3) on 7 honest rows of
            d = 1,000, float64, seeded normal (tests/test_attack_byzfl.py); z_max for
            n = 50, f = 24 is Φ⁻¹(0.96) = 1.7507 (by hand).
        departures: the sign of ``z`` is ByzFL's (+); ``z: null`` takes n and f from the
            round, not the population.
    """

    def __init__(self, z: float | None = None, knowledge: str = "honest") -> None:
        self.z = None if z is None else number("z", z)
        self.knowledge = choice("knowledge", knowledge, KNOWLEDGE)
        self.sees = "honest" if self.knowledge == "honest" else "colluders"

    def __call__(self, view: RoundView) -> torch.Tensor:
        mean, std = _stats(reference_of(view, self.knowledge), view.own.shape[1])
        z = self.z if self.z is not None else alie_z(view.cohort, len(view.clients))
        return _same_row(mean + z * std, view)


register("attack", "alie")(ALIE)


class IPM:
    """Inner-product manipulation (fall of empires): ``−ε·μ``.

    Reference:
        paper: Xie, Koyejo & Gupta, "Fall of Empires: Breaking Byzantine-tolerant SGD
            by Inner Product Manipulation", UAI 2019 (ε = 0.1 and ε large, §4).
        code: ByzFL 0.0.11 ``byzfl.InnerProductManipulation(tau=ε)``: max |difference|
            1.4e-17 at ε = 0.1, 2.2e-16 at ε = 2 on 7 honest rows of d = 1,000, float64,
            seeded normal (tests/test_attack_byzfl.py).
        departures: none.
    """

    def __init__(self, epsilon: float = 0.1, knowledge: str = "honest") -> None:
        self.epsilon = number("epsilon", epsilon, low=0, strict=True)
        self.knowledge = choice("knowledge", knowledge, KNOWLEDGE)
        self.sees = "honest" if self.knowledge == "honest" else "colluders"

    def __call__(self, view: RoundView) -> torch.Tensor:
        mean, _ = _stats(reference_of(view, self.knowledge), view.own.shape[1])
        return _same_row(mean * (-self.epsilon), view)


register("attack", "ipm")(IPM)
register("attack", "foe")(IPM)


class Mimic:
    """Every attacker sends honest row ``target`` of the round (cohort order, ``target
    mod h``), over-representing one client of a heterogeneous population.

    Reference:
        paper: Karimireddy, He & Jaggi, "Byzantine-Robust Learning on Heterogeneous
            Datasets via Bucketing", ICLR 2022 (the mimic attack).
        code: ByzFL 0.0.11 ``byzfl.Mimic(epsilon=target)``: max |difference| 0 (the same
            row; tests/test_attack_byzfl.py).
        departures: ``target`` wraps round the round's ``h`` honest rows (ByzFL raises);
            the paper's choice of the mimicked worker by variance is not made.
    """

    sees = "honest"

    def __init__(self, target: int = 0) -> None:
        if isinstance(target, bool) or not isinstance(target, int) or target < 0:
            raise ValueError(f"attack.options.target: must be an integer ≥ 0, got {target!r}")
        self.target = target

    def __call__(self, view: RoundView) -> torch.Tensor:
        ref = reference_of(view, "honest")
        if ref.shape[0] == 0:
            return view.own.clone()
        return _same_row(ref[self.target % ref.shape[0]], view)


register("attack", "mimic")(Mimic)


def _direction(ref: torch.Tensor, mean: torch.Tensor, kind: str) -> torch.Tensor:
    """The perturbation ``p`` the attack moves against: ``μ/‖μ‖``, ``sign(μ)`` or ``σ``."""
    if kind == "unit_vec":
        norm = torch.linalg.vector_norm(mean)
        return mean / norm if float(norm) > 0 else torch.zeros_like(mean)
    if kind == "sign":
        return torch.sign(mean)
    return _stats(ref, mean.numel())[1]


def gamma_search(ok: Callable[[float], bool], start: float, tol: float) -> float:
    """The public code's bisection for the largest ``γ`` with ``ok(γ)``: try ``γ = start``,
    then move by half the last step up (success) or down (failure), halving the step,
    until the last success is within ``tol`` of the point tried; 0 if none succeeds
    (``γ`` ranges over ``(0, 2·start)``)."""
    lam, step, succ = start, start, 0.0
    while abs(succ - lam) > tol:
        if ok(lam):
            succ = lam
            lam = lam + step / 2
        else:
            lam = lam - step / 2
        step = step / 2
    return succ


class _Shejwalkar:
    """MinMax and MinSum's common part: ``μ − γ·p`` for the largest ``γ`` the test allows."""

    def __init__(self, direction: str = "unit_vec", gamma_init: float = 10.0,
                 tol: float = 1e-5, knowledge: str = "honest") -> None:
        self.direction = choice("direction", direction, ("unit_vec", "sign", "std"))
        self.gamma_init = number("gamma_init", gamma_init, low=0, strict=True)
        self.tol = number("tol", tol, low=0, strict=True)
        self.knowledge = choice("knowledge", knowledge, KNOWLEDGE)
        self.sees = "honest" if self.knowledge == "honest" else "colluders"

    def _allowed(self, ref: torch.Tensor, mal: torch.Tensor, dist: torch.Tensor) -> bool:
        raise NotImplementedError

    def __call__(self, view: RoundView) -> torch.Tensor:
        ref = reference_of(view, self.knowledge)
        if ref.shape[0] == 0:
            return view.own.clone()
        mean = ref.mean(dim=0)
        p = _direction(ref, mean, self.direction)
        # ‖h_i − h_j‖², each from its difference (not the Gram form: exact for equal rows)
        dist = torch.cdist(ref, ref, compute_mode="donot_use_mm_for_euclid_dist").square()

        def ok(gamma: float) -> bool:
            return self._allowed(ref, mean - gamma * p, dist)

        gamma = gamma_search(ok, self.gamma_init, self.tol)
        return _same_row(mean - gamma * p, view)


class MinMax(_Shejwalkar):
    """Min-Max: ``μ − γp`` with the largest ``γ`` such that
    ``max_i ‖μ − γp − h_i‖² ≤ max_{i,j} ‖h_i − h_j‖²`` (``direction``: ``p`` =
    ``unit_vec`` μ/‖μ‖, ``sign`` sign(μ) or ``std`` σ; the bisection of
    :func:`gamma_search` from ``gamma_init`` to ``tol``).

    Reference:
        paper: Shejwalkar & Houmansadr, "Manipulating the Byzantine: Optimizing Model
            Poisoning Attacks and Defenses for Federated Learning", NDSS 2021 (§IV-B).
        code: vrt1shjwlkr/NDSS21-Model-Poisoning (f2879cd), ``our_attack_dist`` of
            cifar10/release-fedsgd-alexnet-mkrum.ipynb, run with its CUDA calls made
            no-ops on 20 seeded sets of 12 rows of d = 500, each direction: max
            |difference| 0 (not in make test: the code is a notebook). In make test,
            golden γ by hand: H = {0, 1, 5} ⊂ R, μ = 2, p = sign(μ) = 1:
            max_i (2 − γ − h_i)² = (γ + 3)² ≤ 25 gives γ = 2 (tests/test_attack_search.py).
        departures: float64, not float32; the pairwise distances by ``torch.cdist``.
    """

    def _allowed(self, ref: torch.Tensor, mal: torch.Tensor, dist: torch.Tensor) -> bool:
        return bool((ref - mal).square().sum(dim=1).max() <= dist.max())


register("attack", "minmax")(MinMax)


class MinSum(_Shejwalkar):
    """Min-Sum: ``μ − γp`` with the largest ``γ`` such that
    ``Σ_i ‖μ − γp − h_i‖² ≤ min_i Σ_j ‖h_i − h_j‖²`` (options as :class:`MinMax`).

    Reference:
        paper: Shejwalkar & Houmansadr, NDSS 2021 (§IV-B, Min-Sum).
        code: vrt1shjwlkr/NDSS21-Model-Poisoning ``our_attack_score``, run as for
            :class:`MinMax`: max |difference| 0. In make test, golden γ by hand on
            H = {0, 1, 5}, p = 1: Σ_i = 3γ² + 14 ≤ min(26, 17, 41) = 17 gives γ = 1
            (tests/test_attack_search.py).
        departures: the bound is the public code's ``min_i`` of the honest rows' sums
            (the paper's text writes ``max_i``); float64.
    """

    def _allowed(self, ref: torch.Tensor, mal: torch.Tensor, dist: torch.Tensor) -> bool:
        return bool((ref - mal).square().sum() <= dist.sum(dim=1).min())


register("attack", "minsum")(MinSum)
