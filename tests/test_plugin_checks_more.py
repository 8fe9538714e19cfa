"""Plug-ins checked at the door, the client side: before round 1 each error-feedback
policy, local method and client selector of one's own runs two rounds on a
synthetic input of the run's shapes (fedloom.compress.feedback.checks,
fedloom.client.checks, fedloom.selection.checks), and a broken one is one line
naming the field, the class and method and what came back. A well-formed one
trains exactly as it would without the check (the probe draws from its own
streams, on copies). The Flower strategy stops as the engine does when its first
rounds all skip the step (fedloom.engine.runs.stepped.NEVER_STEPPED_ROUNDS)."""

from __future__ import annotations

import copy
import textwrap

import numpy as np
import pytest
import torch
import yaml

import fedloom
from conftest import TINY
from fedloom.cli import main
from fedloom.client.methods import LocalMethod
from fedloom.compress.feedback import NoFeedback, UplinkResult
from fedloom.config import ConfigError
from fedloom.state import FieldSpec


def _cfg(rounds: int = 2, **over) -> dict:
    return {**copy.deepcopy(TINY), "rounds": rounds, "checkpoint": {"every": 0},
            "server": {"lr": 1.0}, **over}


TOPK = {"name": "topk", "options": {"ratio": 0.1}}


def _one_line(match: str, cfg: dict | None = None, **components) -> str:
    with pytest.raises(ConfigError, match=match) as err:
        fedloom.run(cfg or _cfg(), **components)
    assert "\n" not in str(err.value)
    return str(err.value)


# ------------------------------------------------------------ error-feedback policies
class Residual(NoFeedback):
    """EF written as a user would (architecture.md's LeakyEF at decay 1): send
    C(g + e), keep e ← u − C(u); a count of its uplinks kept in the object."""

    def __init__(self):
        self.calls = 0

    def fields(self, d):
        return {"residual": FieldSpec(d)}

    def uplink(self, g, state, comp, ctx, server):
        self.calls += 1
        u = g + state["residual"]
        p = comp.encode(u, gen=ctx.gen)
        sent = comp.decode(p, u.numel()).to(u.device, u.dtype)
        e = u - sent
        return UplinkResult(p, sent, {"residual": e}, float(torch.linalg.vector_norm(e)))


class UplinkTuple(Residual):
    def uplink(self, g, state, comp, ctx, server):
        up = super().uplink(g, state, comp, ctx, server)
        return up.payload, up.sent, up.state


class ResidualShort(Residual):
    def uplink(self, g, state, comp, ctx, server):
        up = super().uplink(g, state, comp, ctx, server)
        up.state = {"residual": up.state["residual"][:-1]}
        return up


class NaNRow(Residual):
    def server_row(self, up, state, server):
        return up.decoded * float("nan")


class ForgetsTheResidual(Residual):
    """Keeps its residual in the server state under a key its end_round drops: the
    second round's uplink reads what the first returned (state round-trip)."""

    def init_server(self, w):
        return {"seen": 0}

    def end_round(self, ups, server, num_clients, probes):
        end = super().end_round(ups, server, num_clients, probes)
        end.server = {}
        return end

    def uplink(self, g, state, comp, ctx, server):
        server["seen"] += 1
        return super().uplink(g, state, comp, ctx, server)


class NoUplink:
    """Not a NoFeedback subclass, and without an uplink."""

    name = "mine"

    def fields(self, d):
        return {}


def test_a_feedback_uplink_returning_a_tuple_is_one_line():
    _one_line(r"^compression\.feedback: UplinkTuple\.uplink returned 3 values, expected a "
              r"fedloom\.compress\.feedback\.UplinkResult\(payload, sent, state\)$",
              _cfg(compression=TOPK), feedback=UplinkTuple())


def test_a_feedback_residual_one_short_is_one_line():
    _one_line(r"^compression\.feedback: ResidualShort\.uplink returned a state\['residual'\] "
              r"of shape \((\d+),\), expected \(\d+,\)$", _cfg(compression=TOPK),
              feedback=ResidualShort())


def test_a_feedback_row_that_is_not_finite_is_one_line():
    _one_line(r"^compression\.feedback: NaNRow\.server_row returned a row that is not finite "
              r"for a finite input$", _cfg(compression=TOPK), feedback=NaNRow())


