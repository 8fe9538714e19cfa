"""Flower's simulation on the reference workload (the baseline of ``make bench``).

Plain PyTorch inside Flower's Message API: each SuperNode holds one client's
samples of the reference data (:func:`workload.client_arrays`), trains the MLP
784-200-10 for one epoch of batch 32 with ``torch.optim.SGD``, and replies with
its weights; the server runs Flower's own ``FedAvg`` strategy. Round times are
the gaps between the strategy's ``evaluate_fn`` calls (it runs before round 1
and after each round; client-side evaluation is off).

    python benchmarks/flower_baseline.py --per-round 10 --rounds 4 --out t.json

writes ``{"start_s": time to the end of round 1, "rounds_s": [...],
"concurrent_clients": ...}``. With ``--device cuda --gpus-per-client 0.1``
(``benchmarks/gpu_check.py``) each client trains on the GPU and Ray runs
``min(cpus, 1 / gpus-per-client)`` clients at a time, each actor with its own
CUDA context; as on the CPU, a client draws its samples in its train call
(a few ms on the CPU) and moves them to the device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from workload import CLIENTS, SAMPLES, client_arrays, reference_mlp


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--per-round", type=int, default=10)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--clients", type=int, default=CLIENTS)
    p.add_argument("--samples", type=int, default=SAMPLES)
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1)
    p.add_argument("--device", default="cpu", help="where each client trains (cpu, cuda)")
    p.add_argument("--gpus-per-client", type=float, default=0.0,
                   help="Ray's (fractional) GPUs per client; > 0 needs --device cuda")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    t_launch = time.perf_counter()

    from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    client_app = ClientApp()
    num_clients = args.clients
    dev = torch.device(args.device)

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(1)
        k = int(context.node_config["partition-id"])
        x, y = client_arrays(k, args.samples)
        x, y = x.to(dev), y.to(dev)
        model = reference_mlp().to(dev)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(k)
        perm = torch.randperm(len(y), generator=gen).to(dev)
        for s in range(0, len(y), 32):
            idx = perm[s : s + 32]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        state = {name: v.detach().cpu() for name, v in model.state_dict().items()}
        content = RecordDict({"arrays": ArrayRecord(state),
                              "metrics": MetricRecord({"num-examples": len(y)})})
        return Message(content=content, reply_to=msg)

    server_app = ServerApp()
    stamps: list[float] = []

    @server_app.main()
    def server(grid: Grid, context: Context) -> None:
        frac = args.per_round / num_clients
        strategy = FedAvg(fraction_train=frac, fraction_evaluate=0.0,
                          min_train_nodes=args.per_round, min_available_nodes=num_clients)

        def stamp(rnd: int, arrays: ArrayRecord) -> MetricRecord | None:
            stamps.append(time.perf_counter())
            return None

        strategy.start(grid=grid, initial_arrays=ArrayRecord(reference_mlp().state_dict()),
                       num_rounds=args.rounds, evaluate_fn=stamp)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    init_args: dict = {"num_cpus": args.cpus, "include_dashboard": False}
    if args.gpus_per_client > 0:
        init_args["num_gpus"] = torch.cuda.device_count()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=num_clients,
                   backend_config={"client_resources": {"num_cpus": 1,
                                                        "num_gpus": args.gpus_per_client},
                                   "init_args": init_args})
    if len(stamps) != args.rounds + 1:
        print(f"flower: expected {args.rounds + 1} time stamps, got {len(stamps)}",
              file=sys.stderr)
        return 1
    Path(args.out).write_text(json.dumps({
        "start_s": stamps[1] - t_launch,
        "rounds_s": [b - a for a, b in itertools.pairwise(stamps)],
        "concurrent_clients": int(min(args.cpus, 1 / args.gpus_per_client if
                                      args.gpus_per_client > 0 else args.cpus)),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
