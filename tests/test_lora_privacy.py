"""User-level differential privacy for LoRA fine-tuning (issue #55, item 5): each client
is a user (``data.partition: natural``, one role's lines), and DP-FedAvg clips and
noises each user's adapter update. On the tiny random-init Llama of tests/test_llm.py:
only the adapters change and travel (the frozen base is bit-equal after a private
run); one user moves the adapters by at most C a round (the clip norm is the adapter
vector's: the Layout holds nothing else); FFA-LoRA's frozen A is never noised; ε is
recorded for the unit "a user's whole data" (add/remove one client)."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("transformers", reason="the llm extra (transformers) is not installed")
pytest.importorskip("peft", reason="the llm extra (peft) is not installed")

import fedloom
import test_llm
from fedloom.accounting import Accountant
from fedloom.config import load_config
from fedloom.engine.experiment import Experiment
from fedloom.privacy import epsilon_central
from test_llm import ADAPTERS, tiny_model
from test_lora_runs import adapters, config

corpus = test_llm.corpus  # the fixture play: 4 roles, 4 users
USERS, COHORT = 4, 2


def _cfg(corpus, rounds: int, clip: float | None, z: float = 0.0, **over):
    # RDP: its ε of these few rounds costs milliseconds (a PLD at q = 0.5, seconds)
    priv = ({} if clip is None else
            {"privacy": {"mode": "central", "clip": clip, "noise_multiplier": z,
                         "delta": 1e-5, "accountant": "rdp"}})
    return config(corpus, rounds=rounds, server={"lr": 1.0}, **priv, **over)


def _run(cfg) -> tuple[fedloom.Result, list[float]]:
    """The run and each round's ‖w_{t+1} − w_t‖ over the adapter vector."""
    exp = Experiment.from_config(load_config(cfg))
    try:
        ws = [exp.init().w.detach().double()]
    finally:
        exp.close()

    def keep(state, metrics):
        ws.append(state.w.detach().double().clone())

    res = fedloom.run(cfg, callbacks=[keep])
    return res, [float((b - a).norm()) for a, b in itertools.pairwise(ws)]


def test_only_the_adapters_are_noised_sent_and_changed_and_epsilon_is_recorded(corpus):
    base = {n: p.detach().clone() for n, p in tiny_model().named_parameters()
            if not p.requires_grad}
    res, _ = _run(_cfg(corpus, 2, clip=0.05, z=1.0))
    # the flat vector, every payload and the noise are the adapters'
    assert res.layout.size == ADAPTERS
    assert all(".lora_A." in n or ".lora_B." in n for n in res.layout.names)
    assert [m["uplink_bytes"] for m in res.metrics] == [COHORT * (ADAPTERS * 4 + 12)] * 2
    after = dict(res.model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in base.items())  # the base, bit-equal
    assert torch.isfinite(res.w).all() and float(res.w.abs().sum()) > 0
    # ε for a user's whole data: 2 rounds, 2 of 4 users a round, z = 1, δ = 1e-5
    want = epsilon_central(2, num_clients=USERS, cohort=COHORT, noise_multiplier=1.0,
                           delta=1e-5, accountant="rdp")
    assert want == Accountant("rdp", "fixed", "add_remove").epsilon(0.5, 1.0, 2, 1e-5)
    assert res.summary["dp_epsilon"] == res.metrics[-1]["dp_epsilon"] == want
    assert res.summary["dp_accounting"] == {"accountant": "rdp", "neighbours": "add_remove",
                                            "sampling": "fixed-size, without replacement",
                                            "rate": 0.5}


def test_one_user_moves_the_adapters_by_at_most_the_clip_a_round(corpus):
    """z = 0 leaves the clip alone: each user's adapter update is clipped to C over
    the adapter vector, the sum of 2 over m̄ = 2 with a server step of 1 moves the
    adapters by at most C; without privacy the same rounds move them far more."""
    c = 1e-3
    res, steps = _run(_cfg(corpus, 2, clip=c))
    assert len(steps) == 2 and all(0 < s <= c * (1 + 1e-5) for s in steps), steps
    assert all(m["dp_clipped"] == COHORT for m in res.metrics)  # every user clipped
    _, plain = _run(_cfg(corpus, 1, clip=None))
    assert plain[0] > 10 * c


def test_ffa_lora_keeps_a_frozen_and_noise_free(corpus):
    a_init = adapters(tiny_model(), "A")
    ffa = fedloom.run(_cfg(corpus, 1, clip=0.05, z=1.0, train="b"))
    assert ffa.layout.size == ADAPTERS // 2  # B alone is clipped, noised and sent
    assert all(".lora_B." in n for n in ffa.layout.names)
    got = adapters(ffa.model, "A")
    assert all(torch.equal(got[n], a) for n, a in a_init.items())
    assert float(ffa.w.abs().sum()) > 0  # B moved (noise and updates)