def test_a_feedback_state_that_does_not_round_trip_is_one_line():
    _one_line(r"^compression\.feedback: ForgetsTheResidual\.uplink raised KeyError: 'seen' on "
              r"the state its first round returned \(state round-trip\)$",
              _cfg(compression=TOPK), feedback=ForgetsTheResidual())


def test_a_feedback_policy_without_uplink_is_one_line():
    _one_line(r"^compression\.feedback: NoUplink has no init_server and alpha and start_point "
              r"and grad_shift and penalty and uplink and server_row and end_round and "
              r"round_metrics and probes_smoothness; a feedback policy subclasses "
              r"fedloom\.compress\.feedback\.NoFeedback", feedback=NoUplink())


def test_a_well_formed_feedback_policy_gives_the_builtins_model():
    fb = Residual()
    torch.manual_seed(0)
    ours = fedloom.run(_cfg(3, compression=TOPK), feedback=fb)
    after = torch.rand(1)
    torch.manual_seed(0)
    ref = fedloom.run(_cfg(3, compression={**TOPK, "feedback": "ef"}))
    assert torch.equal(after, torch.rand(1))  # no global draw
    assert ours.summary["model_sha256"] == ref.summary["model_sha256"]
    assert fb.calls == 3 * TINY["cohort"]["size"]  # the probe ran on a copy


# ------------------------------------------------------------ local methods
class Counted(LocalMethod):
    """Plain local SGD that counts, in a row of its own, the rounds each client
    trained, and its own calls in the object."""

    def __init__(self):
        self.calls = 0

    def fields(self, d):
        return {"rounds": FieldSpec(1)}

    def run(self, trainer, job):
        self.calls += 1
        res = super().run(trainer, job)
        res.state = {"rounds": job.state["rounds"] + 1}
        return res


class RunTuple(LocalMethod):
    def run(self, trainer, job):
        res = super().run(trainer, job)
        return res.update, res.loss


class UpdateShort(LocalMethod):
    def run(self, trainer, job):
        res = super().run(trainer, job)
        res.update = res.update[1:]
        return res


class NaNUpdate(LocalMethod):
    def run(self, trainer, job):
        res = super().run(trainer, job)
        res.update = res.update * float("nan")
        return res


class DropsItsRow(Counted):
    """Reads its row each round, returns none: the second round reads what the
    first returned (state round-trip)."""

    def run(self, trainer, job):
        res = super().run(trainer, job)
        res.state = {}
        return res


class WrongServer(LocalMethod):
    """Its server_update returns the new rows' tensor, not a dict of its state."""

    def server_update(self, server, old, new, num_clients):
        return torch.zeros(1)


class BareMethod:
    """Not a LocalMethod subclass: prepare and run only."""

    def prepare(self, job, server):
        return job

    def run(self, trainer, job):
        return trainer.run(job)


def test_a_method_run_returning_a_tuple_is_one_line():
    _one_line(r"^client\.method: RunTuple\.run returned 2 values, expected a "
              r"fedloom\.job\.ClientResult$", method=RunTuple())


def test_a_method_update_one_short_is_one_line():
    _one_line(r"^client\.method: UpdateShort\.run returned a update of shape \(\d+,\), "
              r"expected \(\d+,\)$", method=UpdateShort())


def test_a_method_update_that_is_not_finite_is_one_line():
    _one_line(r"^client\.method: NaNUpdate\.run returned a update that is not finite for a "
              r"finite input$", method=NaNUpdate())


def test_a_method_without_its_declared_row_is_one_line():
    _one_line(r"^client\.method: DropsItsRow\.run returned state rows without 'rounds', a "
              r"field its fields\(\) declared$", method=DropsItsRow())


def test_a_method_server_state_that_is_not_a_dict_is_one_line():
    _one_line(r"^client\.method: WrongServer\.server_update returned a tensor of shape \(1,\) "
              r"as its server state, expected a dict$", method=WrongServer())


def test_a_method_without_the_hooks_is_one_line():
    _one_line(r"^client\.method: BareMethod has no check_trainer and fields and init_server "
              r"and complete and server_update and adjust_model and personal_models and "
              r"personal; a local "
              r"method subclasses fedloom\.client\.methods\.LocalMethod", method=BareMethod())


