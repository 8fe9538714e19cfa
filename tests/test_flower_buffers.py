"""Module buffers (BatchNorm statistics) on the Flower path: a Flower run of a
BatchNorm model ends with the engine's model and buffers under each
``model.buffers`` policy, a ClientApp's reply depends on its message and
``Context.state`` only, and a malformed buffers reply is rejected and counted.

The model: the built-in ResNet-8 of width 4 with ``norm: batch`` on the 8×8
digits (7 BatchNorm2d layers), float64, 4 clients, 2 a round, 3 rounds.
"""

from __future__ import annotations

import pytest
import torch

import fedloom
from conftest import FLOWER_NODE_TIMEOUT_S, flower_simulation
from fedloom.buffers import BUFFER_POLICIES, buffers_sha256

flwr = pytest.importorskip("flwr")

from flwr.app import (  # noqa: E402
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common import serde  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedloom.config import ConfigError  # noqa: E402
from fedloom.integrations import flower  # noqa: E402
from fedloom.integrations.flower import (  # noqa: E402
    BUFFERS_KEY,
    FedloomStrategy,
    buffers_to_arrays,
    client_app,
    server_app,
    to_arrays,
)

# 600 of digits' 1797 samples: the same checks at a third of the training
CFG = {"name": "flower-bn", "seed": 5, "rounds": 3, "dtype": "float64",
       "data": {"name": "digits", "num_clients": 4, "max_samples": 600,
                "partition": {"name": "dirichlet", "options": {"alpha": 0.5, "min_samples": 20}}},
       "model": {"name": "resnet", "options": {"depth": 8, "width": 4, "norm": "batch"}},
       "cohort": {"size": 2}, "client": {"lr": 0.05, "batch_size": 32, "epochs": 1},
       "aggregator": {"name": "fedavg"},
       "compression": {"name": "identity", "feedback": "none"},
       "eval": {"every": 1}, "checkpoint": {"every": 0}}
MLP = {**CFG, "model": {"name": "mlp", "options": {"hidden": [8]}}}
NODE = 7


@pytest.fixture
def task_identity(monkeypatch):
    # outside a Flower runtime: the identity a ClientApp / ServerApp process has
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", NODE)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


# ------------------------------------------------------------ against the engine
class _LocalGrid:
    """Flower's grid for the strategy, in this process: every message and reply goes
    through Flower's protobuf serialization (what its transport carries), and each
    node keeps its Context across rounds (what a SuperNode keeps). The runtime is
    the only thing that differs from a deployment; the Ray run below covers it."""

    def __init__(self, app, n: int) -> None:
        self.app = app
        self.contexts = {100 + k: Context(run_id=1, node_id=100 + k,
                                          node_config={"partition-id": k},
                                          state=RecordDict(), run_config={})
                         for k in range(n)}

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for i, msg in enumerate(messages):
            msg.metadata.__dict__["_message_id"] = f"m{i}"
            msg = serde.message_from_proto(serde.message_to_proto(msg))
            reply = self.app(msg, self.contexts[msg.metadata.dst_node_id])
            out.append(serde.message_from_proto(serde.message_to_proto(reply)))
        return out


def _run_flower(policy: str, ray_runtime: bool) -> FedloomStrategy:
    over = [f"model.buffers={policy}"]
    strategy = FedloomStrategy(CFG, over, node_timeout=FLOWER_NODE_TIMEOUT_S)
    app = client_app(CFG, over)
    if ray_runtime:
        flower_simulation(server_app(strategy), app, 4)
    else:
        strategy.start(grid=_LocalGrid(app, 4), initial_arrays=strategy.initial_arrays(),
                       num_rounds=CFG["rounds"])
    return strategy


def _check_against_engine(policy: str, strategy: FedloomStrategy, init) -> None:
    ref = fedloom.run(CFG, [f"model.buffers={policy}"])
    want = ref.model.state_dict()
    got = strategy.state.buffers
    assert list(got) == [n for n in want if n in got] and len(got) == 21
    diff = max(float((v.double() - want[n].double()).abs().max()) for n, v in got.items())
    print(f"{policy}: w max abs {float((strategy.state.w - ref.w).abs().max()):.3g}, "
          f"buffers max abs {diff:.3g}")
    assert torch.equal(strategy.state.w, ref.w)
    assert all(torch.equal(v, want[n]) for n, v in got.items())
    # the summary's hashes: model_sha256 over w, buffers_sha256 over the buffers
    assert strategy.model_sha256() == ref.summary["model_sha256"]
    assert strategy.buffers_sha256() == ref.summary["buffers_sha256"]
    moved = not all(torch.equal(v, init[n]) for n, v in got.items())
    assert moved == (policy != "keep_global")
    keys = ("test_acc", "test_loss", "train_loss", "rejected_updates")
    for mine, theirs in zip(strategy.history, ref.metrics, strict=True):
        assert {k: mine[k] for k in keys} == {k: theirs[k] for k in keys}
        per_client = sorted(k for k in theirs if k.startswith("client_acc"))
        assert per_client and all(mine[k] == theirs[k] for k in per_client)
    if policy == "local":  # a client that trained twice started from its own buffers
        avg = fedloom.run(CFG, ["model.buffers=average"])
        assert avg.summary["buffers_sha256"] != ref.summary["buffers_sha256"]


def _initial_buffers(policy: str):
    # (the engine's module holds the latest buffers after a round: take them first)
    return dict(FedloomStrategy(CFG, [f"model.buffers={policy}"]).state.buffers)


@pytest.mark.parametrize("policy", BUFFER_POLICIES)
def test_flower_strategy_and_client_app_give_the_engines_model_and_buffers(
        task_identity, policy):
    """The strategy and the ClientApp, every message through Flower's serialization
    (:class:`_LocalGrid`), against ``fedloom.run`` of the same config. Measured: the
    final ``w`` and every buffer are bit for bit the engine's (max abs difference
    0.0) under average, local and keep_global, and so are the per-round evaluations
    (global and per-client test accuracy and loss: local clients are evaluated with
    their own statistics, as in the engine)."""
    init = _initial_buffers(policy)
    _check_against_engine(policy, _run_flower(policy, ray_runtime=False), init)


# under `pytest -n`: on one worker with the other Ray/Flower simulations, so two Ray
# clusters never compete for the two cores
@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_flower_simulation_gives_the_engines_model_and_buffers_under_local():
    """The same on Flower's simulation runtime (Ray, one long-lived process per
    client actor, Context.state kept by Flower), for the policy that keeps client
    state: bit for bit (max abs difference 0.0)."""
    init = _initial_buffers("local")
    _check_against_engine("local", _run_flower("local", ray_runtime=True), init)


# ----------------------------------------------------------------- the ClientApp
def _message(w, bufs, k: int, r: int, exp) -> Message:
    conf = ConfigRecord({"server-round": r + 1, "fedloom-round": r, "client-id": k,
                         "lr": 0.05})
    content = RecordDict({"arrays": to_arrays(exp.layout, w), "config": conf})
    if bufs is not None:
        content[BUFFERS_KEY] = buffers_to_arrays(bufs)
    m = Message(content, dst_node_id=NODE, message_type=MessageType.TRAIN)
    m.metadata.__dict__["_message_id"] = f"m{k}-{r}"  # as Flower sets it on arrival
    return m


def _context(k: int) -> Context:
    return Context(run_id=1, node_id=NODE, node_config={"partition-id": k},
                   state=RecordDict(), run_config={})


def _bytes(reply: Message) -> bytes:
    assert not reply.has_error(), reply.error
    return _serial(reply.content)


def _serial(rd: RecordDict) -> bytes:
    return serde.recorddict_to_proto(rd).SerializeToString()


@pytest.mark.parametrize("policy", ["average", "local"])
def test_client_app_keeps_nothing_between_messages(task_identity, monkeypatch, policy):
    """One process, one ClientApp: a message after another gives the reply (and,
    under local, the Context.state) a fresh process gives — nothing of the first
    message's training (the module's buffers, the caches) leaks into the second.
    Under local, the second participation trains from the Context.state's buffers,
    not the message's."""
    over = [f"model.buffers={policy}"]
    strategy = FedloomStrategy(CFG, over)
    exp = strategy.exp
    w, b0 = strategy.state.w, strategy.state.buffers
    b1 = {n: (v * 0.5 + 0.25 if v.is_floating_point() else v + 3) for n, v in b0.items()}
    app = client_app(CFG, over)
    ctx0 = _context(0)
    first = app(_message(w, b0, 0, 0, exp), ctx0)
    ctx1 = _context(1)
    warm = _bytes(app(_message(0.99 * w, b1, 1, 1, exp), ctx1))
    again = _bytes(app(_message(0.99 * w, b1, 1, 1, exp), _context(1)))
    assert again == warm
    monkeypatch.setattr(flower.cache, "_EXPERIMENTS", {})  # a fresh process
    monkeypatch.setattr(flower.cache, "_CLIENT_DATA", {})
    fresh_ctx = _context(1)
    fresh = _bytes(client_app(CFG, over)(_message(0.99 * w, b1, 1, 1, exp), fresh_ctx))
    assert fresh == warm
    assert _bytes(first) != warm
    # the reply carries the trained buffers, which depend on what the message carried
    other = _bytes(app(_message(0.99 * w, b0, 1, 1, exp), _context(1)))
    assert other != warm
    if policy == "local":
        assert set(fresh_ctx.state.keys()) == set(ctx1.state.keys()) == {"fedloom.buffers"}
        assert _serial(fresh_ctx.state) == _serial(ctx1.state)
        # client 0's second round: its own buffers, whatever the message carries
        r2 = [_bytes(app(_message(w, b, 0, 2, exp), ctx)) for b, ctx in
              ((b0, _clone(ctx0)), (b1, _clone(ctx0)))]
        assert r2[0] == r2[1]
    else:
        assert not ctx1.state.keys()


def _clone(ctx: Context) -> Context:
    state = serde.recorddict_from_proto(serde.recorddict_to_proto(ctx.state))
    return Context(run_id=1, node_id=NODE, node_config=dict(ctx.node_config), state=state,
                   run_config={})


def test_a_model_without_buffers_sends_no_buffers_record(task_identity):
    strategy = FedloomStrategy(MLP)
    assert not strategy.exp.buffer_template and strategy.buffers_sha256() is None
    strategy.nodes = {k: 100 + k for k in range(4)}
    msgs = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), None))
    assert all(set(m.content.keys()) == {"arrays", "config"} for m in msgs)
    reply = client_app(MLP)(_message(strategy.state.w, None, 0, 0, strategy.exp), _context(0))
    assert set(reply.content.keys()) == {"fedloom", "metrics"}


