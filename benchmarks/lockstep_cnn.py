"""Bench section ``lockstep_cnn``: the lock-step trainer on a small CNN.

    python benchmarks/bench.py --only lockstep_cnn [--quick]

pfl-research's CIFAR-10 benchmark shape (Granqvist et al. 2024, arXiv
2404.06430), scaled down to what these cores train in a few seconds a round:
``CLIENTS`` clients × 50 images of 3 × 32 × 32, 50 clients a round, one local
epoch of batch 10 (5 steps a client), SGD (lr 0.05), FedAvg. The images are
random (standard normal, client ``k``'s from a generator seeded ``2000 + k``)
with labels from a fixed random linear teacher, not CIFAR-10: only the shapes
matter to a round's time. The model is fedloom's ``cnn`` (McMahan et al.
2017: two 5×5 "same" convolutions, ReLU, 2×2 max-pools, Dense(512)) narrowed
to 8 and 16 channels (533,754 parameters) — pfl's own CNN has dropout, which
lock-step does not run. The ``lockstep``, ``sequential`` and ``vmap``
backends each run a warm-up round, then their rounds in turn (one of each,
``repeats`` times), so a change in the machine's load falls on all three;
figures are medians and the speed-ups ratios of this run's medians. One intra-op
thread (``backend.threads: 1``) for all three.
``--quick``: 10 clients × 20 images of 3 × 8 × 8, 5 a round.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import workload

SAMPLES, SHAPE, PER_ROUND, CLIENTS, CHANNELS = 50, (3, 32, 32), 50, 100, [8, 16]


def _data(clients: int, n: int, shape: tuple[int, ...]):
    from fedloom.data import from_arrays

    d = int(np.prod(shape))
    teacher = torch.randn(d, 10, generator=torch.Generator().manual_seed(1))
    xs = [torch.randn(n, *shape, generator=torch.Generator().manual_seed(2000 + k))
          for k in range(clients)]
    x = torch.cat(xs)
    y = (x.reshape(len(x), -1) @ teacher).argmax(1)
    xt = torch.randn(100, *shape, generator=torch.Generator().manual_seed(3000))
    yt = (xt.reshape(100, -1) @ teacher).argmax(1)
    return from_arrays(x.numpy(), y.numpy(), client=np.repeat(np.arange(clients), n),
                       X_test=xt.numpy(), y_test=yt.numpy(), name="cnn-bench")


def run(quick: bool, repeats: int) -> dict[str, Any]:
    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment

    clients, n, shape, m = (10, 20, (3, 8, 8), 5) if quick else (
        CLIENTS, SAMPLES, SHAPE, PER_ROUND)
    data = _data(clients, n, shape)
    base = {"name": "bench-cnn", "seed": 0, "rounds": 10_000,
            "data": {"num_clients": clients, "test_fraction": 0.0},
            "model": {"name": "cnn", "options": {"channels": CHANNELS}}, "cohort": {"size": m},
            "client": {"lr": 0.05, "batch_size": 10, "epochs": 1},
            "eval": {"every": 10_000}, "checkpoint": {"every": 0},
            # one intra-op thread: on a shared machine two threads measure OpenMP's
            # spin-waits (see fedloom.config.BackendConfig), not the backends
            "backend": {"threads": 1}}
    exps = {name: Experiment.from_config(load_config(base, [f"backend.name={name}"]), data=data)
            for name in ("lockstep", "sequential", "vmap")}
    medians, states = workload.interleaved_rounds(exps, repeats)
    assert exps["lockstep"].backend.reason is None, exps["lockstep"].backend.reason
    row: dict[str, Any] = dict(medians)
    row.update({"clients": clients, "samples": n, "shape": list(shape), "per_round": m,
                "channels": CHANNELS, "parameters": exps["lockstep"].layout.size,
                "chunk": exps["lockstep"].backend.chunk,
                "threads": torch.get_num_threads(),
                "speedup_vs_sequential": row["sequential"] / row["lockstep"],
                "speedup_vs_vmap": row["vmap"] / row["lockstep"],
                "max_abs_diff_vs_sequential": float(
                    (states["lockstep"].w - states["sequential"].w).abs().max())})
    for e in exps.values():
        e.close()
    return row


def markdown(s: dict[str, Any]) -> list[str]:
    lines = ["## 7b. Lock-step trainer on a CNN", "",
             f"{s['clients']} clients × {s['samples']} random images of "
             f"{'×'.join(map(str, s['shape']))}, {s['per_round']} per round, batch 10, one "
             f"epoch; `cnn` with {s['channels'][0]}/{s['channels'][1]} channels "
             f"({s['parameters']:,} parameters), float32, chunks of {s['chunk']}, "
             f"{s['threads']} thread(s); rounds of "
             "the three backends interleaved (`python benchmarks/bench.py --only "
             "lockstep_cnn`). Final models of lockstep and sequential differ by at most "
             f"{s['max_abs_diff_vs_sequential']:.1e}.", "",
             "| backend | s/round | lockstep speed-up |", "|---|---|---|"]
    for name in ("lockstep", "sequential", "vmap"):
        lines.append(f"| {name} | {s[name]:.3f} | {s[name] / s['lockstep']:.2f}× |")
    return [*lines, ""]


def goals(s: dict[str, Any]) -> list[tuple[str, str, bool, str]]:
    # not one of the goals: the CNN figure is reported beside the MLP's goal
    return []
