"""A private run audited from itself: canary clients, their scores, and a lower bound on ε.

:func:`audit` runs a config with ``m`` of its clients made canaries (the attack
``canary`` of :mod:`fedloom.attack`: each in the run with probability 1/2, then
sending ``C · u_k``, a unit direction of its own, at the clip norm ``C``). After the
last round each canary is scored by how far the model moved along its direction,
``s_k = ⟨w_0 − w_T, u_k⟩`` (the server steps against the mean update, so an included
canary pulls ``w`` along ``−u_k``); the ``guesses`` highest scores are guessed "in"
and, with ``abstain=False``, the rest "out". The number right gives the bound of
:func:`fedloom.audit.epsilon_lower_bound` at the run's ``privacy.delta``: with
probability ``1 − beta`` the run's true ε is at least that, whatever its accountant
claims (``claimed``: the ``dp_epsilon`` of its last round).

Steinke, Nasr & Jagielski, "Privacy Auditing with One (1) Training Run", NeurIPS 2023
(§6: gradient canaries, guessing only the top scores). Departure: a canary is a whole
client whose update is replaced, so the unit audited is fedloom's (a client).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedloom.attack import Canary
from fedloom.audit import epsilon_lower_bound
from fedloom.config import Config, ConfigError, load_config
from fedloom.engine.experiment import Experiment

__all__ = ["AuditResult", "audit"]


@dataclass(frozen=True)
class AuditResult:
    """What one audited run showed (see the module docstring)."""

    canaries: int          # m
    guesses: int           # r
    correct: int           # v
    epsilon_lower: float   # the bound at confidence 1 − beta
    claimed: float | None  # the accountant's ε after the last round (None: no privacy)
    beta: float
    delta: float


def _config(config: str | Path | dict[str, Any] | Config, overrides: Sequence[str],
            canaries: int) -> Config:
    cfg = load_config(config, list(overrides))
    n = cfg.data.num_clients
    if isinstance(canaries, bool) or not isinstance(canaries, int) or not 1 <= canaries <= n:
        raise ConfigError(f"audit: canaries must be an integer in 1 … data.num_clients={n}, "
                          f"got {canaries!r}")
    if cfg.attack.fraction > 0 and cfg.attack.name != "canary":
        raise ConfigError(f"audit: the run already has an attack ({cfg.attack.name}); an "
                          "audit's canaries take the attack section")
    return load_config(config, [*overrides, "attack.name=canary",
                                f"attack.fraction={canaries / n!r}",
                                f"attack.options={{norm: {cfg.privacy.clip!r}, "
                                f"seed: {cfg.seed}}}"])


def audit(config: str | Path | dict[str, Any] | Config, overrides: Sequence[str] = (), *,
          canaries: int, guesses: int, abstain: bool = True, beta: float = 0.05
          ) -> AuditResult:
    """Run ``config`` in memory with ``canaries`` canary clients and bound its ε."""
    cfg = _config(config, overrides, canaries)
    if isinstance(guesses, bool) or not isinstance(guesses, int) or not 1 <= guesses:
        raise ConfigError(f"audit: guesses must be an integer ≥ 1, got {guesses!r}")
    exp = Experiment.from_config(cfg)
    try:
        ids = sorted(exp.around.attack.clients) if exp.around.attack is not None else []
        if guesses > len(ids):
            raise ConfigError(f"audit: guesses={guesses} is more than the {len(ids)} canaries "
                              "drawn")
        st = exp.init()
        w0 = st.w.detach().to("cpu", torch.float64).clone()
        metrics: dict[str, Any] = {}
        for _ in range(cfg.rounds):
            st, metrics = exp.round(st)
        moved = w0 - st.w.detach().to("cpu", torch.float64)
    finally:
        exp.close()
    canary = Canary(cfg.privacy.clip, cfg.seed)
    scores = torch.stack([moved @ canary.direction(k, moved.numel()) for k in ids])
    order = torch.argsort(scores, descending=True, stable=True).tolist()
    truth = [canary.included(ids[i]) for i in order]
    right = sum(truth[:guesses]) + (0 if abstain else sum(not t for t in truth[guesses:]))
    r = guesses if abstain else len(ids)
    claimed = metrics.get("dp_epsilon")
    return AuditResult(len(ids), r, right,
                       epsilon_lower_bound(len(ids), r, right, delta=cfg.privacy.delta,
                                           beta=beta),
                       float(claimed) if claimed is not None else None, beta, cfg.privacy.delta)
