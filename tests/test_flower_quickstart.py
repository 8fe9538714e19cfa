"""Flower's own example, ``quickstart-pytorch``, with fedloom's strategies (issue #36, item 10).

The app here has that example's layout and nothing of fedloom in its ClientApp:

- *task*: a small CNN (``Net``), ``load_data(partition_id, num_partitions)`` reading
  the client's share of a local dataset (scikit-learn's 8×8 digits, bundled: no
  download), ``train`` and ``test`` loops over ``DataLoader`` s;
- *ClientApp*: ``@app.train`` loads ``msg.content["arrays"]``, trains on its
  partition and replies ``ArrayRecord(model.state_dict())`` with a ``MetricRecord``
  of ``train_loss`` and ``num-examples`` — plus ``start-loss``, the loss of the
  received model on its training data before training, the two lines
  docs/deploy.md shows for the rules that need it; ``@app.evaluate`` tests the
  received model on its partition's test split;
- *ServerApp*: ``@app.main`` builds the model, constructs the strategy and calls
  ``strategy.start(grid=…, initial_arrays=…, train_config=ConfigRecord({"lr": …}),
  num_rounds=…, evaluate_fn=global_evaluate)``, then writes the final model with
  ``torch.save(result.arrays.to_torch_state_dict(), path)``.

Two runs of Flower's simulation (Ray, 3 SuperNodes, 3 rounds each strategy): the
plain app under Flower's ``FedAvg`` and fedloom's ``CRAFT``, ``Krum``, ``Median``
and ``FedFV`` one after the other in the same ServerApp; the app wrapped in
``CompressionMod`` (Top-1 % + SA-PEF) under ``CRAFT(compression="topk", …)``.
Each strategy must train (the central test loss after its last round below the
initial model's) and write its result (the saved file loads into ``Net`` and
holds the result's arrays).

The two Ray simulations take minutes on 2 cores: they are marked slow (``make
test-all``). ``make test`` runs the same ServerApp and ClientApp (the compressed
one, with ``CompressionMod``) on an in-process grid, every message through
Flower's protobuf serialization: the apps, the strategies and the mod are
exercised, only Flower's runtime is not.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("flwr")
pytest.importorskip("ray")
pytest.importorskip("sklearn")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from fedloom.integrations.flower.stock import CompressionMod
from fedloom.integrations.flower.strategies import CRAFT, FedFV, Krum, Median

NODES, ROUNDS, LR = 3, 3, 0.05
TOPK = {"ratio": 0.01}


# ------------------------------------------------------------------------ task
# quickstart-pytorch's network for 1×8×8 digits, the digits and the in-process grid: written
# once, in the benchmark that compares CRAFT's defaults on this setup
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from craft_default_flower import LocalGrid, Net, _digits  # noqa: E402


def load_data(partition_id: int, num_partitions: int) -> tuple[DataLoader, DataLoader]:
    """This client's share (every ``num_partitions``-th sample from ``partition_id``),
    80 % to train, 20 % to test; shuffled by a generator of its own."""
    x, y = _digits()
    x, y = x[partition_id::num_partitions], y[partition_id::num_partitions]
    cut = int(0.8 * len(y))
    shuffle = torch.Generator().manual_seed(partition_id)
    train = DataLoader(TensorDataset(x[:cut], y[:cut]), batch_size=32, shuffle=True,
                       generator=shuffle)
    return train, DataLoader(TensorDataset(x[cut:], y[cut:]), batch_size=64)


def load_centralized_dataset() -> DataLoader:
    x, y = _digits()
    return DataLoader(TensorDataset(x, y), batch_size=256)


def train(net: Net, loader: DataLoader, epochs: int, lr: float) -> float:
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    total, batches = 0.0, 0
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(net(xb), yb)
            loss.backward()
            opt.step()
            total, batches = total + float(loss.detach()), batches + 1
    return total / max(batches, 1)


def evaluate_model(net: Net, loader: DataLoader) -> tuple[float, float]:
    net.eval()
    loss, correct, n = 0.0, 0, 0
    with torch.no_grad():
        for xb, yb in loader:
            out = net(xb)
            loss += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
            n += len(yb)
    return loss / n, correct / n


def initial_net() -> Net:
    with torch.random.fork_rng():  # the same initial model every run, the global RNG kept
        torch.manual_seed(0)
        return Net()


# ------------------------------------------------------------------- ClientApp
def make_client_app(mods: list[Any] | None = None) -> ClientApp:
    app = ClientApp(mods=mods or [])

    @app.train()
    def train_handler(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        pid = int(context.node_config["partition-id"])
        trainloader, _ = load_data(pid, int(context.node_config["num-partitions"]))
        # FedFV, FedLF, q-FedAvg, AFL weigh clients by the received model's loss
        start_loss, _ = evaluate_model(model, trainloader)
        train_loss = train(model, trainloader, 1, float(msg.content["config"]["lr"]))
        metrics = MetricRecord({"train_loss": train_loss, "start-loss": start_loss,
                                "num-examples": len(trainloader.dataset)})
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
        return Message(content=content, reply_to=msg)

    @app.evaluate()
    def evaluate_handler(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        pid = int(context.node_config["partition-id"])
        _, testloader = load_data(pid, int(context.node_config["num-partitions"]))
        loss, acc = evaluate_model(model, testloader)
        metrics = MetricRecord({"eval_loss": loss, "eval_acc": acc,
                                "num-examples": len(testloader.dataset)})
        return Message(content=RecordDict({"metrics": metrics}), reply_to=msg)

    return app


# ------------------------------------------------------------------- ServerApp
def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    loss, acc = evaluate_model(model, load_centralized_dataset())
    return MetricRecord({"loss": loss, "accuracy": acc})


STRATEGIES = {
    "fedavg": lambda: FedAvg(),
    "craft": lambda: CRAFT(server_lr=1.0),
    "krum": lambda: Krum(),
    "median": lambda: Median(),
    "fedfv": lambda: FedFV(),
}
COMPRESSED = {"craft+topk1%+sapef": lambda: CRAFT(server_lr=1.0, compression="topk",
                                                  compression_options=TOPK)}


def make_server_app(strategies: dict[str, Any], out: Path, runs: dict[str, Any]) -> ServerApp:
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        for name, make in strategies.items():
            strategy = make()
            try:
                result = strategy.start(grid=grid, initial_arrays=ArrayRecord(
                    initial_net().state_dict()), train_config=ConfigRecord({"lr": LR}),
                    num_rounds=ROUNDS, evaluate_fn=global_evaluate)
            except Exception as e:  # the test names it; the next strategy still runs
                runs[name] = e
                continue
            path = out / f"{name}.pt"
            torch.save(result.arrays.to_torch_state_dict(), path)
            runs[name] = (result, strategy, path)

    return app


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both simulations, once for the module: name → (Result, strategy, saved path)."""
    from conftest import flower_simulation

    out = tmp_path_factory.mktemp("quickstart")
    got: dict[str, Any] = {}
    flower_simulation(make_server_app(STRATEGIES, out, got), make_client_app(), NODES)
    mod = CompressionMod("topk", TOPK, feedback="sapef", alpha=0.5)
    flower_simulation(make_server_app(COMPRESSED, out, got), make_client_app([mod]), NODES)
    for name, run in got.items():
        if not isinstance(run, Exception):
            ev = run[0].evaluate_metrics_serverapp
            print(f"quickstart {name}: central loss {ev[0]['loss']:.3f} -> "
                  f"{ev[ROUNDS]['loss']:.3f}, accuracy {ev[0]['accuracy']:.3f} -> "
                  f"{ev[ROUNDS]['accuracy']:.3f}")
    return got


