"""Bench section ``state_scale``: error-feedback state of 10,000 clients × 1M parameters.

    python benchmarks/bench.py --only state_scale [--quick]

Two `fedloom run` processes of the same Top-1 % EF workload, one after the
other in this invocation: 1,000 and 10,000 clients, MNIST, MLP 784-1024-200-10
(1,010,850 parameters), IID split, 10 clients a round, 50 rounds, memory-mapped
state (``state.storage=memmap``: 3.9 GB and 40 GB of float32 residuals),
checkpoints at the default every 10 rounds (so the snapshot copies are part of
what is measured). Both runs hold 6 samples a client (``data.max_samples`` =
6 × clients), so a round trains the same amount of data in both and the
difference in seconds per round is that of the state's size.

Reported per run: peak RSS of the ``fedloom run`` process; the live state file's
size and the disk it actually uses (``st_blocks``), the rows in it that hold
data (found with ``SEEK_DATA``: rows no sampled client wrote are holes),
against the ``N·(1 − (1 − m/N)^R)`` distinct clients expected to be sampled;
the same for the checkpoints' snapshot files; seconds per round (median of
rounds 2…R of ``metrics.jsonl``'s ``wall_s``; round 1 pays first touches) and
the run's wall time. ``--quick``: 50 and 500 clients, MLP 784-64-10, 3 rounds
of 5, a checkpoint every round.
"""

from __future__ import annotations

import errno
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench import PY, ROOT, peak_rss_mb

SAMPLES_PER_CLIENT = 6  # 60,000 MNIST training images over 10,000 clients


