"""Round time of fedloom deployed on Flower over loopback, against the in-process round
and Flower's own messaging time.

    python benchmarks/deploy.py [--rounds R] [--clients N] [--only CASE ...]

writes ``benchmarks/deploy.json`` and ``benchmarks/deploy.md``. Every case runs
``examples/flower/run_local.sh`` (a SuperLink and N SuperNodes on 127.0.0.1, then
``flwr run``) with the example config (MNIST, MLP 784-200-10, CRAFT + SA-PEF
Top-1 %, N clients, all in every round) and reports the seconds of each round,
from the ServerApp sending the round's messages to its aggregate (fedloom's
``wall_s``). The cases, ``<app>/<isolation>/<polling>``:

- ``warm/…``: the example as shipped — Flower's process per message is the
  relay of :mod:`fedloom.integrations.warm`, which hands the message to a worker
  per SuperNode that keeps torch, the data and the model loaded (the first
  round starts the workers);
- ``cold/…``: the same app with ``warm=false``: the trainer runs in Flower's
  process per message (torch imported, data and model built every message);
- ``noop/…``: the same federation and downlink size, with a ClientApp that answers
  at once (``benchmarks/flower_noop``): Flower's own messaging time, its process
  per message included;
- ``…/stock``: Flower's defaults — the ServerApp pulls replies every 3 s, each
  SuperExec asks for work every 1 s; ``…/tuned``: the ServerApp pulls every 0.1 s
  (:func:`fedloom.integrations.flower.poll_replies`) and
  ``FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1``;
- ``in_process``: ``fedloom run`` of the same config.

The median leaves out round 1, which pays the start of everything (the warm
workers' torch import and data, the in-process engine's first batches); round 1
is reported beside it.

``<isolation>`` is the SuperNode's ``--isolation``: ``subprocess`` (the SuperNode
starts its SuperExec) or ``process`` (started separately). One measurement per
case: the script starts about a dozen processes per case, so run it on an
otherwise idle machine for numbers to compare across machines.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLE = ROOT / "examples" / "flower"
CFG = EXAMPLE / "fedloom_flower" / "federation.yaml"
CASES = ("in_process", "noop/subprocess/stock", "noop/subprocess/tuned",
         "warm/subprocess/stock", "warm/subprocess/tuned", "warm/process/tuned",
         "cold/subprocess/stock", "cold/subprocess/tuned", "cold/process/tuned")


def free_port(n: int) -> int:
    """A port p with p and p + 100 … p + 100 + n − 1 free on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p > 60000:
            continue
        try:
            for q in range(p + 100, p + 100 + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
    raise RuntimeError("no free loopback ports")


def deployed(app: str, isolation: str, tuned: bool, rounds: int, n: int) -> dict[str, Any]:
    bindir = Path(sys.executable).parent
    with tempfile.TemporaryDirectory() as work:
        env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "WORK": work,
               "FLOWER_PORT": str(free_port(n)), "ISOLATION": isolation,
               "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.1" if tuned else "1.0"}
        poll = 0.1 if tuned else 0.0
        if app == "noop":
            env["APP"] = str(HERE / "flower_noop")
            rc = f"rounds={rounds} nodes={n} poll-s={poll}"
        else:
            rc = (f'overrides="rounds={rounds} data.num_clients={n} cohort.size={n}" '
                  f'poll-s={poll} warm={"true" if app == "warm" else "false"}')
            env["FEDLOOM_WARM_DIR"] = tempfile.mkdtemp(prefix="fw")  # fresh workers
        t0 = time.perf_counter()
        res = subprocess.run(["bash", str(EXAMPLE / "run_local.sh"), str(n), "--run-config", rc],
                             env=env, capture_output=True, text=True, timeout=3600, check=False)
        total = time.perf_counter() - t0
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith('{"rounds"')]
        if res.returncode or not lines:
            raise RuntimeError(f"{app}/{isolation}: no result\n{res.stdout[-2000:]}"
                               f"\n{res.stderr[-2000:]}")
    got = json.loads(lines[-1])
    return {"round_s": got["round_s"], "total_s": round(total, 1),
            "model_sha256": got.get("model_sha256")}


