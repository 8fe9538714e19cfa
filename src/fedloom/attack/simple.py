"""Attacks on the update that need no model of the honest clients: sign flipping,
Gaussian noise, scaling (model replacement), ``inf``, and an audit's canary.

Each names what it sees (:data:`fedloom.attack.base.SEES`) and is checked against
ByzFL 0.0.11 where ByzFL has it (``tests/test_attack_byzfl.py``).
"""

from __future__ import annotations

import torch

from fedloom.attack.base import RoundView, choice, number, reference_of
from fedloom.registry import register
from fedloom.rng import Purpose, numpy_gen, torch_gen

__all__ = ["Canary", "Gaussian", "Inf", "Scaling", "SignFlip", "replacement_scale"]

NOISE = "attack-noise"  # the purpose of the Gaussian attack's stream


class SignFlip:
    """``g_k ↦ −s·g_k`` (``reference: own``, sees its own update) or ``−s·mean(honest)``
    (``reference: honest_mean``, sees every honest update; ByzFL's ``SignFlipping``).

    Reference:
        paper: Li et al., "RSA: Byzantine-Robust Stochastic Aggregation Methods for
            Distributed Learning from Heterogeneous Datasets", AAAI 2019 (sign flipping);
            Allouah et al., AISTATS 2023 / ByzFL (−mean of the honest vectors).
        code: ByzFL 0.0.11 ``byzfl.SignFlipping`` (honest_mean, s = 1): max |difference|
            1.1e-16 on 7 honest rows of d = 1,000, float64, seeded normal
            (tests/test_attack_byzfl.py; the means sum in different orders).
        departures: ``scale`` s (ByzFL: 1).
    """

    def __init__(self, scale: float = 1.0, reference: str = "own") -> None:
        self.scale = number("scale", scale, low=0, strict=True)
        self.reference = choice("reference", reference, ("own", "honest_mean"))
        self.sees = "own" if self.reference == "own" else "honest"

    def __call__(self, view: RoundView) -> torch.Tensor:
        if self.reference == "own":
            return view.own * (-self.scale)
        ref = reference_of(view, "honest")
        mean = ref.mean(dim=0) if ref.shape[0] else view.own.new_zeros(view.own.shape[1])
        return (mean * (-self.scale)).expand_as(view.own).clone()


register("attack", "sign_flip")(SignFlip)


class Gaussian:
    """Each attacker sends ``N(mu, sigma² I)`` (sees nothing); ``shared: true``: one draw
    for all the round's attackers (ByzFL's ``Gaussian``), from ``(seed, round, -1,
    "attack-noise")``, else each its own from ``(seed, round, client, "attack-noise")``.

    Reference:
        paper: Blanchard et al., "Machine Learning with Adversaries: Byzantine Tolerant
            Gradient Descent", NeurIPS 2017 (Gaussian Byzantine workers).
        code: ByzFL 0.0.11 ``byzfl.Gaussian``: a random attack, compared in law: the mean
            and standard deviation of 200,000 draws of each within 4 standard errors
            of (mu, sigma) = (0.5, 2) (tests/test_attack_byzfl.py).
        departures: fedloom's seeded streams, not NumPy's global one; ``shared``.
    """

    sees = "none"

    def __init__(self, mu: float = 0.0, sigma: float = 1.0, shared: bool = False) -> None:
        self.mu = number("mu", mu)
        self.sigma = number("sigma", sigma, low=0)
        if not isinstance(shared, bool):
            raise ValueError(f"attack.options.shared: must be true or false, got {shared!r}")
        self.shared = shared

    def __call__(self, view: RoundView) -> torch.Tensor:
        b, d = view.own.shape
        if self.shared:
            row = torch.randn(d, generator=view.gen(-1, NOISE), dtype=torch.float64)
            return (self.mu + self.sigma * row).expand(b, d).clone()
        return torch.stack([self.mu + self.sigma * torch.randn(
            d, generator=view.gen(k, NOISE), dtype=torch.float64) for k in view.clients])