def test_the_compressed_app_trains_on_an_in_process_grid(tmp_path, monkeypatch):
    """The compressed ServerApp's main (CRAFT + Top-1 % + SA-PEF) against the
    ClientApp wrapped in CompressionMod, without Ray: it trains, writes its result
    and every reply of every round is taken, at a fraction of the dense bytes."""
    from flwr.supercore.task_identity import TaskIdentity

    for k in ("_run_id", "_node_id", "_task_id"):  # what a Flower process has set
        monkeypatch.setattr(TaskIdentity, k, 1)
    got: dict[str, Any] = {}
    server = make_server_app(COMPRESSED, tmp_path, got)
    mod = CompressionMod("topk", TOPK, feedback="sapef", alpha=0.5)
    grid = LocalGrid(make_client_app([mod]), NODES)
    server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                        run_config={}))
    run = got["craft+topk1%+sapef"]
    assert not isinstance(run, Exception), repr(run)
    result, strategy, path = run
    ev = result.evaluate_metrics_serverapp
    assert set(ev) == set(range(ROUNDS + 1)) and ev[ROUNDS]["loss"] < ev[0]["loss"]
    saved = Net()
    saved.load_state_dict(torch.load(path))
    assert global_evaluate(ROUNDS, ArrayRecord(saved.state_dict()))["loss"] == ev[ROUNDS]["loss"]
    assert strategy.totals == {"accepted": ROUNDS * NODES, "rejected": 0, "failed": 0,
                               "skipped_rounds": 0}
    assert set(result.evaluate_metrics_clientapp) == set(range(1, ROUNDS + 1))
    m = result.train_metrics_clientapp[ROUNDS]
    assert 0 < m["fedloom-uplink-bytes"] < 0.05 * m["fedloom-dense-bytes"]
    assert sorted(strategy.partitions.values()) == list(range(NODES))


