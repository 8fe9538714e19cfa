"""Byzantine clients, for robustness experiments (off by default).

A fixed set of ``round(fraction · N)`` clients of the population is drawn once,
from the run's seed and the purpose ``"attack"`` (``fedloom.rng``), so the same
config and seed always give the same attackers, whatever the backend or the
cohort order. Whenever one of them takes part in a round, its honest local
update ``g_k = w − w_k`` is replaced, before it is encoded and sent, by the
attack's transform: the server only sees what arrives, as with a real
faulty or malicious client (it is screened and clipped like any other update).

Attacks (``attack.name``; options in ``attack.options``):

- ``sign_flip``: ``g ↦ −s·g`` (``scale`` = s, default 1): the client pushes
  the model ``s`` times as far against its own descent direction. The
  "sign-flipping" attack of Li et al., "RSA: Byzantine-Robust Stochastic
  Aggregation Methods for Distributed Learning from Heterogeneous Datasets"
  (AAAI 2019), and the scaled reverse-gradient attack used to test Krum,
  median and trimmed mean (e.g. Blanchard et al. 2017; Yin et al. 2018).
- ``canary``: a one-run privacy audit's canary (:mod:`fedloom.canaries`): in the run
  with probability 1/2, it sends ``norm · u_k`` (a unit direction of its own), else
  zero (under a fixed denominator, the sum without it). Steinke et al. 2023.

Adding an attack: a factory ``(options) → callable(update, client, round) →
update`` registered as ``register("attack", NAME)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedloom.config import AttackConfig
from fedloom.registry import build, register
from fedloom.rng import Purpose, numpy_gen, torch_gen

__all__ = ["Attack", "Canary", "SignFlip", "byzantine_clients", "make_attack"]

Transform = Callable[[torch.Tensor, int, int], torch.Tensor]


class SignFlip:
    """``g ↦ −scale·g``.

    Reference:
        paper: Li et al., "RSA: Byzantine-Robust Stochastic Aggregation Methods for Distributed
            Learning from Heterogeneous Datasets", AAAI 2019 (sign flipping).
        code: none needed.
        departures: none.
    """

    def __init__(self, scale: float = 1.0) -> None:
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
            raise ValueError(f"attack.options.scale: must be a number > 0, got {scale!r}")
        self.scale = float(scale)

    def __call__(self, update: torch.Tensor, client: int, round: int) -> torch.Tensor:
        return update * (-self.scale)


register("attack", "sign_flip")(SignFlip)


class Canary:
    """An audit's canary: ``norm · u_k`` when client ``k`` is in the run, else zero.

    Reference:
        paper: Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run",
            NeurIPS 2023 (canaries included independently with probability 1/2).
        code: none (the draws are fedloom's streams).
        departures: a canary is a client whose update is replaced, not an example.
    """

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

    def __call__(self, update: torch.Tensor, client: int, round: int) -> torch.Tensor:
        if not self.included(client):
            return torch.zeros_like(update)
        u = self.direction(client, update.numel()).reshape(update.shape)
        return (self.norm * u).to(update.device, update.dtype)


register("attack", "canary")(Canary)


def byzantine_clients(seed: int, num_clients: int, fraction: float) -> frozenset[int]:
    """``round(fraction · N)`` distinct client ids, from the run's ``(seed, "attack")`` stream."""
    k = round(fraction * num_clients)
    if k == 0:
        return frozenset()
    ids = numpy_gen(seed, -1, -1, "attack").choice(num_clients, k, replace=False)
    return frozenset(int(i) for i in ids)


class Attack:
    """Which clients attack (``clients``) and what they send instead (``transform``)."""

    def __init__(self, clients: frozenset[int], transform: Transform) -> None:
        self.clients, self.transform = clients, transform

    def __call__(self, update: torch.Tensor, client: int, round: int) -> torch.Tensor:
        if client not in self.clients:
            return update
        return self.transform(update, client, round)


def make_attack(cfg: AttackConfig, seed: int, num_clients: int) -> Attack | None:
    """The run's attack, or ``None`` when no client attacks (``attack.fraction = 0``)."""
    transform = build("attack", cfg.name, cfg.options, "attack.options")
    clients = byzantine_clients(seed, num_clients, cfg.fraction)
    return Attack(clients, transform) if clients else None