def test_a_message_without_buffers_is_an_error_for_a_batchnorm_model(task_identity):
    strategy = FedloomStrategy(CFG)
    with pytest.raises(ValueError, match=r"^buffers: the model has buffers and the message"):
        client_app(CFG)(_message(strategy.state.w, None, 0, 0, strategy.exp), _context(0))


# ------------------------------------------------------------------- the server
def test_strategy_rejects_malformed_and_non_finite_buffers(task_identity):
    """Replies built by hand, all with the same good update: missing buffers, a
    misshapen buffer and a float32 one are rejected as undecodable, NaN buffers as
    non-finite client state (finish_round's rule); all four are counted, not
    dropped as absent, and the global buffers are the data-weighted mean of the one
    accepted client's — its own, integers included."""
    strategy = FedloomStrategy(CFG, ["data.num_clients=5", "cohort.size=5"])
    exp = strategy.exp
    strategy.nodes = {k: 100 + k for k in range(5)}
    msgs = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), None))
    assert all(BUFFERS_KEY in m.content for m in msgs)
    b0 = strategy.state.buffers
    good = {n: (v + 0.5 if v.is_floating_point() else v + 2) for n, v in b0.items()}
    name = next(n for n in b0 if n.endswith("running_mean"))
    sent = [None,
            {**good, name: torch.zeros(good[name].numel() + 1, dtype=torch.float64)},
            {**good, name: good[name].float()},
            {**good, name: torch.full_like(good[name], float("nan"))},
            good]
    replies = []
    for msg, bufs in zip(msgs, sent, strict=True):
        k = int(msg.content["config"]["client-id"])
        payload = exp.uplink.encode(0.01 * torch.ones(exp.layout.size, dtype=torch.float64))
        content = RecordDict({
            "fedloom": ConfigRecord({"payload": payload, "client-id": k, "residual-norm": 0.0}),
            "metrics": MetricRecord({"num-examples": 10, "num-steps": 1, "train-loss": 1.0}),
        })
        if bufs is not None:
            content[BUFFERS_KEY] = buffers_to_arrays(bufs)
        replies.append(Message(content, reply_to=msg))
    w0 = strategy.state.w.clone()
    strategy.aggregate_train(1, replies)
    m = strategy.history[-1]
    assert m["dropped_clients"] == 0 and m["rejected_updates"] == 4
    reasons = m["rejected_reasons"]
    assert sum("could not be decoded (buffers: " in why for why in reasons) == 3
    assert sum(why == "non-finite client state" for why in reasons) == 1
    assert not torch.equal(strategy.state.w, w0)  # the good client's update was applied
    assert all(torch.equal(v, good[n]) for n, v in strategy.state.buffers.items())
    assert strategy.buffers_sha256() == buffers_sha256(good)


def test_secagg_refuses_averaged_buffers():
    """SecAgg+ hands the server only the masked sum of w's updates: averaged (or
    per-client) buffers would travel in the clear, so only keep_global runs."""
    from fedloom.integrations.secagg import SecAggStrategy

    over = ["server.secure_aggregation=true"]
    for policy in ("average", "local"):
        with pytest.raises(ConfigError, match=r"^model\.buffers: "):
            SecAggStrategy(CFG, [*over, f"model.buffers={policy}"])
    s = SecAggStrategy(CFG, [*over, "model.buffers=keep_global"])
    assert s.state.buffers
