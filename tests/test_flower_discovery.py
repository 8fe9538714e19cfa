"""The client-id ask before round 1 (fedloom.integrations.flower.discovery): a node
that answers with an error (a stock ClientApp) and a node that does not answer
within ``node_timeout`` fail with different lines, each naming its own fix. No
federation: grids in this process, the second on a fake clock."""

from __future__ import annotations

import time

import pytest

flwr = pytest.importorskip("flwr")

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedloom.integrations.flower import FedloomStrategy, client_app, poll_replies  # noqa: E402

CFG = {"name": "discovery", "seed": 1, "rounds": 1, "dtype": "float64",
       "data": {"name": "digits", "num_clients": 4,
                "partition": {"name": "dirichlet", "options": {"alpha": 0.5, "min_samples": 20}}},
       "model": {"name": "mlp", "options": {"hidden": [4]}}, "cohort": {"size": 2},
       "client": {"lr": 0.05, "batch_size": 16, "epochs": 1},
       "aggregator": {"name": "fedavg"}, "compression": {"name": "identity"},
       "checkpoint": {"every": 0}}
NODES = {100 + k: k for k in range(4)}  # node id → partition-id


@pytest.fixture(autouse=True)
def task_identity(monkeypatch):
    """Messages need the task's identity, which a Flower process has set."""
    for k in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, k, 1)


def _context(node: int) -> Context:
    return Context(run_id=1, node_id=node, node_config={"partition-id": NODES[node]},
                   state=RecordDict(), run_config={})


def stock_app() -> ClientApp:
    """A stock Flower ClientApp: it trains on the message's "arrays" (the hello has none)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)

    return app


class _Grid:
    """Every node runs ``app`` in this process; a failure becomes an error reply
    with the reason Flower's runtime gives (type and message)."""

    def __init__(self, app: ClientApp) -> None:
        self.app, self.asks = app, 0

    def get_node_ids(self) -> list[int]:
        return list(NODES)

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for msg in messages:
            self.asks += 1
            msg.metadata.__dict__["_message_id"] = f"m{self.asks}"
            try:
                out.append(self.app(msg, _context(msg.metadata.dst_node_id)))
            except Exception as e:
                out.append(Message(Error(code=0, reason=f"{type(e)}:<'{e}'>"), reply_to=msg))
        return out


def test_a_stock_apps_error_reply_names_the_app(caplog):
    grid = _Grid(stock_app())
    strategy = FedloomStrategy(CFG, node_timeout=600)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid)
    msg = str(e.value)
    print(msg)
    assert msg.startswith("flower: 4 of 4 SuperNodes answered the client-id ask with an "
                          "error (node 100: <class 'KeyError'>:<''arrays''>); ")
    assert msg.endswith("this strategy needs fedloom's client_app or FedloomMod on every "
                        "node; for a stock Flower ClientApp use "
                        "fedloom.integrations.flower.strategies")
    assert "\n" not in msg and "node_timeout" not in msg
    assert grid.asks == 3 * 4  # each node asked three times, at once: no wait for the timeout
    assert time.monotonic() - t0 < 60
    assert sum("did not say its client id" in r.getMessage() for r in caplog.records) == 12
    # fedloom's client_app on the same grid answers: node → client
    strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), _Grid(client_app(CFG)))
    assert strategy.nodes == {k: node for node, k in NODES.items()}


class _SlowGrid:
    """fedloom's client_app on every node, each reply ready ``delay[node]`` s after its
    ask on a fake clock (``poll_replies``' sleep moves it): no real waiting."""

    def __init__(self, delay: dict[int, float], clock: list[float]) -> None:
        self.app, self.delay, self.clock = client_app(CFG), delay, clock
        self.ready: dict[str, tuple[float, Message]] = {}

    def get_node_ids(self) -> list[int]:
        return list(NODES)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            mid = f"m{len(self.ready)}"
            msg.metadata.__dict__["_message_id"] = mid
            node = msg.metadata.dst_node_id
            self.ready[mid] = (self.clock[0] + self.delay.get(node, 0.0),
                               self.app(msg, _context(node)))
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        return [rep for mid, (at, rep) in self.ready.items()
                if mid in message_ids and at <= self.clock[0]]


def test_a_node_that_answers_after_the_timeout_names_node_timeout(monkeypatch, caplog):
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    # node 103 answers 45 s after the ask, 15 s after node_timeout
    strategy = FedloomStrategy(CFG, node_timeout=30)
    grid = poll_replies(_SlowGrid({103: 45.0}, clock), 0.5)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError) as e:
        strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid)
    msg = str(e.value)
    print(msg)
    assert msg == ("flower: 1 of 4 SuperNodes did not answer the client-id ask within "
                   "node_timeout=30 s (waited 30.0 s; nodes [103]): a node still starting "
                   "(a loaded machine, a simulation starting its Ray actors) needs a longer "
                   "node_timeout")
    assert not any("did not say its client id" in r.getMessage() for r in caplog.records)
    # the same node with a longer node_timeout: found when it answers, not at the timeout
    clock[0] = 0.0
    strategy = FedloomStrategy(CFG, node_timeout=600)
    grid = poll_replies(_SlowGrid({103: 45.0}, clock), 0.5)  # type: ignore[arg-type]
    strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid)
    assert strategy.nodes == {k: node for node, k in NODES.items()}
    assert 45.0 <= clock[0] < 46.0