# under `pytest -n`: the Ray simulations on one worker with the others (xdist_group)
@pytest.mark.slow
@pytest.mark.xdist_group("ray")
@pytest.mark.parametrize("name", [*STRATEGIES, *COMPRESSED])
def test_each_strategy_trains_and_writes_its_result(runs, name):
    run = runs.get(name)
    assert run is not None and not isinstance(run, Exception), f"{name}: {run!r}"
    result, strategy, path = run
    ev = result.evaluate_metrics_serverapp
    assert set(ev) == set(range(ROUNDS + 1))
    assert math.isfinite(ev[ROUNDS]["loss"]) and ev[ROUNDS]["loss"] < ev[0]["loss"]
    saved = Net()
    saved.load_state_dict(torch.load(path))
    assert all(torch.equal(saved.state_dict()[k], v)
               for k, v in result.arrays.to_torch_state_dict().items())
    assert global_evaluate(ROUNDS, ArrayRecord(saved.state_dict()))["loss"] == ev[ROUNDS]["loss"]
    if name != "fedavg":  # fedloom's strategies: every reply of every round was taken
        assert strategy.totals == {"accepted": ROUNDS * NODES, "rejected": 0, "failed": 0,
                                   "skipped_rounds": 0}
    # client-side evaluation (the app's @app.evaluate) ran every round
    assert set(result.evaluate_metrics_clientapp) == set(range(1, ROUNDS + 1))


@pytest.mark.slow
@pytest.mark.xdist_group("ray")
def test_the_compressed_run_reports_its_uplink_against_dense(runs):
    run = runs["craft+topk1%+sapef"]
    assert not isinstance(run, Exception), repr(run)
    result, strategy, _ = run
    d = strategy.state_layout.layout.size
    for r in range(1, ROUNDS + 1):
        m = result.train_metrics_clientapp[r]
        assert m["fedloom-dense-bytes"] == NODES * 4 * d
        assert 0 < m["fedloom-uplink-bytes"] < 0.05 * m["fedloom-dense-bytes"]
    m = result.train_metrics_clientapp[ROUNDS]
    print(f"quickstart uplink: {m['fedloom-uplink-bytes'] / NODES:.0f} bytes a reply against "
          f"{m['fedloom-dense-bytes'] / NODES:.0f} dense (d = {d})")
    # the mod says each client's partition-id: rejections would name it
    assert sorted(strategy.partitions.values()) == list(range(NODES))
