"""Bench section ``population``: a round's time and a run's peak RSS against the population.

    python benchmarks/bench.py --only population [--quick]
    FEDLOOM_BENCH_POPULATION_ROUNDS=100 python benchmarks/bench.py --only population

``configs/population/synthetic-1m.yaml`` (SCAFFOLD, 100 clients a round, logistic
regression on LEAF's Synthetic(1, 1), each user generated when sampled) at 10³, 10⁴,
10⁵ and 10⁶ users, each a ``fedloom run`` process of its own (its peak RSS is its
own), one after the other, then 10³ again: the 10³ round is measured before and
after the others, so a drift of the machine's load over the section shows as a
difference between the two, and the ratios are against their mean. Rounds: 1,000
(the issue's protocol), or ``FEDLOOM_BENCH_POPULATION_ROUNDS``; a checkpoint every
100 rounds, an evaluation at the end. Reported per run: peak RSS, seconds per round
(median of rounds 2…R of ``metrics.jsonl``'s ``wall_s``; round 1 pays first
touches) and its ratio to the 10³ round, the mean, the state store's kind (10⁶:
memory-mapped, 2.4 GB of control variates of which the sampled rows are written;
10⁵: lazy rows; below: dense), the distinct clients expected to be sampled,
``N·(1 − (1 − m/N)^R)``, and the run's wall time. ``--quick``: 10³ and 10⁶ users,
3 rounds of 10 clients.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench import PY, ROOT, peak_rss_mb

from fedloom.state import LAZY_ABOVE

CONFIG = ROOT / "configs" / "population" / "synthetic-1m.yaml"
SIZES = (1_000, 10_000, 100_000, 1_000_000)


def _one(clients: int, rounds: int, cohort: int, every: int) -> dict[str, Any]:
    exe = str(Path(PY).with_name("fedloom"))
    runs = ROOT / "runs"
    with tempfile.TemporaryDirectory(dir=runs if runs.is_dir() else None) as d:
        out = Path(d) / "run"
        cmd = [exe, "run", str(CONFIG), f"data.num_clients={clients}", f"rounds={rounds}",
               f"cohort.size={cohort}", f"checkpoint.every={every}", f"eval.every={rounds}",
               "--quiet", "--out", str(out)]
        load = os.getloadavg()[0]
        rss, wall, rc = peak_rss_mb(cmd, timeout=4 * 3600)
        if rc != 0:
            raise RuntimeError(f"population: the {clients}-client run failed (exit {rc})")
        walls = [json.loads(line)["wall_s"]
                 for line in (out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((out / "summary.json").read_text())
        state = out / "state"
        kind = ("memmap" if state.is_dir() and any(state.glob("state-*.bin"))
                else "lazy" if clients > LAZY_ABOVE else "dense")
        return {
            "clients": clients, "rounds": rounds, "cohort": cohort,
            "num_parameters": int(summary["num_parameters"]), "storage": kind,
            "expected_clients_sampled": clients * (1 - (1 - cohort / clients) ** rounds),
            "peak_rss_mb": rss, "wall_s": wall,
            "s_per_round": statistics.median(walls[1:] if len(walls) > 1 else walls),
            "mean_s_per_round": statistics.fmean(walls[1:] if len(walls) > 1 else walls),
            "round_1_s": walls[0], "test_acc": summary.get("test_acc"),
            "load_before": load, "load_after": os.getloadavg()[0],
        }


def run(quick: bool, repeats: int) -> dict[str, Any]:
    """Each population once (its figure a median over its rounds); 10³ again last."""
    if quick:
        sizes, rounds, cohort, every = (1_000, 1_000_000), 3, 10, 2
    else:
        sizes, cohort, every = SIZES, 100, 100
        rounds = int(os.environ.get("FEDLOOM_BENCH_POPULATION_ROUNDS", "1000"))
    runs = [_one(n, rounds, cohort, every) for n in (*sizes, sizes[0])]
    return {"rounds": rounds, "checkpoint_every": every, "runs": runs[:-1], "control": runs[-1]}


def _base(section: dict[str, Any]) -> float:
    """The smallest population's s/round: the mean of its run and the control's."""
    first = min(section["runs"], key=lambda r: r["clients"])
    return (first["s_per_round"] + section["control"]["s_per_round"]) / 2


def markdown(section: dict[str, Any]) -> list[str]:
    runs, ctl = section["runs"], section["control"]
    base = _base(section)
    r0 = runs[0]
    lines = ["## Population: 10³ to 10⁶ clients", "",
             f"SCAFFOLD over LEAF's Synthetic(1, 1), each user generated when sampled "
             f"(`data.name: synthetic-population`, at most 200 samples a user), logistic "
             f"regression ({r0['num_parameters']} parameters), {r0['cohort']} clients a "
             f"round for {section['rounds']} rounds, 5 local steps of 32, a checkpoint "
             f"every {section['checkpoint_every']} rounds; one `fedloom run` process per "
             "population (peak RSS: its "
             "own). s/round: median of rounds 2…R; ratio: against the 10³ round, the mean "
             "of its run before the others and its control run after them. Command: "
             "`python benchmarks/bench.py --only population` (config "
             "`configs/population/synthetic-1m.yaml`)."
             + ("" if section["rounds"] == 1000 else
                f" Run with `FEDLOOM_BENCH_POPULATION_ROUNDS={section['rounds']}`: "
                f"{section['rounds']} rounds where the protocol is 1,000."), "",
             "| clients | state store | peak RSS (MB) | s/round | ratio to 10³ | mean s/round "
             "| clients sampled (expected) | wall (s) | load before / after |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in [*runs, ctl]:
        name = f"{r['clients']:,}" + (" (control)" if r is ctl else "")
        lines.append(
            f"| {name} | {r['storage']} | {r['peak_rss_mb']:.0f} | {r['s_per_round']:.3f} | "
            f"{r['s_per_round'] / base:.2f}× | {r['mean_s_per_round']:.3f} | "
            f"{r['expected_clients_sampled']:,.0f} | {r['wall_s']:.0f} | "
            f"{r['load_before']:.1f} / {r['load_after']:.1f} |")
    return [*lines, ""]


def goals(section: dict[str, Any]) -> list[tuple[str, str, bool, str]]:
    """Met only over the protocol's 1,000 rounds (fewer: the row says how many)."""
    big = max(section["runs"], key=lambda r: r["clients"])
    ratio = big["s_per_round"] / _base(section)
    rss = big["peak_rss_mb"]
    rounds = section["rounds"]
    at = f" ({big['clients']:,} clients, {rounds} rounds)"
    short = (f"measured over {rounds} rounds (FEDLOOM_BENCH_POPULATION_ROUNDS), not "
             "1,000" if rounds < 1000 else "")
    return [("10⁶ clients: round time within 1.1× of the 10³ round", f"{ratio:.2f}×" + at,
             ratio <= 1.1 and not short,
             short or "see the section's load columns: the runs are one after another"),
            ("10⁶ clients, SCAFFOLD state: peak RSS < 2 GB", f"{rss:.0f} MB" + at,
             rss < 2048 and not short,
             short or "the process holds more than the cohort's rows: see the section")]
