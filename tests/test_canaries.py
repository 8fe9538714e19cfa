"""A private run audited from itself (fedloom.canaries): the bound stays below the
accounted ε on a DP run and rises above it when the noise is switched off."""

from __future__ import annotations

import copy

import pytest
import torch

from fedloom.attack import Canary, RoundView
from fedloom.canaries import audit
from fedloom.config import ConfigError
from fedloom.privacy import Privacy

# 300 clients of 8x8 digits, 100 a round for 3 rounds; the honest clients barely move
# (client.lr 1e-4), so a canary's C·u_k is what the model's move along u_k shows;
# z = 5 claims ε ≈ 1.1 at δ = 1e-5 (PLD, add/remove, fixed-size sampling).
AUDITED = {"name": "audit", "seed": 1, "rounds": 3,
           "data": {"name": "digits", "num_clients": 300, "partition": {"name": "iid"}},
           "model": {"name": "mlp", "options": {"hidden": [16]}},
           "cohort": {"size": 100}, "client": {"lr": 1e-4, "batch_size": 32, "epochs": 1},
           "privacy": {"mode": "central", "clip": 1.0, "noise_multiplier": 5.0,
                       "delta": 1e-5},
           "eval": {"every": 3}}


def test_the_bound_stays_below_the_accounted_epsilon_of_a_private_run():
    res = audit(copy.deepcopy(AUDITED), canaries=200, guesses=50)
    assert res.canaries == 200 and res.guesses == 50 and res.claimed is not None
    assert 0.0 <= res.epsilon_lower <= res.claimed


def test_a_run_whose_noise_is_switched_off_is_caught(monkeypatch):
    # the accountant still claims z = 5; the released sum carries no noise
    release = Privacy.release

    def silent(self, total, state, round, *rest):
        sigma, self.sigma = self.sigma, 0.0
        try:
            return release(self, total, state, round, *rest)
        finally:
            self.sigma = sigma

    monkeypatch.setattr(Privacy, "release", silent)
    res = audit(copy.deepcopy(AUDITED), canaries=200, guesses=50)
    # every top guess right: Bin(50, p) ≥ 50 rejected for p^50 ≤ 0.05, ε ≈ 2.8
    assert res.correct == res.guesses
    assert res.claimed is not None and res.epsilon_lower > 2 * res.claimed


def test_a_canary_is_in_with_probability_one_half_and_sends_its_norm():
    c = Canary(norm=2.0, seed=7)
    ins = [c.included(k) for k in range(2000)]
    assert 900 < sum(ins) < 1100  # Bin(2000, 1/2): ±4.5 σ
    k_in, k_out = ins.index(True), ins.index(False)
    g = torch.randn(2, 50, dtype=torch.float64)

    def sent(own: torch.Tensor, round: int) -> torch.Tensor:
        empty = torch.zeros(0, 50, dtype=torch.float64)
        return c(RoundView(round, 0, (k_in, k_out), own, empty, 2))

    rows = sent(g, 0)
    assert torch.linalg.vector_norm(rows[0]).item() == pytest.approx(2.0, rel=1e-12)
    assert torch.equal(rows, sent(g * 3, 5))  # the same direction every round
    assert not rows[1].any()


@pytest.mark.parametrize("kw,field", [({"canaries": 0, "guesses": 1}, "canaries"),
                                      ({"canaries": 301, "guesses": 1}, "canaries"),
                                      ({"canaries": 10, "guesses": 0}, "guesses")])
def test_bad_audit_settings_are_one_line(kw, field):
    with pytest.raises(ConfigError, match=f"audit: {field}"):
        audit(copy.deepcopy(AUDITED), **kw)
