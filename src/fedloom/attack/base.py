"""The attack stage's contract: what a round shows the attackers and what they send.

An attack is a plug-in (``register("attack", NAME)``; ``attack.options`` are its
factory's keyword arguments) that follows :class:`ByzantineAttack`: it says what it
sees (:attr:`ByzantineAttack.sees`) and maps the round's :class:`RoundView` to the
rows the Byzantine clients of the round send, one computation for all of them (they
collude). The engine runs it on the client side, after local training and before each
client's feedback policy and compressor (:mod:`fedloom.engine.stages.uplink`), so an
attacker's row then goes through its own residual and codec as any client's.

An attack that also poisons its clients' training data (label flipping, a backdoor)
has a :meth:`poison` (applied once, to the run's samples, before any backend gets
them) and may name test sets of its own (:meth:`test_sets`: the attack success rate).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from fedloom.config import AttackConfig
from fedloom.job import ClientResult
from fedloom.registry import build
from fedloom.rng import numpy_gen, torch_gen

__all__ = ["SEES", "Attack", "ByzantineAttack", "DataPoison", "RoundView", "byzantine_clients",
           "make_attack", "number", "reference_of"]

# What an attack reads of the round, besides its clients' own updates:
# "own": each attacker its own update only; "colluders": the Byzantine clients' own
# (honest) updates of the round, pooled; "honest": every honest client's update of the
# round (omniscient); "none": nothing (noise, inf, a canary).
SEES = ("none", "own", "colluders", "honest")


@dataclass(frozen=True)
class RoundView:
    """What the Byzantine clients of round ``round`` see.

    ``clients``: their ids, in cohort order; ``own``: ``[b, d]`` the updates their
    local training made (what each would send if honest), float64; ``honest``:
    ``[h, d]`` the finite updates of the round's honest clients, float64, in cohort
    order (empty unless the attack sees ``"honest"``); ``cohort``: ``m``, the clients
    reporting this round, attackers included; ``seed``: the run's."""

    round: int
    seed: int
    clients: tuple[int, ...]
    own: torch.Tensor
    honest: torch.Tensor
    cohort: int

    def gen(self, client: int, purpose: str) -> torch.Generator:
        """The generator of ``(seed, round, client, purpose)`` (``client=-1``: shared)."""
        return torch_gen(self.seed, self.round, client, purpose)


def reference_of(view: RoundView, knowledge: str) -> torch.Tensor:
    """The rows an attack estimates the honest updates from: the honest clients'
    (``knowledge="honest"``) or the colluders' own finite ones (``"colluders"``). A round
    without any such row (no honest client reported) falls back to the other set, then
    to an empty ``[0, d]``."""
    own = view.own[torch.isfinite(view.own).all(dim=1)]
    first, second = (view.honest, own) if knowledge == "honest" else (own, view.honest)
    return first if first.shape[0] else second


@runtime_checkable
class ByzantineAttack(Protocol):
    """``sees`` (one of :data:`SEES`); ``__call__(view)`` gives the ``[b, d]`` rows
    the round's ``b`` Byzantine clients send, in ``view.clients``' order."""

    sees: str

    def __call__(self, view: RoundView) -> torch.Tensor: ...


