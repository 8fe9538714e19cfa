"""The reference workload of ``make bench``, shared by fedloom's side and Flower's.

100 clients × 600 samples × 784 features (synthetic: standard normal features,
labels from a fixed random linear teacher), the MLP 784-200-10, one local
epoch of batch 32, SGD (lr 0.05), FedAvg. Client ``k``'s samples come from a
generator seeded with ``1000 + k``, so every framework trains on the same data
without shipping it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch
from torch import nn

CLIENTS = 100
SAMPLES = 600
DIM = 784
HIDDEN = 200
CLASSES = 10
LR = 0.05
BATCH = 32


def _teacher() -> torch.Tensor:
    return torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(0))


def client_arrays(k: int, n: int = SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``k``'s samples ``(x [n, 784] float32, y [n] int64)``."""
    x = torch.randn(n, DIM, generator=torch.Generator().manual_seed(1000 + k))
    return x, (x @ _teacher()).argmax(1)


def reference_mlp() -> nn.Module:
    torch.manual_seed(0)  # the baseline's own initial weights; fedloom derives its own
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


def fedloom_data(clients: int = CLIENTS, n: int = SAMPLES):  # -> fedloom Dataset
    """The same samples as a fedloom dataset with a natural split (one id per client)."""
    from fedloom.data import from_arrays

    xs, ys = zip(*(client_arrays(k, n) for k in range(clients)), strict=True)
    xt, yt = client_arrays(10_000, 1000)
    return from_arrays(torch.cat(xs).numpy(), torch.cat(ys).numpy(),
                       client=np.repeat(np.arange(clients), n), X_test=xt.numpy(),
                       y_test=yt.numpy(), name="reference")


def fedloom_config(per_round: int, clients: int = CLIENTS) -> dict:
    return {
        "name": "bench", "seed": 0, "rounds": 10_000,
        "data": {"num_clients": clients, "test_fraction": 0.0},
        "model": {"name": "mlp", "options": {"hidden": [HIDDEN]}},
        "cohort": {"size": per_round},
        "client": {"lr": LR, "batch_size": BATCH, "epochs": 1},
        "eval": {"every": 10_000}, "checkpoint": {"every": 0},
    }


def plain_torch_round(per_round: int, data: list[tuple[torch.Tensor, torch.Tensor]],
                      model: nn.Module) -> None:
    """One FedAvg round in plain PyTorch (the in-process floor: no framework)."""
    start = {k: v.clone() for k, v in model.state_dict().items()}
    acc = {k: torch.zeros_like(v) for k, v in start.items()}
    for k in range(per_round):
        x, y = data[k]
        model.load_state_dict(start)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(k))
        for s in range(0, len(y), BATCH):
            idx = perm[s : s + BATCH]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        for name, v in model.state_dict().items():
            acc[name] += v / per_round
    model.load_state_dict(acc)


def interleaved_rounds(exps: dict[str, Any], repeats: int
                       ) -> tuple[dict[str, float], dict[str, Any]]:
    """Median seconds per round of each fedloom ``Experiment`` and its final state:
    one warm-up round of each, then ``repeats`` rounds of each in turn, so that a
    change in the machine's load falls on all of them."""
    states = {k: e.round(e.init())[0] for k, e in exps.items()}
    times: dict[str, list[float]] = {k: [] for k in exps}
    for _ in range(repeats):
        for k, e in exps.items():
            t = time.perf_counter()
            states[k], _ = e.round(states[k])
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}, states
