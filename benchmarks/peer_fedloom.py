"""fedloom on a spec of the peers section (:mod:`peer_common`), in fedloom's venv.

The same run as the peers': fedloom's own config (seed 0, FedAvg, the spec's
model, cohort size, learning rate, batch size and epochs) on the spec's
arrays; fedloom draws its cohorts and batch orders itself, and the driver
checks that they and the initial parameters are the ones the spec hands the
peers. ``--no-dropout`` trains the same model with its dropout layers at
``p = 0`` (the equivalence check; dropout masks come from each framework's
own generator).

    python benchmarks/peer_fedloom.py --spec DIR --backend sequential [--final W.pt]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import peer_common
import torch


def fedloom_config(spec: dict) -> dict:
    model: dict = {"name": spec["model"]}
    if spec["model"] == "mlp":
        model["hidden"] = [spec["hidden"]]
    cfg = {
        "name": "peers", "seed": 0, "rounds": 10_000,
        "data": {"num_clients": spec["clients"], "test_fraction": 0.0},
        "model": model, "cohort": {"size": spec["per_round"]},
        "client": {"lr": spec["lr"], "batch_size": spec["batch"], "epochs": spec["epochs"]},
        "eval": {"every": 10_000}, "checkpoint": {"every": 0},
    }
    return cfg


def dataset(spec: dict, x: np.ndarray, y: np.ndarray):
    from fedloom.data import from_arrays

    client = np.repeat(np.arange(spec["clients"]), spec["samples"])
    return from_arrays(x, y, client=client, X_test=x[:100], y_test=y[:100], name="peers")


def main(argv: list[str] | None = None) -> int:
    p = peer_common.arg_parser()
    p.add_argument("--backend", default="sequential", help="fedloom overrides, comma-separated")
    args = p.parse_args(argv)
    folder = Path(args.spec)
    spec = torch.load(folder / "spec.pt", weights_only=True)
    x, y = np.load(folder / "x.npy"), np.load(folder / "y.npy")
    rounds = args.rounds or len(spec["cohorts"])

    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment

    over = [f"backend={args.backend.split(',')[0]}", *args.backend.split(",")[1:]]
    cfg = load_config(fedloom_config(spec), over)
    model = None
    if args.no_dropout:
        from fedloom.models import build_model

        model = build_model(cfg.model, tuple(spec["in_shape"]), spec["classes"], cfg.seed)
        for mod in model.modules():
            if isinstance(mod, torch.nn.Dropout):
                mod.p = 0.0
    exp = Experiment.from_config(cfg, data=dataset(spec, x, y), model=model)
    st = exp.init()
    init = torch.cat([t.reshape(-1) for t in spec["init"]])
    if not torch.equal(st.w, init):
        raise SystemExit("fedloom: the spec's initial parameters are not this run's")
    pacer = peer_common.Pacer(rounds)
    for r in range(rounds):
        if not torch.equal(exp.sample_cohort(r), torch.as_tensor(spec["cohorts"][r])):
            raise SystemExit(f"fedloom: round {r + 1}'s cohort is not the spec's")
        st, _ = exp.round(st)
        pacer.round_done()
    exp.close()
    peer_common.save_final(args.final, st.w)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
