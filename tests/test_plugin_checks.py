"""Plug-ins checked at the door: before round 1 each aggregator, server step and
local-step term of one's own runs on a synthetic input of the run's shapes, and a
broken one is one line naming the field, the class and method, the protocol and
what came back (fedloom.aggregate.checks, fedloom.server_opt.checks,
fedloom.client.transforms.check_local_transforms). A run whose first rounds all skip
the step stops with one line (fedloom.engine.runs.stepped.NEVER_STEPPED_ROUNDS)."""

from __future__ import annotations

import copy
import re
from typing import ClassVar

import pytest
import torch

import fedloom
from conftest import TINY
from fedloom.cli import main
from fedloom.compress.base import pack, unpack_header
from fedloom.config import ConfigError
from fedloom.engine.runs.stepped import NEVER_STEPPED_ROUNDS
from fedloom.server_opt import chain, heavy_ball, optimizers, scale


def _cfg(rounds: int = 2) -> dict:
    return {**copy.deepcopy(TINY), "rounds": rounds, "checkpoint": {"every": 0},
            "server": {"lr": 1.0}}


def _one_line(match: str, **components) -> str:
    with pytest.raises(ConfigError, match=match) as err:
        fedloom.run(_cfg(), **components)
    assert "\n" not in str(err.value)
    return str(err.value)


# ------------------------------------------------------------------ the broken ones
class Mean:
    """A well-formed aggregator: the sample-weighted mean."""

    def init(self, layout):
        return None

    def __call__(self, updates, weights, state, *, info=None):
        p = weights.to(updates.dtype) / weights.sum()
        return p @ updates, state, {"rows": float(len(updates))}


class TwoValues(Mean):
    def __call__(self, updates, weights, state, *, info=None):
        return super().__call__(updates, weights, state, info=info)[:2]


class OneShort(Mean):
    def __call__(self, updates, weights, state, *, info=None):
        agg, state, metrics = super().__call__(updates, weights, state, info=info)
        return agg[:-1], state, metrics


class NotFinite(Mean):
    def __call__(self, updates, weights, state, *, info=None):
        agg, state, metrics = super().__call__(updates, weights, state, info=info)
        return agg / 0.0, state, metrics


class TNoInit:
    def update(self, D, state, ctx):
        return D, state


class TDOnly:
    def init(self, W):
        return None

    def update(self, D, state, ctx):
        return D


class NoneState:
    """A server term whose update returns None as its state: the second call reads it."""

    def init(self, w):
        return {"v": torch.zeros_like(w)}

    def update(self, d, state, w):
        return 0.9 * state["v"] + d, None


def test_an_aggregator_returning_two_values_is_one_line():
    _one_line(r"^aggregator: TwoValues\.__call__ returned 2 values, the Aggregator protocol "
              r"returns 3 \(direction, state, metrics\)$", aggregator=TwoValues())


def test_an_aggregate_one_element_short_is_one_line():
    msg = _one_line(r"^aggregator: OneShort\.__call__ returned a direction of shape \(\d+,\), "
                    r"expected \(\d+,\)$", aggregator=OneShort())
    got, want = map(int, re.findall(r"\((\d+),\)", msg))
    assert got == want - 1


def test_an_aggregate_that_is_not_finite_is_one_line():
    _one_line(r"^aggregator: NotFinite\.__call__ returned a direction that is not finite "
              r"for a finite input$", aggregator=NotFinite())


def test_a_transform_without_init_is_one_line():
    _one_line(r"^client\.transforms\[0\]: TNoInit has no init; the Transform protocol is "
              r"init\(w\) -> state and update\(d, state, ctx\) -> \(direction, state\)",
              transforms=[TNoInit()])


def test_a_transform_returning_the_direction_only_is_one_line():
    _one_line(r"^client\.transforms\[0\]: TDOnly\.update returned a tensor of shape \(\d+,\), "
              r"the Transform protocol returns 2 \(direction, state\)$", transforms=[TDOnly()])


def test_a_server_term_returning_none_state_fails_the_round_trip():
    _one_line(r"^server\.optimizer \(chain term 0\): NoneState\.update raised TypeError: .* on "
              r"the state its first call returned \(state round-trip\)$",
              server=chain(NoneState(), scale(1.0)))