def _data_rows(path: Path, row_bytes: int) -> int:
    """How many ``row_bytes`` rows of the file hold data at their middle byte (a
    written row's neighbours share a file-system block with it at most, never
    their middle)."""
    rows: set[int] = set()
    fd = os.open(path, os.O_RDONLY)
    try:
        size, pos = os.fstat(fd).st_size, 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:
                    break
                raise
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            first = (start - row_bytes // 2 + row_bytes - 1) // row_bytes  # middle ≥ start
            rows.update(r for r in range(max(first, 0), (end - 1) // row_bytes + 1)
                        if start <= r * row_bytes + row_bytes // 2 < end)
            pos = end
    finally:
        os.close(fd)
    return len(rows)


def _files(paths: list[Path], row_bytes: int) -> dict[str, Any]:
    return {"files": len(paths),
            "apparent_gb": sum(p.stat().st_size for p in paths) / 1e9,
            "disk_mb": sum(p.stat().st_blocks * 512 for p in paths) / 2**20,
            "rows_with_data": [_data_rows(p, row_bytes) for p in paths]}


def _one(clients: int, hidden: list[int], rounds: int, cohort: int, every: int) -> dict[str, Any]:
    exe = str(Path(PY).with_name("fedloom"))
    runs = ROOT / "runs"
    with tempfile.TemporaryDirectory(dir=runs if runs.is_dir() else None) as d:
        out = Path(d) / "run"
        cmd = [exe, "run", str(ROOT / "configs/quickstart.yaml"), "data.name=mnist",
               f"data.num_clients={clients}", "data.partition.name=iid",
               "data.partition.options={}",  # iid takes no options (the quickstart's alpha)
               f"data.max_samples={SAMPLES_PER_CLIENT * clients}",
               f"model.options.hidden={json.dumps(hidden)}", f"cohort.size={cohort}",
               f"rounds={rounds}", "compression.name=topk", "compression.options.ratio=0.01",
               "compression.feedback=ef", "state.storage=memmap", f"checkpoint.every={every}",
               f"eval.every={rounds}", "--quiet", "--out", str(out)]
        rss, wall, rc = peak_rss_mb(cmd, timeout=3600)
        if rc != 0:
            raise RuntimeError(f"state_scale: the {clients}-client run failed (exit {rc})")
        summary = json.loads((out / "summary.json").read_text())
        d_params = int(summary["num_parameters"])
        row_bytes = 4 * d_params
        walls = [json.loads(line)["wall_s"]
                 for line in (out / "metrics.jsonl").read_text().splitlines()]
        return {
            "clients": clients, "rounds": rounds, "cohort": cohort, "checkpoint_every": every,
            "num_parameters": d_params, "state_gb": clients * row_bytes / 1e9,
            "expected_clients_sampled": clients * (1 - (1 - cohort / clients) ** rounds),
            "peak_rss_mb": rss, "wall_s": wall,
            "s_per_round": statistics.median(walls[1:] if len(walls) > 1 else walls),
            "round_1_s": walls[0],
            "live": _files([out / "state" / "state-fb.residual.bin"], row_bytes),
            "snapshots": _files(sorted((out / "checkpoints").glob("state-*.bin")), row_bytes),
            "test_acc": summary.get("test_acc"),
        }


def run(quick: bool, repeats: int) -> dict[str, Any]:
    """Both runs once each (a run's figure is already a median over its rounds)."""
    if quick:
        sizes, hidden, rounds, cohort, every = (50, 500), [64], 3, 5, 1
    else:
        sizes, hidden, rounds, cohort, every = (1000, 10_000), [1024, 200], 50, 10, 10
    load = [os.getloadavg()[0]]  # the machine's 1-minute load, before and after each run
    runs = {}
    for n in sizes:
        runs[str(n)] = _one(n, hidden, rounds, cohort, every)
        load.append(os.getloadavg()[0])
    return {"samples_per_client": SAMPLES_PER_CLIENT, "runs": runs, "load_avg": load}


def _big(section: dict[str, Any]) -> dict[str, Any]:
    return section["runs"][max(section["runs"], key=int)]


def markdown(section: dict[str, Any]) -> list[str]:
    runs = section["runs"]
    small, big = (runs[k] for k in sorted(runs, key=int))
    lines = ["## State at scale: error feedback for 10,000 clients", "",
             f"Top-1 % with EF, MNIST IID, {big['num_parameters']:,} parameters, "
             f"{big['cohort']} clients a round for {big['rounds']} rounds, memory-mapped "
             f"state, a checkpoint every {big['checkpoint_every']} rounds; "
             f"{section['samples_per_client']} samples a client in both runs "
             "(`data.max_samples`), so a round trains the same data. Disk: what the live "
             "state file and the checkpoints' snapshot files (those of `last.pt` and "
             "`prev.pt`) use (`st_blocks`) against their size; rows with data: rows of the "
             "file that are not holes, against the distinct clients expected to be "
             "sampled. s/round: median of rounds 2…R. Command: `python benchmarks/bench.py "
             "--only state_scale`.", "",
             "| clients | residuals | peak RSS (MB) | live file: disk (MB) | rows with data "
             "(expected) | snapshots: size (GB) / disk (MB) | s/round | round 1 (s) | "
             "wall (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in (small, big):
        snaps = r["snapshots"]
        lines.append(
            f"| {r['clients']:,} | {r['state_gb']:.1f} GB | {r['peak_rss_mb']:.0f} | "
            f"{r['live']['disk_mb']:.0f} | {r['live']['rows_with_data'][0]} "
            f"({r['expected_clients_sampled']:.0f}) | {snaps['apparent_gb']:.1f} / "
            f"{snaps['disk_mb']:.0f} | {r['s_per_round']:.3f} | {r['round_1_s']:.2f} | "
            f"{r['wall_s']:.0f} |")
    load = section.get("load_avg")
    lines += ["", f"Seconds per round at {big['clients']:,} clients against "
              f"{small['clients']:,}: {big['s_per_round'] / small['s_per_round']:.2f}×"
              + (f" (1-minute load average {min(load):.1f}–{max(load):.1f} over the runs)"
                 if load else "") + ".", ""]
    return lines


def goals(section: dict[str, Any]) -> list[tuple[str, str, bool, str]]:
    big = _big(section)
    rss = big["peak_rss_mb"]
    got = f"{rss:.0f} MB" + ("" if big["clients"] == 10_000 else
                             f" ({big['clients']:,} clients, {big['num_parameters']:,} "
                             "parameters)")
    return [("10,000 × 1M EF state in < 2 GB peak RSS", got, rss < 2048,
             "the process holds more than the cohort's rows: see the section's figures")]