def test_a_well_formed_method_gives_local_sgds_model():
    m = Counted()
    torch.manual_seed(0)
    ours = fedloom.run(_cfg(3), method=m)
    after = torch.rand(1)
    torch.manual_seed(0)
    ref = fedloom.run(_cfg(3))
    assert torch.equal(after, torch.rand(1))
    assert ours.summary["model_sha256"] == ref.summary["model_sha256"]
    assert m.calls == 3 * TINY["cohort"]["size"]


class Dropout(torch.nn.Module):
    """A model whose train-mode forward draws from torch's global generator."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16),
                                        torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                        torch.nn.Linear(16, 10))

    def forward(self, x):
        return self.body(x)


def test_the_method_probe_leaves_a_dropout_models_run_as_it_was():
    """The probe's local step draws dropout masks; they come from a forked stream."""
    torch.manual_seed(1)
    net = Dropout()
    ours = fedloom.run(_cfg(2), model=net, method=Counted())
    ref = fedloom.run(_cfg(2), model=net)
    assert ours.summary["model_sha256"] == ref.summary["model_sha256"]


# ------------------------------------------------------------ client selectors
class Uniformly:
    """The built-in uniform draw, written as a user would, with its calls kept."""

    def __init__(self):
        self.calls = 0

    def init(self, num_clients):
        return {}

    def select(self, r, candidates, size, state, gen):
        self.calls += 1
        chosen = candidates if len(candidates) <= size else gen.choice(candidates, size,
                                                                       replace=False)
        return np.sort(chosen).astype(np.int64), state

    def observe(self, state, feedback):
        return state


class IdsOnly(Uniformly):
    def select(self, r, candidates, size, state, gen):
        return super().select(r, candidates, size, state, gen)[0]


class OneTooMany(Uniformly):
    def select(self, r, candidates, size, state, gen):
        return candidates[: size + 1], state


class Outsider(Uniformly):
    def select(self, r, candidates, size, state, gen):
        return np.arange(size) + len(candidates) - 1, state


class SetState(Uniformly):
    def init(self, num_clients):
        return {"seen": set()}


class ObservesNothing(Uniformly):
    def observe(self, state, feedback):
        state = dict(state)
        state["last"] = feedback.clients.tolist()


class NoObserve:
    def init(self, num_clients):
        return {}

    def select(self, r, candidates, size, state, gen):
        return candidates[:size], state


def test_a_selector_returning_the_ids_only_is_one_line():
    _one_line(r"^cohort\.selection: IdsOnly\.select returned a ndarray, the Selector protocol "
              r"returns 2 \(ids, state\)$", selector=IdsOnly())


def test_a_selector_choosing_one_too_many_is_one_line():
    n = TINY["cohort"]["size"]
    _one_line(rf"^cohort\.selection: OneTooMany\.select returned {n + 1} ids \({n + 1} "
              rf"distinct\), expected {n} distinct ids \(min\(size, len\(candidates\)\)\)$",
              selector=OneTooMany())


def test_a_selector_choosing_a_client_that_is_not_a_candidate_is_one_line():
    n = TINY["data"]["num_clients"]
    _one_line(rf"^cohort\.selection: Outsider\.select returned id {n}, not among the "
              rf"candidates \(0 … {n - 1}\)$", selector=Outsider())


def test_a_selector_state_a_checkpoint_cannot_hold_is_one_line():
    _one_line(r"^cohort\.selection: SetState\.init returned a state a checkpoint cannot hold "
              r"\(.*set.*\)$", selector=SetState())


def test_a_selector_observe_returning_none_is_one_line():
    _one_line(r"^cohort\.selection: ObservesNothing\.observe returned None as its state, "
              r"expected a dict of plain data$", selector=ObservesNothing())


def test_a_selector_without_observe_is_one_line():
    _one_line(r"^cohort\.selection: NoObserve has no observe; the Selector protocol is "
              r"init\(num_clients\) -> state", selector=NoObserve())


def test_a_well_formed_selector_gives_the_uniform_cohorts():
    sel = Uniformly()
    ours = fedloom.run(_cfg(3), selector=sel)
    ref = fedloom.run(_cfg(3))
    assert ours.summary["model_sha256"] == ref.summary["model_sha256"]
    assert sel.calls == 3  # the probe's two draws were a copy's