def test_a_named_optimizer_inside_a_chain_is_refused_with_the_chain_to_write():
    _one_line(r"^server\.optimizer: chain term 0, ServerOptimizer, is a server step \(init, "
              r"step\), not a server transform \(init, update\); chain its transforms instead: "
              r"server=chain\(HeavyBall\(beta=0\.9\), Scale\(factor=1\.0\), "
              r"Scale\(factor=0\.5\)\)$",
              server=chain(optimizers.momentum(momentum=0.9), scale(0.5)))


def test_a_server_transform_given_as_the_server_step_is_refused():
    _one_line(r"^server\.optimizer: Scale is a server transform \(init, update\), not a server "
              r"step \(init, step\); use server=chain\(Scale\(factor=0\.5\)\)$",
              server=scale(0.5))


def test_a_server_optimizer_given_as_a_local_term_is_refused():
    _one_line(r"^client\.transforms\[0\]: ServerOptimizer is a server step \(init, step\), not "
              r"a local-step transform \(init, update\)", transforms=[optimizers.momentum()])


def test_an_aggregator_by_reference_is_checked_and_the_cli_exits_2(tmp_path, monkeypatch,
                                                                    capsys):
    (tmp_path / "two_values.py").write_text(
        "class Rule:\n"
        "    def init(self, layout):\n        return None\n"
        "    def __call__(self, updates, weights, state, *, info=None):\n"
        "        return updates.mean(0), state\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "tiny.yaml"
    import yaml
    path.write_text(yaml.safe_dump(_cfg()))
    capsys.readouterr()
    rc = main(["run", str(path), "aggregator.name=two_values:Rule", "--out",
               str(tmp_path / "run"), "--quiet"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1, err
    assert err[0].endswith("aggregator: Rule.__call__ returned 2 values, the Aggregator "
                           "protocol returns 3 (direction, state, metrics)"), err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before round 1


# ------------------------------------------------------------------ the well-formed ones
class Wrapped:
    """fedloom's FedAvg behind a class of one's own (so the check runs it), with a
    round counter kept in the object: the check runs on a copy."""

    def __init__(self):
        self.inner, self.calls = fedloom.make_aggregator("fedavg"), 0

    def init(self, layout):
        return self.inner.init(layout)

    def __call__(self, updates, weights, state, *, info=None):
        self.calls += 1
        return self.inner(updates, weights, state, info=info)


class Clip:
    """A local term: D clipped to norm c (state: how many steps were clipped)."""

    def init(self, W):
        return 0

    def update(self, D, state, ctx):
        n = float(torch.linalg.vector_norm(D))
        return (D * (1.0 / n) if n > 1.0 else D), state + int(n > 1.0)


class Ball:
    """The server's heavy ball, written as a user would."""

    def init(self, w):
        return {"v": torch.zeros_like(w)}

    def update(self, d, state, w):
        v = 0.9 * state["v"] + d
        return v, {"v": v}


def test_well_formed_plugins_run_as_the_builtins_they_equal():
    """The check draws no global random number, touches no run state and leaves the
    objects as given: each plug-in gives the built-in's model bit for bit."""
    agg = Wrapped()
    torch.manual_seed(0)
    ours = fedloom.run(_cfg(3), aggregator=agg, server=chain(Ball(), scale(1.0)))
    after_ours = torch.rand(1)
    torch.manual_seed(0)
    ref = fedloom.run(_cfg(3), ["server.optimizer=momentum",
                                "server.optimizer.options.momentum=0.9"])
    assert torch.equal(after_ours, torch.rand(1))
    assert ours.summary["model_sha256"] == ref.summary["model_sha256"]
    assert agg.calls == 3 and ours.summary["rejected_rounds_total"] == 0
    clipped = fedloom.run(_cfg(), transforms=[Clip()])
    assert clipped.summary["rejected_rounds_total"] == 0


def test_a_chain_of_builtin_terms_and_a_named_optimizer_still_run():
    a = fedloom.run(_cfg(), server=chain(heavy_ball(0.9), scale(1.0)))
    b = fedloom.run(_cfg(), server=optimizers.momentum(momentum=0.9))
    assert a.summary["model_sha256"] == b.summary["model_sha256"]


# ------------------------------------------------------------------ never stepped
class FailsAfter(Mean):
    """Passes the check at the door (its first two calls), then fails on the
    rounds' calls numbered in ``bad`` (1-based, counted across instances)."""

    calls: ClassVar[int] = 0
    bad: ClassVar[frozenset[int]] = frozenset()

    def __call__(self, updates, weights, state, *, info=None):
        FailsAfter.calls += 1
        if FailsAfter.calls - 2 in FailsAfter.bad:
            raise ValueError("the cohort's system is singular")
        return super().__call__(updates, weights, state, info=info)


@pytest.mark.parametrize("rounds", [NEVER_STEPPED_ROUNDS, 2, NEVER_STEPPED_ROUNDS + 2])
def test_a_run_that_never_steps_stops_with_one_line(monkeypatch, rounds):
    monkeypatch.setattr(FailsAfter, "calls", 0)
    monkeypatch.setattr(FailsAfter, "bad", frozenset(range(1, 100)))
    k = min(rounds, NEVER_STEPPED_ROUNDS)
    with pytest.raises(ConfigError, match=(
            r"^aggregator: object test_plugin_checks\.FailsAfter: the step was skipped in each "
            rf"of the first {k} rounds \(round 1: the aggregator failed \(ValueError: the "
            r"cohort's system is singular\)\); stopped rather than return the starting model$")):
        fedloom.run(_cfg(rounds), aggregator=FailsAfter())
    assert FailsAfter.calls == 2 + k  # it stopped at round k


def test_a_run_that_steps_in_one_of_its_first_rounds_goes_on(monkeypatch):
    monkeypatch.setattr(FailsAfter, "calls", 0)
    skipped = frozenset(range(1, NEVER_STEPPED_ROUNDS))  # all but the K-th
    monkeypatch.setattr(FailsAfter, "bad", skipped)
    res = fedloom.run(_cfg(NEVER_STEPPED_ROUNDS + 1), aggregator=FailsAfter())
    assert [m["rejected_rounds"] for m in res.metrics] == [
        int(r + 1 in skipped) for r in range(NEVER_STEPPED_ROUNDS + 1)]
    assert res.summary["rejected_rounds_total"] == len(skipped)


# ------------------------------------------------------------------ compressors
class Raw:
    """A well-formed compressor: the float32 values as they are, after fedloom's header."""

    name, checksum, codec = "raw", False, 200

    def encode(self, x, *, gen=None):
        body = x.detach().to(torch.float32).cpu().numpy().tobytes()
        return pack(self.codec, x.numel(), body, self.checksum)

    def decode(self, payload, d=None):
        _, body = unpack_header(payload, self.codec, d, self.checksum)
        return torch.frombuffer(bytearray(body), dtype=torch.float32)


class NoHeader(Raw):
    def encode(self, x, *, gen=None):
        return x.detach().to(torch.float32).cpu().numpy().tobytes()


class SendsTheTensor(Raw):
    def encode(self, x, *, gen=None):
        return x


class DecodesShort(Raw):
    def decode(self, payload, d=None):
        return super().decode(payload, d)[1:]


def test_a_compressor_sending_a_tensor_is_one_line():
    _one_line(r"^compression: SendsTheTensor\.encode returned a tensor of shape \(\d+,\), the "
              r"Compressor protocol is encode\(x, \*, gen\) -> bytes and decode\(payload, d\) "
              r"-> vector$", compressor=SendsTheTensor())


def test_a_compressor_without_the_payload_header_is_one_line():
    _one_line(r"^compression: NoHeader\.encode returned \d+ bytes without fedloom's payload "
              r"header \(coordinates_sent: bad magic .*\); write it with "
              r"fedloom\.compress\.base\.pack\(codec, d, body, checksum\)$",
              compressor=NoHeader())


def test_a_compressor_decoding_short_is_one_line():
    _one_line(r"^compression: DecodesShort\.decode returned a vector of shape \(\d+,\), "
              r"expected \(\d+,\)$", compressor=DecodesShort())


def test_a_well_formed_compressor_runs():
    res = fedloom.run(_cfg(), compressor=Raw())
    ref = fedloom.run(_cfg())
    assert res.summary["rejected_updates_total"] == 0
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]  # lossless


class UnitDirection:
    """A term written for one client's [d] only: torch.dot takes 1-D tensors."""

    def init(self, W):
        return None

    def update(self, D, state, ctx):
        return D / torch.dot(D, D).sqrt(), state


def test_a_term_for_one_client_only_is_refused_on_a_batched_backend():
    res = fedloom.run(_cfg(), transforms=[UnitDirection()])  # sequential: [d]
    assert res.summary["rejected_rounds_total"] == 0
    with pytest.raises(ConfigError, match=(
            r"^client\.transforms\[0\]: UnitDirection\.update raised RuntimeError: .* on a "
            r"synthetic direction of shape \(2, \d+\)$")):
        fedloom.run(_cfg(), ["backend.name=vmap"], transforms=[UnitDirection()])
