"""DP-FedAvg side by side with pfl-research's own, on one setting of the privacy page.

The setting is ``configs/privacy/mnist.yaml`` (docs/results/privacy.md): MNIST over 100
clients by Dirichlet(1.0), 10 clients a round, MLP 784-64-10, 1 local epoch of batch 32,
client lr 0.1, server lr 1, 20 rounds, every client counted once, each update clipped to
C = 0.3, Gaussian noise z·C on the sum, the mean over 10; ε accounted for 10 expected of
10,000 users a round (rate 0.001) at δ = 1e-6 by PLD. For each seed and ε the noise
multiplier z is the one the page pins for that ε (PLD, Poisson, 20 rounds).

Both frameworks start from fedloom's initial model of the seed and train the same clients'
samples (fedloom's split of the seed, exported); each draws its own cohorts and batches:

- fedloom: ``fedloom.run`` of the config (Poisson cohorts of expected size 10, the fixed
  denominator 10); ε by ``fedloom.accounting.Accountant("pld", "poisson")`` at the run's
  rate, z and rounds (the run's own counter, RDP, is recorded beside it);
- pfl 0.6 (run in the peer venv of ``benchmarks/privacy_reference.py``):
  ``FederatedAveraging`` on a ``SimulatedBackend`` whose postprocessors are
  ``WeightByUser`` and ``CentrallyAppliedPrivacyMechanism(GaussianMechanism.
  from_privacy_accountant(PLDPrivacyAccountant(20, 0.001, "gaussian", noise_parameter=z,
  delta=1e-6), clipping_bound=0.3))`` (pfl clips each user's difference, adds noise of std
  z·C to the sum and averages over the users); cohorts of exactly 10 clients drawn without
  replacement each round (numpy, seeded by the seed), local SGD through
  ``NNTrainHyperParams`` (pfl slices its batches in order), central SGD at lr 1; ε is its
  accountant's. Final test accuracy on MNIST's 10,000 test images for both.

The one departure: pfl's cohort has a fixed size, accounted as Poisson sampling (pfl's
simulation), where fedloom draws Poisson cohorts (mean 10) and divides by 10.

    python benchmarks/privacy_pfl.py            # writes benchmarks/privacy_pfl.{json,md}

(20 minutes for 3 seeds x 2 epsilons on the shared 2-core machine at load 11, the peer
venv built; docs/results/privacy.md quotes the tables.) ``--tables`` rewrites the .md
from the .json.

``--seeds``, ``--eps`` choose the grid; ``--venv`` names another peer venv; ``--pfl SPEC``
is the step that runs inside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "privacy" / "mnist.yaml"
OUT = ROOT / "benchmarks" / "privacy_pfl"
VENV = Path("/tmp/fedloom-privacy-peers")
COMMAND = "python benchmarks/privacy_pfl.py"
# the page's pinned z per ε (configs/privacy/suite.yaml): PLD, Poisson q = 0.001, T = 20
NOISE = {1.0: 0.5944, 2.0: 0.5215, 4.0: 0.4390, 8.0: 0.3448}
RATE, DELTA = 0.001, 1e-6


def _peer_venv(venv: Path) -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import privacy_reference

    return privacy_reference._peer_venv(venv)


def export(seed: int, folder: Path) -> dict[str, Any]:
    """fedloom's split, initial model and test set of ``seed`` into ``folder/spec.pt``."""
    import torch

    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment

    cfg = load_config(str(CONFIG), [f"seed={seed}"])
    exp = Experiment.from_config(cfg)
    fed = exp.fed
    x, y = fed.dataset.x, fed.dataset.y
    spec = {"clients": [(x[torch.from_numpy(i)].clone(), y[torch.from_numpy(i)].clone())
                        for i in fed.train],
            "x_test": fed.x_test.clone(), "y_test": fed.y_test.clone(),
            "init": [p.detach().clone() for p in exp.module.parameters()],
            "hidden": cfg.model.options["hidden"][0], "rounds": cfg.rounds,
            "per_round": cfg.cohort.size, "clip": cfg.privacy.clip, "lr": cfg.client.lr,
            "server_lr": cfg.server.lr, "batch": cfg.client.batch_size,
            "epochs": cfg.client.epochs, "seed": seed}
    exp.close()
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(spec, folder / "spec.pt")
    return spec


