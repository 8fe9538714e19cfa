"""Byzantine clients, for robustness experiments (off by default).

A fixed set of ``round(fraction · N)`` clients is drawn once from the run's seed and
the purpose ``"attack"``, so a config and seed always give the same attackers, on any
backend. In each round, after local training and before any client's feedback policy
and codec, the attack stage (:class:`~fedloom.attack.base.Attack`) hands the attack
what it sees (:class:`~fedloom.attack.base.RoundView`: the attackers' own updates and,
for an omniscient one, every honest update of the round) and puts the one row set it
computes for the colluding attackers in their place; each row then goes through its
client's own residual and compressor, as a real client's would. Randomness comes from
``(seed, round, client, purpose)`` (:mod:`fedloom.rng`): a resumed run is bit-identical.

Attacks (``attack.name``; options in ``attack.options``), what each sees:
``sign_flip``, ``scaling``, ``label_flip``, ``backdoor`` (own update; sign_flip with
``reference: honest_mean`` every honest one), ``alie``, ``ipm`` (alias ``foe``),
``minmax``, ``minsum``, ``optimal_ipm``, ``optimal_alie`` (every honest update, or
``knowledge: colluders``), ``mimic`` (every honest update), ``gaussian``, ``inf``,
``canary`` (nothing). Their papers, the public code each was compared with and the
differences measured are in their docstrings (:mod:`.simple`, :mod:`.omniscient`,
:mod:`.optimal`, :mod:`.data`); docs/howto/attacks.md has the table.

Adding an attack: one file with a class following
:class:`~fedloom.attack.base.ByzantineAttack` (``sees``; ``__call__(view) → [b, d]``),
``register("attack", NAME)``, one test.
"""

from __future__ import annotations

from fedloom.attack.base import (
    SEES,
    Attack,
    ByzantineAttack,
    DataPoison,
    RoundView,
    byzantine_clients,
    make_attack,
)
from fedloom.attack.data import Backdoor, LabelFlip
from fedloom.attack.omniscient import ALIE, IPM, Mimic, MinMax, MinSum, alie_z
from fedloom.attack.optimal import OptimalALIE, OptimalIPM
from fedloom.attack.simple import Canary, Gaussian, Inf, Scaling, SignFlip

__all__ = [
    "ALIE",
    "IPM",
    "SEES",
    "Attack",
    "Backdoor",
    "ByzantineAttack",
    "Canary",
    "DataPoison",
    "Gaussian",
    "Inf",
    "LabelFlip",
    "Mimic",
    "MinMax",
    "MinSum",
    "OptimalALIE",
    "OptimalIPM",
    "RoundView",
    "Scaling",
    "SignFlip",
    "alie_z",
    "byzantine_clients",
    "make_attack",
]
