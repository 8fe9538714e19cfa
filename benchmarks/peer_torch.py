"""Plain PyTorch on a spec of the peers section (:mod:`peer_common`): the floor.

No framework: one model, each cohort client's batches in the spec's order from
the round's start (``load_state_dict``), ``torch.optim.SGD``, the average of
the clients' final parameters as the next model (FedAvg with equal weights:
every client holds the same number of samples). What is left of a framework's
round time above this is the framework's own work.

``--procs N``: the same work split over N processes with nothing else — the
round's start and each process's sum of its clients' models in shared memory,
a one-byte message each way a round — process ``k`` training the cohort
positions ``k, k + N, …``. One core's time divided by N is the floor of a
perfect split; this measures what N processes actually take side by side on the
machine (they share its caches and memory bandwidth), the least any N-process
framework can take. The sum of the N partial sums is the same average up to
float rounding; dropout masks come from each process's own generator.

    python benchmarks/peer_torch.py --spec DIR [--final W.pt] [--rounds N] [--threads N]
        [--no-dropout] [--procs N]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_common
import torch


def _train(spec: dict[str, Any], x: torch.Tensor, y: torch.Tensor, model: torch.nn.Module,
           start: dict[str, torch.Tensor], acc: dict[str, torch.Tensor], r: int,
           positions: range) -> None:
    """Train the cohort ``positions`` of round ``r`` from ``start``; add each final
    model / m into ``acc``."""
    m, b = spec["per_round"], spec["batch"]
    model.train()
    for pos in positions:
        xs, ys = peer_common.ordered(spec, x, y, r, pos)
        model.load_state_dict(start)
        opt = torch.optim.SGD(model.parameters(), lr=spec["lr"])
        for _ in range(spec["epochs"]):
            for s in range(0, len(ys), b):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xs[s:s + b]), ys[s:s + b]).backward()
                opt.step()
        for k, v in model.state_dict().items():
            acc[k] += v / m


def _helper(conn: Any, spec_dir: str, threads: int, dropout: bool, rank: int, procs: int,
            start: dict[str, torch.Tensor], acc: dict[str, torch.Tensor]) -> None:
    torch.set_num_threads(threads)
    spec, x, y = peer_common.load_spec(spec_dir)
    model = peer_common.build_model(spec, dropout=dropout)
    m = spec["per_round"]
    conn.send(b"r")
    while (msg := conn.recv()) is not None:
        for v in acc.values():
            v.zero_()
        _train(spec, x, y, model, start, acc, msg, range(rank, m, procs))
        conn.send(b"d")


def main(argv: list[str] | None = None) -> int:
    p = peer_common.arg_parser()
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--procs", type=int, default=1)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec, x, y = peer_common.load_spec(args.spec)
    rounds, m = args.rounds or len(spec["cohorts"]), spec["per_round"]
    model = peer_common.build_model(spec, dropout=not args.no_dropout)
    helpers = []
    shared_start = {k: v.detach().clone().share_memory_() for k, v in model.state_dict().items()}
    if args.procs > 1:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        for rank in range(1, args.procs):
            acc = {k: torch.zeros_like(v).share_memory_() for k, v in shared_start.items()}
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_helper, daemon=True,
                               args=(there, args.spec, args.threads or 1, not args.no_dropout,
                                     rank, args.procs, shared_start, acc))
            proc.start()
            helpers.append((here, proc, acc))
        for here, _, _ in helpers:
            here.recv()  # started, data loaded: the rounds are what is timed
    pacer = peer_common.Pacer(rounds)
    for r in range(rounds):
        for k, v in model.state_dict().items():
            shared_start[k].copy_(v)
        for here, _, _ in helpers:
            here.send(r)
        acc = {k: torch.zeros_like(v) for k, v in shared_start.items()}
        _train(spec, x, y, model, shared_start, acc, r, range(0, m, args.procs))
        for here, _, part in helpers:
            here.recv()
            for k in acc:
                acc[k] += part[k]
        model.load_state_dict(acc)
        pacer.round_done()
    for here, proc, _ in helpers:
        here.send(None)
        proc.join(10)
    peer_common.save_final(args.final, model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