def test_each_kind_by_reference_is_one_line_and_exit_2_from_the_cli(tmp_path, monkeypatch,
                                                                     capsys):
    (tmp_path / "broken_kinds.py").write_text(textwrap.dedent("""\
        import numpy as np
        from fedloom.client.methods import LocalMethod
        from fedloom.compress.feedback import NoFeedback


        class Tuple(NoFeedback):
            def uplink(self, g, state, comp, ctx, server):
                return comp.encode(g, gen=ctx.gen), None


        class Short(LocalMethod):
            def run(self, trainer, job):
                res = super().run(trainer, job)
                res.update = res.update[1:]
                return res


        class First:
            def init(self, num_clients):
                return {}

            def select(self, r, candidates, size, state, gen):
                return candidates[:size]

            def observe(self, state, feedback):
                return state
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(_cfg()))
    cases = [("compression.feedback.name=broken_kinds:Tuple",
              "compression.feedback: Tuple.uplink returned 2 values, expected a "
              "fedloom.compress.feedback.UplinkResult(payload, sent, state)"),
             ("client.method.name=broken_kinds:Short", "client.method: Short.run returned a "
              "update of shape"),
             ("cohort.selection.name=broken_kinds:First", "cohort.selection: First.select "
              "returned a ndarray, the Selector protocol returns 2 (ids, state)")]
    for i, (override, line) in enumerate(cases):
        capsys.readouterr()
        rc = main(["run", str(path), override, "--out", str(tmp_path / f"run{i}"), "--quiet"])
        err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
        assert rc == 2 and len(err) == 1, err
        assert line in err[0], err
        assert not (tmp_path / f"run{i}" / "metrics.jsonl").exists()


# ------------------------------------------------------------ Flower's strategy
class FailsAfterTheDoor:
    """A mean whose first two calls (the check at the door's) pass and every later one
    fails; the calls counted in the class, which the door's copy shares."""

    calls = 0

    def init(self, layout):
        return None

    def __call__(self, updates, weights, state, *, info=None):
        FailsAfterTheDoor.calls += 1
        if FailsAfterTheDoor.calls > 2:
            raise ValueError("the cohort's system is singular")
        p = weights.to(updates.dtype) / weights.sum()
        return p @ updates, state, {}


def test_flowers_strategy_stops_when_its_first_rounds_all_skip(monkeypatch):
    """FedloomStrategy drives its own rounds (configure_train, aggregate_train): the
    engine's rule (fedloom.engine.runs.stepped) stops it at round NEVER_STEPPED_ROUNDS
    with the run loop's line. Replies built by hand, as a ClientApp sends them."""
    pytest.importorskip("flwr")
    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment
    from fedloom.engine.objects import Components
    from fedloom.engine.runs.stepped import NEVER_STEPPED_ROUNDS
    from fedloom.integrations.flower import FedloomStrategy

    # outside a Flower runtime: the identity a ServerApp process would have
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(FailsAfterTheDoor, "calls", 0)
    k = NEVER_STEPPED_ROUNDS
    exp = Experiment.from_config(load_config(_cfg(k + 2)), components=Components(
        aggregator=FailsAfterTheDoor()))
    strategy = FedloomStrategy(exp.cfg, experiment=exp)
    strategy.nodes = {c: 100 + c for c in range(exp.clients.num_clients)}
    d = exp.space.layout.size
    for r in range(1, k + 1):
        msgs = strategy.configure_train(r, strategy.initial_arrays(), ConfigRecord(), None)
        replies = []
        for msg in msgs:
            payload = exp.algorithm.compressor.encode(0.01 * torch.ones(d))
            content = RecordDict({
                "fedloom": ConfigRecord({"payload": payload,
                                         "client-id": int(msg.content["config"]["client-id"]),
                                         "residual-norm": 0.0}),
                "metrics": MetricRecord({"num-examples": 10, "num-steps": 1,
                                         "train-loss": 1.0}),
            })
            replies.append(Message(content, reply_to=msg))
        if r < k:
            strategy.aggregate_train(r, replies)
            assert strategy.history[-1]["rejected_rounds"] == 1
            continue
        with pytest.raises(ConfigError, match=(
                rf"^aggregator: object test_plugin_checks_more\.FailsAfterTheDoor: the step "
                rf"was skipped in each of the first {k} rounds \(round 1: the aggregator "
                r"failed \(ValueError: the cohort's system is singular\)\); stopped rather "
                r"than return the starting model$")):
            strategy.aggregate_train(r, replies)