@runtime_checkable
class DataPoison(Protocol):
    """An attack on its clients' training data: :meth:`poison` gives the run's samples
    with the attackers' own (``parts[k]`` for ``k`` in ``clients``) changed;
    :meth:`test_sets` the named sets whose accuracy is a metric of the run."""

    def poison(self, x: torch.Tensor, y: torch.Tensor, parts: Mapping[int, np.ndarray],
               num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def test_sets(self, x: torch.Tensor, y: torch.Tensor
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]: ...


def number(name: str, value: Any, *, low: float = -math.inf, strict: bool = False,
           high: float = math.inf) -> float:
    """``value`` as a float in its range, else one line naming ``attack.options.NAME``."""
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if not bad:
        v = float(value)
        bad = not (math.isfinite(v) and (v > low if strict else v >= low) and v <= high)
    if bad:
        rng = f"{'>' if strict else '≥'} {low:g}" + (f" and ≤ {high:g}" if high < math.inf
                                                      else "")
        raise ValueError(f"attack.options.{name}: must be a finite number {rng}, got {value!r}")
    return float(value)


def choice(name: str, value: Any, allowed: Sequence[str]) -> str:
    """``value`` if it is one of ``allowed``, else one line naming the option."""
    if value not in allowed:
        raise ValueError(f"attack.options.{name}: must be one of {', '.join(allowed)}, "
                         f"got {value!r}")
    return str(value)


def byzantine_clients(seed: int, num_clients: int, fraction: float) -> frozenset[int]:
    """``round(fraction · N)`` distinct client ids, from the run's ``(seed, "attack")`` stream."""
    k = round(fraction * num_clients)
    if k == 0:
        return frozenset()
    ids = numpy_gen(seed, -1, -1, "attack").choice(num_clients, k, replace=False)
    return frozenset(int(i) for i in ids)


class Attack:
    """Which clients attack (``clients``), what they run (``attack``), the run's seed."""

    def __init__(self, clients: frozenset[int], attack: ByzantineAttack, seed: int = 0) -> None:
        if not isinstance(attack, ByzantineAttack) or attack.sees not in SEES:
            raise ValueError(f"attack: {type(attack).__name__} is not an attack (it needs "
                             f"sees in {SEES} and __call__(view) -> [b, d] rows)")
        self.clients, self.attack, self.seed = clients, attack, seed

    def round(self, results: Sequence[ClientResult], round: int) -> None:
        """Replace the Byzantine clients' updates in ``results`` (the round's kept
        clients, trained, before anything is sent) by the attack's rows."""
        mine = [i for i, res in enumerate(results) if res.client in self.clients]
        if not mine:
            return
        own = torch.stack([results[i].update.detach().reshape(-1).double() for i in mine])
        d = own.shape[1]
        honest = own.new_zeros(0, d)
        if self.attack.sees == "honest":
            rows = [res.update.detach().reshape(-1).double() for i, res in enumerate(results)
                    if res.client not in self.clients]
            if rows:
                honest = torch.stack(rows)
                honest = honest[torch.isfinite(honest).all(dim=1)]
        view = RoundView(round, self.seed, tuple(results[i].client for i in mine), own, honest,
                         len(results))
        sent = self.attack(view)
        if sent.shape != (len(mine), d):
            raise ValueError(f"attack: {type(self.attack).__name__} gave rows of shape "
                             f"{tuple(sent.shape)}, expected {(len(mine), d)}")
        for j, i in enumerate(mine):
            u = results[i].update
            results[i].update = sent[j].to(u.device, u.dtype).reshape(u.shape)

    @property
    def poisons(self) -> bool:
        """Whether the attack changes its clients' training samples (:class:`DataPoison`)."""
        return isinstance(self.attack, DataPoison)

    def poison(self, x: torch.Tensor, y: torch.Tensor, parts: Sequence[np.ndarray],
               num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's samples with the attackers' training data poisoned (an attack
        without :meth:`DataPoison.poison`: unchanged). A sample that is also an honest
        client's cannot be the attacker's alone: refused in one line."""
        if not isinstance(self.attack, DataPoison):
            return x, y
        seen = np.zeros(x.shape[0], dtype=bool)
        for k, idx in enumerate(parts):
            if k not in self.clients:
                seen[idx] = True
        mine = {k: np.asarray(parts[k]) for k in sorted(self.clients)}
        if any(seen[idx].any() for idx in mine.values()):
            raise ValueError("attack.name: a data-poisoning attack needs the attackers' "
                             "training samples to be theirs alone (the partition shares "
                             "samples with honest clients)")
        return self.attack.poison(x, y, mine, num_classes, self.seed)

    def test_sets(self, x: torch.Tensor, y: torch.Tensor
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The attack's named test sets (a backdoor's triggered images), or none."""
        return self.attack.test_sets(x, y) if isinstance(self.attack, DataPoison) else {}


def make_attack(cfg: AttackConfig, seed: int, num_clients: int) -> Attack | None:
    """The run's attack, or ``None`` when no client attacks (``attack.fraction = 0``)."""
    attack = build("attack", cfg.name, cfg.options, "attack.options")
    clients = byzantine_clients(seed, num_clients, cfg.fraction)
    return Attack(clients, attack, seed) if clients else None
