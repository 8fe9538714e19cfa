"""Plain PyTorch on a spec of the peers section (:mod:`peer_common`): the floor.

No framework: one model, each cohort client's batches in the spec's order from
the round's start (``load_state_dict``), ``torch.optim.SGD``, the average of
the clients' final parameters as the next model (FedAvg with equal weights:
every client holds the same number of samples). What is left of a framework's
round time above this is the framework's own work.

    python benchmarks/peer_torch.py --spec DIR [--final W.pt] [--rounds N] [--threads N]
        [--no-dropout]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_common
import torch


def main(argv: list[str] | None = None) -> int:
    p = peer_common.arg_parser()
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec, x, y = peer_common.load_spec(args.spec)
    rounds, m, b = args.rounds or len(spec["cohorts"]), spec["per_round"], spec["batch"]
    model = peer_common.build_model(spec, dropout=not args.no_dropout)
    pacer = peer_common.Pacer(rounds)
    for r in range(rounds):
        start = {k: v.clone() for k, v in model.state_dict().items()}
        acc = {k: torch.zeros_like(v) for k, v in start.items()}
        model.train()
        for pos in range(m):
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
        model.load_state_dict(acc)
        pacer.round_done()
    peer_common.save_final(args.final, model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