def run_fedloom(seed: int, z: float) -> dict[str, float]:
    """The config's run at ``z``; its ε by PLD (fedloom.accounting, the summary's rate and
    rounds) beside the run's own RDP counter (the config's accountant: PLD's per-round
    count costs minutes a run on this machine, for the same number)."""
    import fedloom
    from fedloom.accounting import Accountant

    t = time.perf_counter()
    res = fedloom.run(str(CONFIG), overrides=[f"seed={seed}", f"privacy.noise_multiplier={z}"])
    s, acct = res.summary, res.summary["dp_accounting"]
    pld = Accountant("pld", acct["sampling"], acct["neighbours"]).epsilon(
        float(acct["rate"]), z, int(s["rounds"]), float(s["dp_delta"]))
    return {"test_acc": float(s["test_acc"]), "epsilon": pld,
            "epsilon_rdp": float(s["dp_epsilon"]), "seconds": time.perf_counter() - t}


def pfl_step(spec_path: Path, z: float, out: Path) -> None:
    """Inside the peer venv: pfl's DP-FedAvg on the exported spec; writes ``out``."""
    import logging

    import numpy as np
    import peer_common  # beside this script, sys.path[0] when it runs
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Weighted
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import (
        CentrallyAppliedPrivacyMechanism,
        GaussianMechanism,
        PLDPrivacyAccountant,
    )

    logging.getLogger("pfl").setLevel(logging.WARNING)
    spec = torch.load(spec_path, weights_only=True)
    seed, m, rounds = int(spec["seed"]), int(spec["per_round"]), int(spec["rounds"])
    torch.manual_seed(seed)
    x_test = spec["x_test"]
    net = torch.nn.Sequential(torch.nn.Flatten(),
                              torch.nn.Linear(x_test[0].numel(), spec["hidden"]),
                              torch.nn.ReLU(), torch.nn.Linear(spec["hidden"], 10))
    with torch.no_grad():
        for p, q in zip(net.parameters(), spec["init"], strict=True):
            p.copy_(q.reshape(p.shape))

    net = peer_common.pfl_methods(net, Weighted)  # pfl asks the module for its loss and metrics
    users = spec["clients"]
    # each round: m distinct clients, uniformly, from a generator seeded by the seed
    rng = np.random.default_rng(seed)
    order = iter([int(k) for _ in range(2 * rounds + 2)  # more than pfl asks for
                  for k in rng.choice(len(users), size=m, replace=False)])
    train = FederatedDataset(lambda k: Dataset(raw_data=list(users[k]), user_id=str(k)),
                             lambda: next(order))
    val = FederatedDataset(lambda k: Dataset(raw_data=[x_test[:1], spec["y_test"][:1]]),
                           lambda: 0)
    accountant = PLDPrivacyAccountant(num_compositions=rounds, sampling_probability=RATE,
                                      mechanism="gaussian", noise_parameter=z, delta=DELTA)
    mechanism = CentrallyAppliedPrivacyMechanism(GaussianMechanism.from_privacy_accountant(
        accountant, clipping_bound=float(spec["clip"])))
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(),
                                                           lr=float(spec["server_lr"])))
    t = time.perf_counter()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds,
                                           evaluation_frequency=10**9,
                                           train_cohort_size=m, val_cohort_size=0),
        backend=SimulatedBackend(training_data=train, val_data=val,
                                 postprocessors=[WeightByUser(), mechanism]),
        model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=float(spec["lr"]),
                                              local_num_epochs=int(spec["epochs"]),
                                              local_batch_size=int(spec["batch"])),
        model_eval_params=NNEvalHyperParams(local_batch_size=1000))
    net.eval()
    with torch.no_grad():
        acc = float((net(x_test).argmax(1) == spec["y_test"]).double().mean())
    out.write_text(json.dumps({"test_acc": acc, "epsilon": float(accountant.epsilon),
                               "seconds": time.perf_counter() - t}))