register("attack", "gaussian")(Gaussian)


def replacement_scale(scale: float | str, server_lr: float, view: RoundView) -> float:
    """``scale``, or for ``"replace"`` Bagdasaryan et al.'s ``γ = n/η`` shared by the
    ``b`` attackers of the round: ``m / (b η)`` (``m`` the cohort, ``η`` the server's
    step size), so that FedAvg's mean step is the attackers' mean update."""
    if scale == "replace":
        return view.cohort / (len(view.clients) * server_lr)
    return float(scale)


def check_scale(scale: object) -> float | str:
    """``scale``: a number > 0 or ``"replace"``."""
    if scale == "replace":
        return "replace"
    return number("scale", scale, low=0, strict=True)


class Scaling:
    """``g_k ↦ γ·g_k`` (sees its own update): a boosted update, or with ``scale: replace``
    model replacement, ``γ = m / (b η)`` (``server_lr`` = η, the server's step size).

    Reference:
        paper: Bagdasaryan et al., "How To Backdoor Federated Learning", AISTATS 2020
            (§3.2 model replacement, γ = n/η); Bhagoji et al., ICML 2019 (boosting).
        code: none needed (a product); tested against γ·g by hand.
        departures: with b attackers in a round each takes 1/b of the replacement.
    """

    sees = "own"

    def __init__(self, scale: float | str = "replace", server_lr: float = 1.0) -> None:
        self.scale = check_scale(scale)
        self.server_lr = number("server_lr", server_lr, low=0, strict=True)

    def __call__(self, view: RoundView) -> torch.Tensor:
        return view.own * replacement_scale(self.scale, self.server_lr, view)


register("attack", "scaling")(Scaling)


class Inf:
    """Every coordinate ``+inf`` (sees nothing): what the server's screening must refuse.

    Reference:
        paper: ByzFL's "Inf" attack (Allouah et al., AISTATS 2023, the library's docs).
        code: ByzFL 0.0.11 ``byzfl.Inf``: equal (every entry +inf).
        departures: none; the engine refuses the row and counts it, never averages it.
    """

    sees = "none"

    def __call__(self, view: RoundView) -> torch.Tensor:
        return torch.full_like(view.own, float("inf"))


register("attack", "inf")(Inf)


class Canary:
    """An audit's canary: ``norm · u_k`` when client ``k`` is in the run, else zero
    (sees nothing).

    Reference:
        paper: Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run",
            NeurIPS 2023 (canaries included independently with probability 1/2).
        code: none (the draws are fedloom's streams).
        departures: a canary is a client whose update is replaced, not an example.
    """

    sees = "none"

    def __init__(self, norm: float = 1.0, seed: int = 0) -> None:
        if isinstance(norm, bool) or not isinstance(norm, int | float) or not 0 < norm < 1e300:
            raise ValueError(f"attack.options.norm: must be a number > 0, got {norm!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"attack.options.seed: must be an integer, got {seed!r}")
        self.norm, self.seed = float(norm), seed

    def included(self, client: int) -> bool:
        """Whether canary ``client`` is in the run (probability 1/2, fixed per seed)."""
        return bool(numpy_gen(self.seed, -1, client, Purpose.AUDIT_MEMBERSHIP).random() < 0.5)

    def direction(self, client: int, d: int) -> torch.Tensor:
        """Canary ``client``'s unit direction in float64 (``d`` entries)."""
        gen = torch_gen(self.seed, -1, client, Purpose.AUDIT_CANARY)
        u = torch.randn(d, generator=gen, dtype=torch.float64)
        return u / torch.linalg.vector_norm(u)

    def __call__(self, view: RoundView) -> torch.Tensor:
        d = view.own.shape[1]  # on the CPU, as the directions are (the stage moves them)
        return torch.stack([self.norm * self.direction(k, d) if self.included(k)
                            else torch.zeros(d, dtype=torch.float64) for k in view.clients])


register("attack", "canary")(Canary)
