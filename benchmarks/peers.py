"""Section ``peers`` of ``make bench``: fedloom against pfl-research and FLGo, side by side.

    python benchmarks/bench.py --only peers [--quick] [--repeats N]

Two workloads, each run by every framework on the same data, model,
initialisation, optimiser, cohorts, batch order and rounds:

- ``reference`` (:mod:`workload`): 100 clients × 600 samples × 784 features,
  MLP 784-200-10, 1 epoch of batch 32, SGD lr 0.05, FedAvg; 10 and 100 clients
  a round;
- ``pfl_cifar10``: pfl-research's CIFAR-10 benchmark shape (Granqvist et al.
  2024, arXiv 2404.06430; its ``benchmarks/image_classification`` baseline
  config): 1,000 clients × 50 images of 3 × 32 × 32, 50 a round, 1 epoch of
  batch 10, local SGD lr 0.1, central step 1 (FedAvg), its ``simple_cnn``
  (fedloom's ``pfl_cnn``). CIFAR-10's training images from ``data.options.root`` /
  ``$FEDLOOM_DATA`` where they are on disk (normalised with CIFAR-10's channel
  means and deviations), otherwise uniform random images of that shape
  labelled by a fixed random linear teacher (the page says which). Departure:
  pfl's benchmark evaluates centrally every 10 rounds; no framework evaluates
  here.

fedloom writes a spec folder (:mod:`peer_common`: the arrays, fedloom's
initial parameters, its cohort of every round and every cohort client's
sample order), and each framework runs as its own process on it —
:mod:`peer_fedloom` (fedloom's venv, one process per backend),
:mod:`peer_pfl` and :mod:`peer_flgo`, each in its own virtualenv under
``.bench-venvs/NAME`` created here with pinned versions (torch 2.13.0 first,
then the peer; a peer that cannot be installed is skipped with one line).
``--quick`` never creates a venv: a peer whose venv is not there yet is
skipped with one line; it runs the reference MLP alone at toy sizes (10
clients × 40 samples, 5 a round) on fedloom's ``sequential`` backend and the
peers.

:mod:`peer_torch` runs the same batches in plain PyTorch (no framework): the
floor the goals' reasons compare with. :mod:`peer_flower` runs Flower's
simulation (``flwr[simulation]``, fedloom's venv; skipped with one line where
it is missing, and with ``--quick``). Every training process runs torch on
one intra-op thread (``THREADS``). Both cores: fedloom's ``process`` backend
(two single-thread workers, each ``sequential`` or ``lockstep`` on its half of
the cohort), FLGo's ``num_parallels=2`` (two clients at a time in threads),
pfl's multi-worker simulation (two workers under ``torch.distributed.run``,
where the cohort splits evenly) and Flower (Ray, one CPU a client).

``python benchmarks/peers.py --workload KEY --frameworks A,B,…`` runs some of
the frameworks on one workload the same way and prints their figures as JSON
(it never installs a venv).

Timing: every driver runs round 1 at once — launch → end of round 1 is
measured from the parent's start of that process, one framework at a time —
then waits; the parent then sends each framework a ``go`` in turn, so their
rounds interleave (the order rotates each round) and the machine's load falls
on all of them alike. A framework's figure is the median of its rounds after
round 1 (``repeats`` of them; at least 9 on the reference workload, whose
rounds take a second or less, and 5 on the CIFAR-10 shape). Flower's simulation runs
after the others, on its own (:data:`ALONE`): Ray's processes keep the cores
busy while they wait, which slowed the frameworks beside it 5×.

Equivalence: every driver writes its final parameters. On the MLP (no random
forward) all frameworks trained the same cohorts on the same batches from the
same start, so the final models of the timing run are compared directly
(max |Δ| against fedloom's ``sequential``). The CNN's dropout masks come from
each framework's own generator, so for it one extra round is run by fedloom
``sequential`` and each peer with the dropout layers at ``p = 0``, and those
are compared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VENVS = ROOT / ".bench-venvs"
TORCH_PIN = "torch==2.13.0"
# FLGo 0.4.4 lists an unpinned torchvision, whose PyPI wheels need another torch
# than 2.13.0 (pip would replace torch with a CUDA build of several GB); FLGo's core
# never imports it, so FLGo goes in with --no-deps and its other requirements, pinned.
PEERS: dict[str, dict[str, Any]] = {
    "pfl": {"pins": ["pfl==0.6.0"], "no_deps": [], "module": "pfl",
            "script": "peer_pfl.py"},
    "flgo": {"pins": ["numpy==2.4.6", "scipy==1.17.1", "matplotlib==3.11.2", "tqdm==4.70.1",
                      "prettytable==3.18.0", "ujson==6.1.0", "pynvml==13.0.1",
                      "PyYAML==6.0.4", "networkx==3.6.1", "requests==2.34.2", "toolz==1.2.0"],
             "no_deps": ["flgo==0.4.4"], "module": "flgo", "script": "peer_flgo.py"},
}
# torch's intra-op threads of every framework's training process. One: on a machine
# shared with other jobs, two OpenMP threads spin-wait for cores other processes
# hold (a round of the toy spec took 3.2 s on 2 threads and 0.03 s on 1 here, at
# load 10), and FLGo's own default is 1. fedloom's process backend runs its 2
# workers with 1 thread each, its default.
THREADS = 1
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


# ------------------------------------------------------------------ workloads
def workloads(quick: bool) -> dict[str, dict[str, Any]]:
    """The runs of the section: the model, sizes and training settings of each."""
    import workload

    ref = {"model": "mlp", "hidden": workload.HIDDEN, "in_shape": [workload.DIM],
           "classes": workload.CLASSES, "lr": workload.LR, "batch": workload.BATCH,
           "epochs": 1, "data": "reference"}
    cifar = {"model": "pfl_cnn", "in_shape": [3, 32, 32], "classes": 10, "lr": 0.1,
             "batch": 10, "epochs": 1, "data": "cifar10"}
    if quick:  # one toy run: every driver's process start is seconds on a loaded machine
        return {"reference/5": {**ref, "clients": 10, "samples": 40, "per_round": 5}}
    # More rounds than 3 where a ratio is close: in one idle run, one round in three of
    # each two-process framework took 15-60 % longer than its other two (process+
    # lockstep at 100 a round: 0.648, 0.483, 0.591 s), enough to move a ratio by 0.2
    return {"reference/10": {**ref, "clients": workload.CLIENTS, "samples": workload.SAMPLES,
                             "per_round": 10, "min_repeats": 9},
            "reference/100": {**ref, "clients": workload.CLIENTS,
                              "samples": workload.SAMPLES, "per_round": 100, "min_repeats": 9},
            "pfl_cifar10/50": {**cifar, "clients": 1000, "samples": 50, "per_round": 50,
                               "min_repeats": 5}}


def make_data(wl: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, str]:
    """``(x float32, y int64, where they come from)``; client ``k`` owns rows
    ``k·n … (k+1)·n − 1``."""
    clients, n = wl["clients"], wl["samples"]
    if wl["data"] == "reference":
        import workload

        xs, ys = zip(*(workload.client_arrays(k, n) for k in range(clients)), strict=True)
        return (torch.cat(xs).numpy(), torch.cat(ys).numpy(),
                "the reference workload's synthetic data")
    total = clients * n
    try:
        from fedloom.data.disk import data_root, read_cifar

        arrs = read_cifar("cifar10", data_root())
        if len(arrs["train_y"]) < total:
            raise ValueError("too few images")
        u8 = torch.from_numpy(arrs["train_x"][:total]).permute(0, 3, 1, 2).float() / 255
        mean = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
        x = ((u8 - mean) / std).numpy()
        return (np.ascontiguousarray(x, dtype=np.float32),
                arrs["train_y"][:total].astype(np.int64),
                f"CIFAR-10's first {total:,} training images (from disk)")
    except Exception:
        pass
    gen = torch.Generator().manual_seed(2024)  # images, then the teacher: fixed draws
    x = (torch.rand(total, 3, 32, 32, generator=gen) - 0.5) / 0.25
    teacher = torch.randn(3 * 32 * 32, 10, generator=gen)
    y = (x.reshape(total, -1) @ teacher).argmax(1)
    return (x.numpy(), y.numpy(),
            "random images (CIFAR-10 is not on disk): uniform pixels, normalised, "
            "labelled by the argmax of a fixed random linear map")


def export_spec(wl: dict[str, Any], folder: Path, rounds: int,
                data: tuple[np.ndarray, np.ndarray, str] | None = None) -> dict[str, Any]:
    """Write the spec folder of :mod:`peer_common` for ``rounds`` rounds of ``wl``
    and return the spec: fedloom's initial parameters, cohorts and sample orders,
    read off the fedloom run the fedloom driver makes."""
    from peer_fedloom import dataset, fedloom_config

    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment
    from fedloom.rng import Purpose, derive_seed

    x, y, source = data if data is not None else make_data(wl)
    folder.mkdir(parents=True, exist_ok=True)
    np.save(folder / "x.npy", x)
    np.save(folder / "y.npy", y)
    spec: dict[str, Any] = {k: wl[k] for k in ("model", "in_shape", "classes", "lr", "batch",
                                               "epochs", "clients", "samples", "per_round")}
    if wl["model"] == "mlp":
        spec["hidden"] = wl["hidden"]
    cfg = load_config(fedloom_config(spec), ["backend=sequential"])
    exp = Experiment.from_config(cfg, data=dataset(spec, x, y))
    spec["init"] = [p.detach().clone() for p in exp.module.parameters()]
    cohorts = [exp.sample_cohort(r) for r in range(rounds)]
    spec["cohorts"] = torch.stack(cohorts)
    # fedloom's batch order (LocalSGD.job_batches): one permutation per epoch from a
    # generator seeded with derive_seed(seed, round, client, "batch")
    perms = []
    for r, cohort in enumerate(cohorts):
        row = []
        for k in cohort.tolist():
            gen = torch.Generator()
            gen.manual_seed(derive_seed(cfg.seed, r, k, Purpose.BATCH))
            row.append(torch.randperm(wl["samples"], generator=gen))
        perms.append(torch.stack(row))
    spec["perms"] = torch.stack(perms)
    exp.close()
    torch.save(spec, folder / "spec.pt")
    spec["source"] = source
    return spec


# --------------------------------------------------------------------- venvs
def venv_python(name: str) -> Path:
    return VENVS / name / "bin" / "python"


def _pins(name: str) -> str:
    p = PEERS[name]
    return "\n".join([TORCH_PIN, *p["no_deps"], *p["pins"]]) + "\n"


def ensure_venv(name: str, quick: bool) -> tuple[Path | None, str]:
    """``(python of the peer's venv, "")``, or ``(None, the one line why it is skipped)``.
    A venv counts as there when its stamp lists the pins asked for now."""
    py, stamp = venv_python(name), VENVS / name / "fedloom-pins.txt"
    if py.exists() and stamp.exists() and stamp.read_text() == _pins(name):
        return py, ""
    if quick:
        return None, (f"peers: {name} skipped: --quick does not install (no .bench-venvs/"
                      f"{name} yet; `python benchmarks/bench.py --only peers` creates it)")
    base = getattr(sys, "_base_executable", sys.executable)
    p = PEERS[name]
    steps = [[base, "-m", "venv", "--clear", str(VENVS / name)],
             [str(py), "-m", "pip", "install", "-q", TORCH_PIN]]
    if p["no_deps"]:
        steps.append([str(py), "-m", "pip", "install", "-q", "--no-deps", *p["no_deps"]])
    steps.append([str(py), "-m", "pip", "install", "-q", TORCH_PIN, *p["pins"]])
    steps.append([str(py), "-c", f"import {p['module']}"])
    first = ", ".join([TORCH_PIN, *p["no_deps"], *p["pins"][:1]])
    print(f"peers: creating .bench-venvs/{name} ({first}{', …' if len(p['pins']) > 1 else ''})",
          file=sys.stderr, flush=True)
    for cmd in steps:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"peers: {name} skipped: `{' '.join(cmd[-3:])}` failed: {e}"
        if res.returncode != 0:
            errs = [ln for ln in res.stderr.splitlines() if ln.strip()
                    and not ln.startswith("WARNING")] or ["(no message)"]
            return None, f"peers: {name} skipped: `{' '.join(cmd[2:])}` failed: {errs[-1]}"
    stamp.write_text(_pins(name))
    return py, ""


# ------------------------------------------------------------------ running
def _read_round(proc: subprocess.Popen, name: str) -> dict[str, Any]:
    """The next round line of a driver (other output on its stdout is skipped)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.strip()
        if line.startswith("{") and '"round"' in line:
            return json.loads(line)
    raise RuntimeError(f"{name} ended before reporting a round (exit {proc.wait()})")


def run_frameworks(frameworks: list[tuple[str, list[str]]], folder: Path, rounds: int,
                   final: bool = True) -> dict[str, dict[str, Any]]:
    """Launch each driver in turn (its launch → end of round 1 measured alone), then
    interleave the remaining rounds; return each framework's figures, or its error."""
    procs: dict[str, subprocess.Popen] = {}
    logs: dict[str, Any] = {}
    out: dict[str, dict[str, Any]] = {}
    for name, cmd in frameworks:
        log = tempfile.TemporaryFile(mode="w+")
        logs[name] = log
        extra = ["--final", str(folder / f"final-{name.replace(':', '-')}.pt")] if final else []
        t0 = time.monotonic()
        proc = subprocess.Popen([*cmd, "--spec", str(folder), "--rounds", str(rounds), *extra],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                text=True, cwd=str(ROOT))
        try:
            first = _read_round(proc, name)
        except RuntimeError as e:
            log.seek(0)
            tail = [ln for ln in log.read().splitlines() if ln.strip()][-1:] or [""]
            out[name] = {"error": f"{e}: {tail[0][:300]}"}
            print(f"peers: {name} failed: {out[name]['error']}", file=sys.stderr, flush=True)
            continue
        procs[name] = proc
        out[name] = {"launch_s": first["end"] - t0, "rounds_s": []}
    order = list(procs)
    for r in range(1, rounds):
        turn = order[r % len(order):] + order[:r % len(order)] if order else []
        for name in turn:
            proc = procs[name]
            if "error" in out[name]:
                continue
            try:
                assert proc.stdin is not None
                proc.stdin.write("go\n")
                proc.stdin.flush()
                out[name]["rounds_s"].append(_read_round(proc, name)["s"])
            except (RuntimeError, BrokenPipeError) as e:
                out[name] = {"error": str(e)}
    for name, proc in procs.items():
        try:
            rc = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = -9
        if rc != 0 and "error" not in out[name]:
            logs[name].seek(0)
            tail = [ln for ln in logs[name].read().splitlines() if ln.strip()][-1:] or [""]
            out[name] = {"error": f"exit {rc}: {tail[0][:300]}"}
        if "error" not in out[name] and out[name]["rounds_s"]:
            out[name]["round_s"] = statistics.median(out[name]["rounds_s"])
    for log in logs.values():
        log.close()
    return out


# Run after the others, on their own: Ray's processes keep the cores busy while they
# wait (the reference workload at 10 a round, idle machine: fedloom sequential 1.58 s a
# round with Flower's simulation alive beside it, 0.32 s without).
ALONE = ("flower",)


def run_interleaved_then_alone(fws: list[tuple[str, list[str]]], folder: Path, rounds: int,
                               final: bool = True) -> dict[str, dict[str, Any]]:
    """:func:`run_frameworks` on every framework but :data:`ALONE`'s, then on each of
    those alone."""
    res = run_frameworks([f for f in fws if f[0] not in ALONE], folder, rounds, final)
    for f in fws:
        if f[0] in ALONE:
            res.update(run_frameworks([f], folder, rounds, final))
    return res


def _fedloom_backends(wl: dict[str, Any], quick: bool = False) -> list[tuple[str, str]]:
    rows = [("sequential", f"sequential,backend.threads={THREADS}")]
    if quick:
        return rows
    # lockstep: Linear, Conv2d, pooling, dropout (the sequential trainer's masks), ReLU
    rows.append(("lockstep", f"lockstep,backend.threads={THREADS}"))
    rows.append(("process", "process,backend.options.workers=2"))
    # both cores, each worker lock-step on its half of the cohort
    rows.append(("process+lockstep",
                 "process,backend.options.workers=2,backend.options.inner=lockstep"))
    return rows


def flower_reason() -> str | None:
    """Why Flower's simulation cannot run here (None: it can): it needs
    ``flwr[simulation]`` (Ray) in fedloom's own venv."""
    import importlib.util

    missing = [m for m in ("flwr", "ray") if importlib.util.find_spec(m) is None]
    return (f"peers: flower skipped: {', '.join(missing)} not installed "
            "(pip install 'flwr[simulation]')" if missing else None)


# glibc's environment for the two settings fedloom.device.keep_freed_heap makes in
# fedloom's training processes: blocks up to 32 MiB from the heap, up to 1 GiB of it
# kept free at its top. The floors run with them, so that they stay floors.
KEEP_HEAP_ENV = ["MALLOC_MMAP_THRESHOLD_=33554432", "MALLOC_TRIM_THRESHOLD_=1073741824"]


def framework_commands(wl: dict[str, Any], peers: dict[str, Path], quick: bool
                       ) -> list[tuple[str, list[str]]]:
    """Every framework's driver command for ``wl`` (the spec's arguments follow)."""
    py = sys.executable
    fws = [(f"fedloom:{label}", [py, str(HERE / "peer_fedloom.py"), "--backend", over])
           for label, over in _fedloom_backends(wl, quick)]
    # the floor: the same batches in plain PyTorch, no framework, with glibc's heap kept
    # between steps (without it, each step faults in again what the last one freed)
    plain = ["env", *KEEP_HEAP_ENV, py, str(HERE / "peer_torch.py"), "--threads", str(THREADS)]
    fws.append(("plain_torch", plain))
    if not quick:  # the same batches over two processes side by side: the measured floor
        fws.append(("plain_torch:2proc", [*plain, "--procs", "2"]))
    if not quick and flower_reason() is None:  # Ray's start-up is too slow for --quick
        fws.append(("flower", [py, str(HERE / "peer_flower.py"), "--threads", str(THREADS)]))
    for name, path in peers.items():
        script = str(HERE / PEERS[name]["script"])
        fws.append((name, [str(path), script, "--threads", str(THREADS)]))
        if quick:
            continue
        if name == "flgo":  # FLGo's parallel clients, on 2 cores
            fws.append(("flgo:parallel2", [str(path), script, "--threads", str(THREADS),
                                           "--parallels", "2"]))
        if name == "pfl" and wl["per_round"] % 2 == 0:  # pfl's 2 workers, torch's launcher
            fws.append(("pfl:torchrun2", [str(path), "-m", "torch.distributed.run",
                                          "--standalone", "--nproc-per-node", "2", script,
                                          "--threads", str(THREADS)]))
    return fws


def _max_diff(a: Path, b: Path) -> dict[str, float] | None:
    if not (a.exists() and b.exists()):
        return None
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    d = float((wa - wb).abs().max())
    return {"max_abs_diff": d, "relative": d / max(float(wb.abs().max()), 1e-30)}


def run(quick: bool, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"load_before": list(os.getloadavg()), "skipped": {},
                           "workloads": {}, "repeats": repeats, "quick": quick}
    peers: dict[str, Path] = {}
    for name in PEERS:
        path, why = ensure_venv(name, quick)
        if path is None:
            print(why, file=sys.stderr, flush=True)
            out["skipped"][name] = why
        else:
            peers[name] = path
    if flower_reason() is not None:
        print(flower_reason(), file=sys.stderr, flush=True)
        out["skipped"]["flower"] = flower_reason()
    elif quick:
        out["skipped"]["flower"] = "peers: flower not run with --quick (Ray's start-up)"
    for key, wl in workloads(quick).items():
        print(f"peers: {key} …", file=sys.stderr, flush=True)
        rounds = max(repeats, 0 if quick else wl.get("min_repeats", 0)) + 1
        with tempfile.TemporaryDirectory(prefix="fedloom-peers-") as d:
            folder = Path(d)
            data = make_data(wl)
            spec = export_spec(wl, folder, rounds, data)
            del data
            if "flgo" in peers:  # FLGo keeps its task on disk: made once, untimed
                subprocess.run([str(peers["flgo"]), str(HERE / PEERS["flgo"]["script"]),
                                "--spec", str(folder), "--prepare"],
                               capture_output=True, text=True, check=True, timeout=1800)
            fws = framework_commands(wl, peers, quick)
            res = run_interleaved_then_alone(fws, folder, rounds)
            row: dict[str, Any] = {**{k: wl[k] for k in ("model", "clients", "samples",
                                                          "per_round", "batch", "lr")},
                                   "data": spec["source"], "rounds": rounds,
                                   "frameworks": res}
            ref = folder / "final-fedloom-sequential.pt"
            if wl["model"] == "mlp":
                row["equivalence"] = {
                    "rounds": rounds, "dropout": False,
                    **{n: _max_diff(folder / f"final-{n.replace(':', '-')}.pt", ref)
                       for n in res if n != "fedloom:sequential"}}
            else:
                chk = [(n, [*c, "--no-dropout"]) for n, c in fws
                       if n == "fedloom:sequential" or not n.startswith("fedloom")]
                run_interleaved_then_alone(chk, folder, 1)
                row["equivalence"] = {
                    "rounds": 1, "dropout": "off (p = 0) for the check",
                    **{n: _max_diff(folder / f"final-{n.replace(':', '-')}.pt", ref)
                       for n, _ in chk
                       if n != "fedloom:sequential"}}
            out["workloads"][key] = row
    out["load_after"] = list(os.getloadavg())
    return out


# ------------------------------------------------------------------- report
def _best_fedloom(fws: dict[str, Any]) -> tuple[str, float] | None:
    got = [(n.split(":", 1)[1], v["round_s"]) for n, v in fws.items()
           if n.startswith("fedloom:") and "round_s" in v]
    return min(got, key=lambda t: t[1]) if got else None


def markdown(section: dict[str, Any]) -> list[str]:
    lb, la = section.get("load_before", [0, 0, 0]), section.get("load_after", [0, 0, 0])
    lines = ["## Peers: pfl-research, FLGo and Flower", "",
             "`python benchmarks/bench.py --only peers`: every framework in its own process "
             "(pfl 0.6.0 and FLGo 0.4.4 each in its own virtualenv with torch 2.13.0; Flower's "
             "simulation in fedloom's) on the "
             "same data, initial parameters, cohorts, batch order and rounds, exported by "
             "fedloom; rounds interleaved (one round of each framework in turn, the order "
             "rotating), Flower's after the others, alone (its Ray processes keep the cores "
             "busy while they wait, slowing whatever runs beside them). Seconds per round: "
             "median of the "
             f"{section.get('repeats', '?')} rounds after round 1 (9 on the reference "
             "workload, whose rounds take a second or less, 5 on the CIFAR-10 shape); "
             "speed-up = the framework's "
             "time / fedloom's best backend's, measured in the same run. Launch = from "
             "starting the framework's process to the end of its round 1 (imports, data, "
             "set-up, round 1), one framework at a time. Load average (1 min) before / after: "
             f"{lb[0]:.1f} / {la[0]:.1f} on {os.cpu_count()} cores.", "",
             "Cores: every framework's training runs on one intra-op thread. "
             "`fedloom:process` and `fedloom:process+lockstep` (2 worker processes), "
             "`flgo:parallel2` (2 clients at a time in threads), `pfl:torchrun2` (pfl's 2 "
             "workers under torch's launcher, `gloo` all-reduce) and `flower` (Ray, one CPU a "
             "client: 2 at a time) use both cores; the others one. `plain_torch` is the floor "
             "of one core: the same batches in plain PyTorch, no framework, with glibc's "
             "heap kept between steps (the two settings fedloom's training processes make, "
             "given as glibc's environment variables; with glibc's own thresholds each "
             "step faults in again the memory the last one freed, and the floors would not "
             "be floors). "
             "`plain_torch:2proc` is the measured floor of two: the same batches over two "
             "plain-PyTorch processes side by side, nothing between them but the round's "
             "start and their partial sums in shared memory. One core's time ÷ 2 (a perfect "
             "split) assumes that two busy cores do not slow each other; the difference "
             "between the two floors is what sharing the machine's caches and memory costs "
             "two processes here.", ""]
    for why in section.get("skipped", {}).values():
        lines += [f"{why}", ""]
    for row in section.get("workloads", {}).values():
        fws = row["frameworks"]
        best = _best_fedloom(fws)
        title = ("reference workload" if row["model"] == "mlp" else
                 "pfl-research's CIFAR-10 benchmark shape")
        lines += [f"### {title}, {row['per_round']} clients a round", "",
                  f"{row['clients']:,} clients × {row['samples']} samples, model "
                  f"`{row['model']}`, batch {row['batch']}, lr {row['lr']}, 1 epoch; data: "
                  f"{row['data']}.", "",
                  "| framework | s/round | fedloom's best speed-up | launch → end of round 1 (s) |",
                  "|---|---|---|---|"]
        for name, v in fws.items():
            if "error" in v:
                lines.append(f"| {name} | failed: {v['error'][:120]} | | |")
                continue
            t = v.get("round_s")
            sp = f"{t / best[1]:.2f}×" if best and t else "—"
            lines.append(f"| {name} | {_fmt(t)} | {sp} | {v['launch_s']:.1f} |")
        eq = row.get("equivalence", {})
        diffs = [f"{n} {d['max_abs_diff']:.1e} (relative {d['relative']:.1e})"
                 for n, d in eq.items() if isinstance(d, dict)]
        if diffs:
            what = (f"the final models of this run ({eq['rounds']} rounds)" if
                    eq.get("dropout") is False else
                    "the model after one round with dropout off in every framework")
            lines += ["", f"Equivalence, {what}, max |Δ| against fedloom's sequential: "
                      + "; ".join(diffs) + "."]
        lines.append("")
    return lines


def _fmt(t: float | None) -> str:
    return "—" if t is None else f"{t:.3f}"


def goals(section: dict[str, Any]) -> list[tuple[str, str, bool, str]]:
    """Round time ≥ 1.5× pfl and ≥ 1.5× FLGo on each workload (CPU)."""
    rows: list[tuple[str, str, bool, str]] = []
    for key, row in section.get("workloads", {}).items():
        fws = row["frameworks"]
        best = _best_fedloom(fws)
        for peer in PEERS:
            goal = f"round time ≥ 1.5× {peer} ({key} clients/round)"
            # the peer's fastest configuration measured (FLGo: one client at a time or
            # two in parallel)
            mine = [(n, w) for n, w in fws.items() if n.split(":")[0] == peer]
            timed = [(n, w) for n, w in mine if "round_s" in w]
            name_v = min(timed, key=lambda t: t[1]["round_s"]) if timed else (
                mine[0] if mine else (peer, None))
            peer_name, v = name_v
            if v is None or "round_s" not in v or best is None:
                why = (section.get("skipped", {}).get(peer) or (v or {}).get("error")
                       or "not measured")
                rows.append((goal, "—", False, why))
                continue
            t, got = v["round_s"], v["round_s"] / best[1]
            why = (f"fedloom's best ({best[0]}) {best[1]:.3f} s against {peer_name}'s "
                   f"{t:.3f} s; the goal needs {t / 1.5:.3f} s")
            floor = fws.get("plain_torch", {}).get("round_s")
            if floor:
                cores = os.cpu_count() or 1
                ideal = floor / cores  # the same batches split perfectly over every core
                why += (f"; plain PyTorch on the same batches takes {floor:.3f} s on one core, "
                        f"{ideal:.3f} s split perfectly over {cores}")
                if t / 1.5 < ideal:
                    why += (": the goal is below the cost of the training itself on these "
                            f"cores, and {peer_name} spends "
                            f"{max(0.0, t - ideal) / t:.0%} of its round above that floor, "
                            "all a framework can take away")
                else:
                    why += (f"; fedloom's round is {best[1] / ideal:.2f}× that floor")
                two = fws.get("plain_torch:2proc", {}).get("round_s")
                if two:
                    why += (f"; two plain-PyTorch processes side by side take {two:.3f} s "
                            f"(the measured floor of {cores}), fedloom "
                            f"{best[1] / two:.2f}× that")
            rows.append((goal, f"{got:.2f}×", got >= 1.5, why))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Some frameworks on one workload, interleaved as in :func:`run`, as JSON:

        python benchmarks/peers.py --workload pfl_cifar10/50 \\
            --frameworks fedloom:sequential,fedloom:lockstep,pfl [--repeats 3]
    """
    import argparse

    p = argparse.ArgumentParser(description="some frameworks of the peers section")
    p.add_argument("--workload", required=True, choices=list(workloads(False)))
    p.add_argument("--frameworks", required=True, help="comma-separated names")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    wl = workloads(False)[args.workload]
    peers = {}
    for name in PEERS:
        py, _ = ensure_venv(name, quick=True)  # never installs
        if py is not None:
            peers[name] = py
    cmds = dict(framework_commands(wl, peers, quick=False))
    want = args.frameworks.split(",")
    missing = [n for n in want if n not in cmds]
    if missing:
        print(f"--frameworks: {', '.join(missing)} not available (have {', '.join(cmds)})",
              file=sys.stderr)
        return 2
    load_before = list(os.getloadavg())
    with tempfile.TemporaryDirectory(prefix="fedloom-peers-") as d:
        folder = Path(d)
        spec = export_spec(wl, folder, args.repeats + 1)
        if any(n.startswith("flgo") for n in want):
            subprocess.run([*cmds["flgo"][:2], "--spec", str(folder), "--prepare"],
                           capture_output=True, text=True, check=True, timeout=1800)
        res = run_interleaved_then_alone([(n, cmds[n]) for n in want], folder,
                                         args.repeats + 1)
    print(json.dumps({"workload": args.workload, "data": spec["source"],
                      "load_before": load_before, "load_after": list(os.getloadavg()),
                      "frameworks": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