def _table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| ε (target) | z | seed | fedloom test acc | pfl test acc | fedloom ε (PLD) "
             "| pfl ε (PLD) | fedloom run's counter (RDP) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, p = r["fedloom"], r["pfl"]
        lines.append(f"| {r['eps']:g} | {r['z']:g} | {r['seed']} | {100 * f['test_acc']:.2f} | "
                     f"{100 * p['test_acc']:.2f} | {f['epsilon']:.3f} | {p['epsilon']:.3f} | "
                     f"{f['epsilon_rdp']:.3f} |")
    return lines


def _means(rows: list[dict[str, Any]]) -> list[str]:
    """Per ε: mean ± sd of each framework, and fedloom − pfl paired by seed (95 %
    t-interval, fedloom.report.stats.paired)."""
    import statistics as st

    from fedloom.report.stats import paired

    def sd(v: list[float]) -> str:
        return f"{st.stdev(v):.2f}" if len(v) > 1 else "–"

    lines = ["| ε (target) | seeds | fedloom test acc | pfl test acc | fedloom − pfl, paired |",
             "|---|---|---|---|---|"]
    for eps in sorted({r["eps"] for r in rows}):
        sel = [r for r in rows if r["eps"] == eps]
        f = {r["seed"]: 100 * r["fedloom"]["test_acc"] for r in sel}
        p = {r["seed"]: 100 * r["pfl"]["test_acc"] for r in sel}
        lines.append(f"| {eps:g} | {len(sel)} | {st.mean(f.values()):.2f} ± "
                     f"{sd(list(f.values()))} | {st.mean(p.values()):.2f} ± "
                     f"{sd(list(p.values()))} | {paired(f, p).text(unit='pp')} |")
    return lines


def _write(record: dict[str, Any], out: Path) -> str:
    rows = record["rows"]
    md = [f"`{COMMAND}` (setting: `{record['config']}`; ε at δ = {DELTA:g}, rate {RATE:g}, "
          "PLD):", "", *_table(rows), "", *_means(rows), ""]
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(md))
    return "\n".join(md)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--eps", type=float, nargs="+", default=[1.0, 8.0])
    ap.add_argument("--venv", type=Path, default=VENV)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--pfl", type=Path, help="(inside the peer venv) the spec to run")
    ap.add_argument("--z", type=float)
    ap.add_argument("--result", type=Path)
    ap.add_argument("--tables", action="store_true", help="rewrite the .md from the .json")
    args = ap.parse_args(argv)
    if args.tables:
        print(_write(json.loads(args.out.with_suffix(".json").read_text()), args.out))
        return 0
    if args.pfl is not None:
        pfl_step(args.pfl, args.z, args.result)
        return 0
    bad = [e for e in args.eps if e not in NOISE]
    if bad:
        print(f"--eps: {bad[0]:g} has no pinned noise (one of {sorted(NOISE)})", file=sys.stderr)
        return 2
    py = _peer_venv(args.venv)
    work = args.out.with_suffix(".work")
    rows = []
    for seed in args.seeds:
        spec_path = work / f"seed{seed}" / "spec.pt"
        export(seed, spec_path.parent)
        for eps in args.eps:
            z = NOISE[eps]
            res = work / f"seed{seed}" / f"pfl-eps{eps:g}.json"
            with open(res.with_suffix(".log"), "w") as log:  # pfl prints every round
                subprocess.run([str(py), __file__, "--pfl", str(spec_path), "--z", str(z),
                                "--result", str(res)], check=True, stdout=log)
            rows.append({"seed": seed, "eps": eps, "z": z, "fedloom": run_fedloom(seed, z),
                         "pfl": json.loads(res.read_text())})
            print(json.dumps(rows[-1]), flush=True)
    record = {"command": COMMAND, "config": str(CONFIG.relative_to(ROOT)), "rate": RATE,
              "delta": DELTA, "rows": rows, "python": platform.python_version()}
    print(_write(record, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
