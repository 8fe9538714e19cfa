"""CRAFT's old and new default against Flower's FedAvg on Flower's quickstart setup.

The setup of tests/test_flower_quickstart.py (Flower's ``quickstart-pytorch`` layout):
scikit-learn's 8 × 8 digits split over 3 nodes (every 3rd sample; 80 % train, 20 %
test per node), quickstart's small CNN, each node one epoch of SGD (momentum 0.9,
batch 32) at client lr 0.05 a round, 3 rounds, every node every round. Three server
strategies from the same initial model: Flower's ``FedAvg``, fedloom's ``CRAFT`` at the
old default (``step="fixed"``, server_lr auto = 0.1) and at the new default
(``CRAFT()``: rprop, τ ≤ 100, server_lr auto = 1.0). Seed ``s`` draws the initial model
(``torch.manual_seed(s)``) and the nodes' batch order (``3s + node``); seed 0 is the
test's. The messages go through Flower's protobuf serialization on an in-process grid
(:class:`LocalGrid`, the test's too), not Flower's Ray simulation, which takes minutes a
run on 2 cores. Reported: accuracy on the nodes' pooled test splits (359 samples) after the
last round, mean ± sd over the seeds, and each seed's paired difference.

    python benchmarks/craft_default_flower.py --seeds 5
    python benchmarks/craft_default_flower.py --seeds 5 --rounds 5 --lr 0.01  # the issue's
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

NODES = 3


class Net(nn.Module):
    """quickstart-pytorch's two convolutions and two linear layers, for 1×8×8 digits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(16 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.tensor(d.target, dtype=torch.int64)


def _split(pid: int) -> tuple[TensorDataset, TensorDataset]:
    x, y = _digits()
    x, y = x[pid::NODES], y[pid::NODES]
    cut = int(0.8 * len(y))
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def _accuracy(net: Net, data: TensorDataset) -> tuple[float, float]:
    net.eval()
    with torch.no_grad():
        x, y = data.tensors
        out = net(x)
        return float(nn.functional.cross_entropy(out, y)), float((out.argmax(1) == y).float()
                                                                .mean())


def client_app(seed: int, lr: float) -> Any:
    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = Net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        pid = int(context.node_config["partition-id"])
        data, _ = _split(pid)
        order = torch.Generator().manual_seed(NODES * seed + pid)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        model.train()
        for xb, yb in DataLoader(data, batch_size=32, shuffle=True, generator=order):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
        metrics = MetricRecord({"num-examples": len(data)})
        return Message(content=RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                           "metrics": metrics}), reply_to=msg)

    return app


class LocalGrid:
    """A grid of ``n`` nodes in this process for ``strategy.start`` (also
    tests/test_flower_quickstart.py's): each message and reply goes through Flower's
    protobuf serialization, each node keeps its Context."""

    def __init__(self, app: Any, n: int = NODES) -> None:
        from flwr.app import Context, RecordDict

        self.app, self.sent = app, 0
        self.contexts = {100 + k: Context(run_id=1, node_id=100 + k, node_config={
            "partition-id": k, "num-partitions": n}, state=RecordDict(), run_config={})
            for k in range(n)}

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Any]:
        from flwr.common import serde

        out = []
        for msg in messages:
            self.sent += 1
            msg.metadata.__dict__["_message_id"] = f"m{self.sent}"
            msg = serde.message_from_proto(serde.message_to_proto(msg))
            reply = self.app(msg, self.contexts[msg.metadata.dst_node_id])
            out.append(serde.message_from_proto(serde.message_to_proto(reply)))
        return out


def strategies() -> dict[str, Any]:
    from flwr.serverapp.strategy import FedAvg

    from fedloom.integrations.flower.strategies import CRAFT

    return {"FedAvg (Flower)": lambda: FedAvg(fraction_evaluate=0.0),
            "CRAFT old default (step fixed)": lambda: CRAFT(step="fixed", fraction_evaluate=0.0),
            "CRAFT new default": lambda: CRAFT(fraction_evaluate=0.0)}


def run_one(make: Any, seed: int, rounds: int, lr: float) -> float:
    """Pooled held-out accuracy after ``rounds`` rounds of the strategy ``make()``."""
    from flwr.app import ArrayRecord, ConfigRecord

    test = TensorDataset(*(torch.cat(t) for t in zip(*(_split(k)[1].tensors
                                                       for k in range(NODES)), strict=True)))
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        init = Net()
    result = make().start(grid=LocalGrid(client_app(seed, lr)),
                          initial_arrays=ArrayRecord(init.state_dict()),
                          train_config=ConfigRecord({"lr": lr}), num_rounds=rounds)
    net = Net()
    net.load_state_dict(result.arrays.to_torch_state_dict())
    return _accuracy(net, test)[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    a = p.parse_args(argv)
    from flwr.supercore.task_identity import TaskIdentity

    for k in ("_run_id", "_node_id", "_task_id"):  # what a Flower process has set
        setattr(TaskIdentity, k, 1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    acc: dict[str, list[float]] = {name: [] for name in strategies()}
    t0 = time.perf_counter()
    for seed in range(a.seeds):
        for name, make in strategies().items():
            acc[name].append(run_one(make, seed, a.rounds, a.lr))
        print(f"seed {seed}: " + ", ".join(f"{n} {v[-1]:.3f}" for n, v in acc.items()),
              file=sys.stderr)
    print(f"{NODES} nodes, {a.rounds} rounds, client lr {a.lr:g}, {a.seeds} seeds "
          f"({time.perf_counter() - t0:.0f} s); held-out accuracy (%), mean ± sd:\n")
    print("| strategy | accuracy | per seed |\n|---|---|---|")
    for name, v in acc.items():
        sd = statistics.stdev(v) if len(v) > 1 else 0.0
        print(f"| {name} | {100 * statistics.mean(v):.1f} ± {100 * sd:.1f} | "
              + " ".join(f"{100 * x:.1f}" for x in v) + " |")
    new, old, avg = (acc[k] for k in ("CRAFT new default", "CRAFT old default (step fixed)",
                                      "FedAvg (Flower)"))
    for what, base in (("old default", old), ("FedAvg", avg)):
        d = [100 * (x - y) for x, y in zip(new, base, strict=True)]
        print(f"\nnew default − {what}: {statistics.mean(d):+.1f} pp (per seed "
              + " ".join(f"{x:+.1f}" for x in d) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