def in_process(rounds: int, n: int) -> dict[str, Any]:
    import fedloom

    res = fedloom.run(str(CFG), [f"rounds={rounds}", f"data.num_clients={n}",
                                 f"cohort.size={n}"])
    # The same run at the SuperNodes' thread count (run_local.sh: nproc / N, at least
    # 1): float32 sums over another number of threads round differently, so this is
    # the model a deployment must reproduce bit for bit.
    t = max(1, (os.cpu_count() or 1) // n)
    same = fedloom.run(str(CFG), [f"rounds={rounds}", f"data.num_clients={n}",
                                  f"cohort.size={n}", f"backend.threads={t}"])
    return {"round_s": [round(m["wall_s"], 4) for m in res.metrics if "wall_s" in m],
            "model_sha256": res.summary["model_sha256"], "threads": res.summary.get("threads"),
            "node_threads": t, "model_sha256_node_threads": same.summary["model_sha256"]}


def markdown(res: dict[str, Any]) -> str:
    s = res["cases"]
    # round 1 pays every start-up (the warm workers', the engine's first batches)
    med = {k: statistics.median(v["round_s"][1:] or v["round_s"]) for k, v in s.items()}
    lines = ["## Deployed round time (Flower, loopback)", "",
             f"`{res['command']}` on {res['cpus']} cores, flwr {res['flwr']}, "
             f"{res['clients']} MNIST clients (examples/flower), {res['rounds']} rounds. "
             "Seconds from sending a round's messages to its aggregate (evaluation "
             "included); the median leaves out round 1, which pays the start-up; load "
             "average = the machine's (1 min) at the end of the case.", "",
             "| case | round 1 | rounds 2… | median of 2… | load average |",
             "|---|---|---|---|---|"]
    for k in [c for c in CASES if c in s]:
        v = s[k]
        lines.append(f"| {k} | {v['round_s'][0]:g} | "
                     f"{', '.join(f'{t:g}' for t in v['round_s'][1:])} | {med[k]:.3g} "
                     f"| {v.get('load_avg', '')} |")
    lines.append("")
    # the floor: the no-op ClientApp with the same polling settings
    for case in [c for c in CASES if c.split("/")[0] in ("warm", "cold") and c in med]:
        mode = case.rsplit("/", 1)[1]
        dep, floor = med[case], med.get(f"noop/subprocess/{mode}")
        if floor is None or "in_process" not in med:
            continue
        target = 3 * med["in_process"] + floor
        lines.append(f"- {case}: target ≤ 3 × in-process + Flower's messaging ({mode}) = "
                     f"3 × {med['in_process']:.3g} + {floor:.3g} = {target:.3g} s; "
                     f"measured {dep:.3g} s: {'met' if dep <= target else 'not met'}.")
    # the same model bytes whichever way the clients ran (the noop app trains nothing)
    ip = s.get("in_process", {})
    ref = ip.get("model_sha256_node_threads")
    shas = {k: v.get("model_sha256") for k, v in s.items() if k.split("/")[0] in
            ("warm", "cold")}
    if ref and shas and all(shas.values()):
        same = [k for k in CASES if shas.get(k) == ref]
        other = [k for k in CASES if k in shas and shas[k] != ref]
        lines.append(f"- Final model_sha256 equal to `fedloom run`'s at the SuperNodes' "
                     f"{ip['node_threads']} torch thread(s) ({ref[:12]}…): "
                     f"{', '.join(same) or 'none'}"
                     + (f"; different: {', '.join(other)}" if other else "")
                     + f". (The timed in-process run used {ip.get('threads')} threads: "
                     f"{ip.get('model_sha256', '')[:12]}…; float32 sums over another thread "
                     "count round differently.)")
    lines += ["", "`cold`: Flower 1.42 starts a fresh ClientApp process per message in "
              "either isolation mode, and that process imports torch and builds the "
              "client's data and model each time. `warm`: the per-message process is a "
              "relay that imports Flower only, and one worker per SuperNode keeps the "
              "rest loaded (fedloom.integrations.warm; docs/deploy.md)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--only", nargs="*", choices=CASES, default=None)
    p.add_argument("--out", default=str(HERE))
    p.add_argument("--report-only", action="store_true",
                   help="rewrite deploy.md from the existing deploy.json")
    args = p.parse_args(argv)
    import flwr

    out = Path(args.out)
    path = out / "deploy.json"
    if args.report_only:
        (out / "deploy.md").write_text(markdown(json.loads(path.read_text())))
        return 0
    res: dict[str, Any] = json.loads(path.read_text()) if args.only and path.exists() else {
        "cases": {}}
    res.update({"command": "python benchmarks/deploy.py" + (
        f" --rounds {args.rounds}" if args.rounds != 4 else ""), "cpus": os.cpu_count(),
        "flwr": flwr.__version__, "clients": args.clients, "rounds": args.rounds})
    for case in args.only or CASES:
        t = time.perf_counter()
        print(f"deploy: {case} …", file=sys.stderr, flush=True)
        if case == "in_process":
            r = in_process(args.rounds, args.clients)
        else:
            app, iso, mode = case.split("/")
            r = deployed(app, iso, mode == "tuned", args.rounds, args.clients)
        r["load_avg"] = round(os.getloadavg()[0], 1)
        res["cases"][case] = r
        print(f"deploy: {case}: {r} ({time.perf_counter() - t:.0f} s)", file=sys.stderr,
              flush=True)
        path.write_text(json.dumps(res, indent=1))
        (out / "deploy.md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
