"""Behaviour unchanged: a record of tiny runs to hold a refactor against.

Runs about fifty three-round configs, each exercising one path of the round
(aggregators, feedback policies, local methods, privacy, attacks, the system
model, buffers, a rejected client), on the sequential backend with one
thread (the local methods and CRAFT's trust step on vmap and lock-step too),
and records each run's ``model_sha256`` and every ``metrics.jsonl`` line
without its wall-clock fields. ``check`` runs them again and names every run
whose model or metrics differ from the record; with ``--ckpt`` it also
resumes, with this code, the round-2 checkpoints that ``record`` wrote, and
checks that each ends on the uninterrupted run's model.

The record belongs to the machine and the code that wrote it (float32
kernels round differently on another CPU): it is not a test and is not
committed. Use it around a change::

    python benchmarks/behaviour.py record /tmp/before.json --ckpt /tmp/before-ckpt
    ... change the code ...
    python benchmarks/behaviour.py check /tmp/before.json --ckpt /tmp/before-ckpt
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import fedloom

# Measured by the clock, so never equal between two runs.
WALL_CLOCK = ("train_s", "agg_s", "wall_s")

BASE: dict[str, Any] = {
    "name": "behaviour",
    "seed": 3,
    "rounds": 3,
    "data": {"name": "digits", "num_clients": 10,
             "partition": {"name": "dirichlet", "options": {"alpha": 0.5, "min_samples": 20}}},
    "model": {"name": "mlp", "options": {"hidden": [16]}},
    "cohort": {"size": 4},
    "client": {"lr": 0.1, "batch_size": 16, "epochs": 1},
    "eval": {"every": 1},
    "checkpoint": {"every": 1},
    "backend": {"name": "sequential", "threads": 1},
}

# name -> dotted overrides of BASE. Some are written the old way (compression.period=2,
# compression.alpha_schedule=theory: fedloom.config.translate), on purpose: a record
# made before options moved into {name, options} sections holds those runs, and the
# check then runs them through the translation.
CASES: dict[str, list[str]] = {
    "fedavg": [],
    # the paper's step, pinned: the record's craft runs were made at the old default
    "craft": ["aggregator.name=craft", "aggregator.options.step=fixed"],
    "krum": ["aggregator.name=krum", "aggregator.options={f: 1}"],
    "scaffold": ["client.method=scaffold"],
    "ditto": ["client.method=ditto"],
    "sapef_theory": ["compression.name=topk", "compression.options={ratio: 0.1}",
                     "compression.feedback=sapef", "compression.alpha_schedule=theory"],
    "ef21": ["compression.name=topk", "compression.options={ratio: 0.1}",
             "compression.feedback=ef21"],
    "cser": ["compression.name=topk", "compression.options={ratio: 0.1}",
             "compression.feedback=cser", "compression.period=2"],
    "flare": ["compression.name=topk", "compression.options={ratio: 0.05}",
              "compression.feedback=flare"],
    "ffl": ["compression.name=topk", "compression.options={ratio: 0.1}",
            "compression.feedback=ef", "compression.adaptive=ffl"],
    "mismatch": ["compression.name=topk", "compression.options={ratio: 0.1}",
                 "compression.feedback=sapef", "metrics.mismatch=true"],
    # the accounting pinned: the record's private runs were made under RDP, replace-one
    "central_dp": ["privacy.mode=central", "privacy.clip=1.0", "privacy.noise_multiplier=0.5",
                   "server.lr=1.0", "privacy.accountant=rdp", "privacy.neighbours=replace_one"],
    "local_dp": ["privacy.mode=local", "privacy.clip=1.0", "privacy.noise_multiplier=0.1",
                 "server.lr=1.0", "privacy.accountant=rdp", "privacy.neighbours=replace_one"],
    "attack": ["attack.name=sign_flip", "attack.fraction=0.3", "aggregator.name=median"],
    "system_partial": ["system.profile=lognormal", "system.speed=[300,1.0]",
                       "system.up_bps=[3e4,0.5]", "system.latency_s=0.1",
                       "system.deadline_s=3.0", "system.late=partial", "system.dropout=0.2"],
    "buffers_local": ["model.name=resnet", "model.options={depth: 8, width: 4, norm: batch}",
                      "model.buffers=local", "data.num_clients=6", "cohort.size=3",
                      "client.batch_size=32", "rounds=2"],
    "scafcom": ["compression.name=topk", "compression.options={ratio: 0.1}",
                "compression.feedback=scafcom"],
    "vmap_flare": ["backend.name=vmap", "compression.name=topk",
                   "compression.options={ratio: 0.05}", "compression.feedback=flare"],
    "rejected": ["server.max_update_norm=0.9", "server.clip_norm=0.8"],
}

# The local methods and CRAFT's trust step on each client backend: a restructuring
# of local training must keep every one of them (a method a backend cannot run
# falls back to sequential, and the record holds that too).
_BN = ["model.name=resnet", "model.options={depth: 8, width: 4, norm: batch}",
       "data.num_clients=6", "cohort.size=3", "client.batch_size=32", "rounds=2"]
_LOCAL: dict[str, list[str]] = {
    "fedprox": ["client.prox_mu=0.1"],
    "feddyn": ["client.method=feddyn"],
    "moon": ["client.method=moon"],
    "fedper": ["client.method=fedper"],
    "fedrep": ["client.method=fedrep"],
    "fedbabu": ["client.method=fedbabu"],
    "apfl": ["client.method=apfl"],
    "lg_fedavg": ["client.method=lg_fedavg"],
    "fedbn": ["client.method=fedbn", *_BN],
    "craft_rprop": ["aggregator.name=craft", "aggregator.options={step: rprop, step_max: 100}"],
}
for _name, _ov in _LOCAL.items():
    for _backend in ("sequential", "vmap", "lockstep"):
        CASES[f"{_name}_{_backend}"] = [*_ov, f"backend.name={_backend}"]


def _metrics(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if k not in WALL_CLOCK}


def _config(overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    return copy.deepcopy(BASE), list(overrides)


def run_all(names: list[str]) -> dict[str, Any]:
    out = {}
    for name in names:
        cfg, ov = _config(CASES[name])
        res = fedloom.run(cfg, ov)
        out[name] = {"model_sha256": res.summary["model_sha256"],
                     "buffers_sha256": res.summary.get("buffers_sha256"),
                     "metrics": [_metrics(m) for m in res.metrics]}
        print(f"{name:16s} {res.summary['model_sha256'][:16]} "
              f"rejected={res.summary['rejected_updates_total']}", flush=True)
    return out


def write_checkpoints(names: list[str], root: Path) -> None:
    """A run directory per case, stopped after its round 2 (a KeyboardInterrupt
    from a callback, as a user's Ctrl-C), its checkpoints on disk."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)

    def stop(state: Any, metrics: dict[str, Any]) -> None:
        if state.next_round == 2:
            raise KeyboardInterrupt

    for name in names:
        cfg, ov = _config(CASES[name])
        try:
            fedloom.run(cfg, ov, out=root / name, callbacks=[stop])
        except KeyboardInterrupt:
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("record", "check"))
    ap.add_argument("file", type=Path)
    ap.add_argument("--ckpt", type=Path, help="round-2 run directories (record writes, "
                    "check resumes them)")
    ap.add_argument("--only", nargs="*", default=None, help="these cases only")
    a = ap.parse_args(argv)
    names = a.only or list(CASES)
    got = run_all(names)
    if a.mode == "record":
        a.file.write_text(json.dumps(got, indent=1))
        if a.ckpt is not None:
            write_checkpoints(names, a.ckpt)
        print(f"recorded {len(got)} runs in {a.file}")
        return 0
    want = json.loads(a.file.read_text())
    bad = []
    for name in names:
        w, g = want[name], got[name]
        if w["model_sha256"] != g["model_sha256"] or w["buffers_sha256"] != g["buffers_sha256"]:
            bad.append(f"{name}: model {w['model_sha256'][:12]} -> {g['model_sha256'][:12]}")
        elif json.dumps(w["metrics"]) != json.dumps(g["metrics"]):  # NaN equals NaN here
            diff = next(f"round {i + 1} {k}: {a_.get(k)!r} -> {b_.get(k)!r}"
                        for i, (a_, b_) in enumerate(zip(w["metrics"], g["metrics"], strict=False))
                        for k in sorted(set(a_) | set(b_))
                        if json.dumps(a_.get(k)) != json.dumps(b_.get(k)))
            bad.append(f"{name}: metrics differ at {diff}")
    resumed = 0
    if a.ckpt is not None:
        work = Path(tempfile.mkdtemp(prefix="behaviour-"))
        for name in names:
            cfg, ov = _config(CASES[name])
            # on a copy: the recorded checkpoints stay at round 2 for the next check
            shutil.copytree(a.ckpt / name, work / name)
            res = fedloom.run(cfg, ov, out=work / name, resume=True)
            resumed += 1
            if res.summary["model_sha256"] != want[name]["model_sha256"]:
                bad.append(f"{name}: resumed from the old round-2 checkpoint to "
                           f"{res.summary['model_sha256'][:12]}, uninterrupted "
                           f"{want[name]['model_sha256'][:12]}")
        shutil.rmtree(work, ignore_errors=True)
    for line in bad:
        print("DIFFERS", line)
    print(f"{len(names) - len([b for b in bad if 'resumed' not in b])}/{len(names)} runs "
          f"identical; {resumed - len([b for b in bad if 'resumed' in b])}/{resumed} resumed "
          "to the uninterrupted model")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
