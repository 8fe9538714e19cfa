"""Flower's simulation on a spec of the peers section (:mod:`peer_common`).

Runs in fedloom's own virtualenv (``flwr[simulation]``, Ray underneath).
Written with Flower's Message API, as its documentation sets up a simulation:
a ``ClientApp`` whose ``train`` function trains a plain PyTorch model
(``torch.optim.SGD``) and replies with its ``ArrayRecord`` and
``num-examples``; a ``ServerApp`` running Flower's own ``FedAvg`` strategy
(``strategy.start``) under ``run_simulation`` with one CPU a client, so Ray
runs as many clients at a time as there are cores (both, here).

Following the spec: ``FedAvg.configure_train`` is overridden to send round
``r``'s ``m`` messages to ``m`` of the SuperNodes, message ``pos`` carrying
``pos`` in its ``ConfigRecord``; the node that gets it trains spec client
``cohorts[r][pos]`` on that client's samples in fedloom's order (read from the
spec's arrays, memory-mapped, so each Ray worker holds only the rows it
trains). Flower's own node sampling would pick other clients than the spec's,
so it is the one part of Flower not used. Aggregation is Flower's
(``aggregate_arrayrecords``, weighted by ``num-examples``; every client holds
the same number of samples, so the mean). The strategy's ``evaluate_fn`` runs
before round 1 and after each round: it reports the round and waits for the
next ``go`` (:class:`peer_common.Pacer`), and after the last round writes the
final parameters.

    python benchmarks/peer_flower.py --spec DIR [--final W.pt] [--rounds N] [--threads N]
        [--cpus N] [--no-dropout]
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import peer_common
import torch

_CACHE: dict[str, object] = {}


def _client_batches(folder: str, rnd: int, pos: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """``(spec, x, y)`` of client ``cohorts[rnd][pos]`` in fedloom's order for the round;
    the spec and the memory-mapped arrays are opened once per Ray worker."""
    if _CACHE.get("folder") != folder:
        spec = torch.load(Path(folder) / "spec.pt", weights_only=True)
        _CACHE.update(folder=folder, spec=spec,
                      x=np.load(Path(folder) / "x.npy", mmap_mode="r"),
                      y=np.load(Path(folder) / "y.npy", mmap_mode="r"))
    spec = _CACHE["spec"]
    rows = peer_common.client_rows(spec, int(spec["cohorts"][rnd][pos]))
    x = torch.from_numpy(np.array(_CACHE["x"][rows]))
    y = torch.from_numpy(np.array(_CACHE["y"][rows]))
    perm = spec["perms"][rnd][pos]
    return spec, x[perm], y[perm]


def main(argv: list[str] | None = None) -> int:
    p = peer_common.arg_parser()
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads a client")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                   help="Ray's CPUs (clients at a time)")
    args = p.parse_args(argv)
    folder = str(Path(args.spec).resolve())
    spec = torch.load(Path(folder) / "spec.pt", weights_only=True)
    rounds, m = args.rounds or len(spec["cohorts"]), spec["per_round"]
    dropout = not args.no_dropout

    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    client_app = ClientApp()
    threads = args.threads

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        torch.set_num_threads(threads)
        cfg = msg.content["config"]
        # Flower counts rounds from 1, the spec from 0
        spec, xs, ys = _client_batches(folder, int(cfg["server-round"]) - 1, int(cfg["pos"]))
        model = peer_common.build_model(spec, dropout=dropout)
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])
        b = spec["batch"]
        for _ in range(spec["epochs"]):
            for s in range(0, len(ys), b):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xs[s:s + b]), ys[s:s + b]).backward()
                opt.step()
        content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                              "metrics": MetricRecord({"num-examples": len(ys)})})
        return Message(content=content, reply_to=msg)

    class SpecCohorts(FedAvg):
        """FedAvg whose round ``r`` trains the spec's cohort ``r`` (see the docstring)."""

        def configure_train(self, server_round: int, arrays: ArrayRecord,
                            config: ConfigRecord, grid: Grid) -> list[Message]:
            nodes = sorted(grid.get_node_ids())[:m]
            return [Message(content=RecordDict({
                        "arrays": arrays,
                        "config": ConfigRecord({"server-round": server_round, "pos": pos})}),
                        message_type="train", dst_node_id=node)
                    for pos, node in enumerate(nodes)]

    server_app = ServerApp()
    pacer = peer_common.Pacer(rounds)
    final: dict[str, torch.Tensor] = {}

    @server_app.main()
    def server(grid: Grid, context: Context) -> None:
        strategy = SpecCohorts(fraction_train=m / spec["clients"], fraction_evaluate=0.0,
                               min_train_nodes=m, min_available_nodes=spec["clients"])

        def after_round(rnd: int, arrays: ArrayRecord) -> MetricRecord | None:
            if rnd == 0:  # before round 1
                return None
            if rnd == rounds:
                final.update(arrays.to_torch_state_dict())
            pacer.round_done()
            return None

        init = peer_common.build_model(spec, dropout=dropout)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(init.state_dict()),
                       num_rounds=rounds, evaluate_fn=after_round)

    logging.getLogger("flwr").setLevel(logging.WARNING)
    run_simulation(server_app=server_app, client_app=client_app,
                   num_supernodes=spec["clients"],
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": args.cpus,
                                                 "include_dashboard": False}})
    if pacer.done != rounds or not final:
        print(f"flower: {pacer.done} of {rounds} rounds ran", file=sys.stderr)
        return 1
    model = peer_common.build_model(spec, dropout=dropout)
    model.load_state_dict(final)
    peer_common.save_final(args.final, model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
