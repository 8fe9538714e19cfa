"""Interleaved A/B of ``make bench``'s engine sections between two trees.

    python benchmarks/ab.py --a REV_OR_DIR --b REV_OR_DIR [--only SECTION ...]
        [--repeats N] [--inner-repeats N] [--quick] [--out DIR]

A and B are git revisions (checked out with ``git worktree add`` into a temporary
folder, removed at the end) or source trees (a folder with ``src/fedloom``). Each
repeat runs every section once per tree, A then B in even repeats and B then A in
odd ones, so a drift in the machine's load falls on both. Every run is a fresh
``python`` with ``PYTHONPATH=<tree>/src`` that calls ``bench.main(["--only",
SECTION, ...])`` from the tree's own ``benchmarks/``, or from B's where the tree's
bench.py lacks the section (the output says which). Flower and Ray are left out of
``round_time``: they are not the engine, and Flower's rounds cost minutes.

Per quantity: the medians of A and of B, the paired ratios r_i = B_i / A_i of the
repeats, their median, and a 95 % percentile-bootstrap interval of that median
(the repeats resampled; pairs keep the drift they shared). Verdict: "within noise"
where the interval holds 1.0 or the ratio lies within ±5 %, else "faster" or
"slower" ("smaller" or "larger" for memory). Controls (plain PyTorch, a bare
``import torch``) do not run fedloom: a control outside noise says the machine
drifted, not the code. Writes ``ab.json`` and ``ab.md`` in ``--out`` (default
``benchmarks/``; with ``--quick``, bench.py's toy sizes, a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
# bench.py's sections that time the engine (its own code, not aggregation or top-k)
ENGINE_SECTIONS = ("round_time", "first_round", "lockstep", "lockstep_cnn")
DEFAULT_SECTIONS = ("round_time", "first_round", "lockstep")
ENGINE_BACKENDS = ("sequential", "vmap", "lockstep", "process", "process+vmap",
                   "process+lockstep")
NOISE = 0.05  # a ratio within ±5 % of 1.0 counts as within noise
DRAWS = 4000  # bootstrap resamples of the repeats

# Run in each fresh process: fedloom must come from the tree under test (PYTHONPATH
# precedes the editable install's path entry), and Flower and Ray read as missing,
# which bench.py's round_time already handles by skipping their figures.
DRIVER = """
import sys
from pathlib import Path
bench_dir, section, out_dir, tree_src, *rest = sys.argv[1:]
for name in ("flwr", "ray"):
    sys.modules[name] = None
import fedloom
where = Path(fedloom.__file__).resolve()
if not where.is_relative_to(Path(tree_src).resolve()):
    raise SystemExit(f"fedloom was imported from {where}, not from {tree_src}")
sys.path.insert(0, bench_dir)
import bench
if section == "--sections":
    print(" ".join(bench.SECTIONS))
    raise SystemExit(0)
raise SystemExit(bench.main(["--only", section, "--out", out_dir, *rest]))
"""


@dataclass
class Tree:
    """One side of the comparison: where its sources are and what they are."""

    label: str
    spec: str
    root: Path
    commit: str | None
    worktree: bool
    sections: list[str] = field(default_factory=list)

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = str(self.root / "src")
        return env

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec, "root": str(self.root), "commit": self.commit,
                "worktree": self.worktree}


class Quantity(NamedTuple):
    """One measured figure of a section; lower is better for every one."""

    value: float
    unit: str  # "s" or "MB"
    control: bool  # does not run fedloom


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip()


def resolve(label: str, spec: str, scratch: Path) -> Tree:
    """A source folder as it is, or a revision checked out in a detached worktree."""
    path = Path(spec)
    if path.is_dir() and (path / "src" / "fedloom").is_dir():
        try:
            commit: str | None = _git("rev-parse", "--short", "HEAD", cwd=path)
            if _git("status", "--porcelain", "--", "src", "benchmarks/*.py", cwd=path):
                commit = f"{commit}+"  # uncommitted changes in the code
        except (OSError, subprocess.SubprocessError):
            commit = None
        return Tree(label, spec, path.resolve(), commit, worktree=False)
    sha = _git("rev-parse", "--verify", f"{spec}^{{commit}}")
    dest = scratch / label
    _git("worktree", "add", "--detach", str(dest), sha)
    return Tree(label, spec, dest, sha[:10], worktree=True)


def _drive(tree: Tree, bench_dir: Path, section: str, out: Path, rest: list[str],
           timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [PY, "-c", DRIVER, str(bench_dir), section, str(out), str(tree.root / "src"), *rest]
    return subprocess.run(cmd, env=tree.env(), cwd=tree.root, capture_output=True, text=True,
                          timeout=timeout, check=False)


def prepare(tree: Tree, scratch: Path) -> None:
    """Byte-compile the tree's sources (as ``pip install`` would, and as bench.py's
    first_round does for its own tree) and read which sections its bench.py has."""
    subprocess.run([PY, "-m", "compileall", "-q", str(tree.root / "src")], check=False,
                   stdout=subprocess.DEVNULL)
    if not (tree.root / "benchmarks" / "bench.py").exists():
        return
    res = _drive(tree, tree.root / "benchmarks", "--sections", scratch, [], 300)
    if res.returncode != 0:
        raise SystemExit(f"{tree.label} ({tree.spec}): cannot import its fedloom or bench.py:"
                         f"\n{res.stderr[-2000:]}")
    tree.sections = res.stdout.split()


def quantities(section: str, res: dict[str, Any]) -> dict[str, Quantity]:
    """The figures of one section's JSON (bench.py's shape) that the A/B compares."""
    out: dict[str, Quantity] = {}
    if section == "round_time":
        for m, row in res["per_round"].items():
            for name in ENGINE_BACKENDS:
                if name in row:
                    out[f"round_time/{m}/{name}"] = Quantity(row[name], "s", False)
            if "plain_torch" in row:
                out[f"round_time/{m}/plain_torch"] = Quantity(row["plain_torch"], "s", True)
    elif section == "first_round":
        out["first_round/seconds_to_end_of_round_1"] = Quantity(
            res["seconds_to_end_of_round_1"], "s", False)
        out["first_round/peak_rss_mb"] = Quantity(res["peak_rss_mb"], "MB", False)
        if "import_torch_s" in res:
            out["first_round/import_torch_s"] = Quantity(res["import_torch_s"], "s", True)
    else:  # lockstep, lockstep_cnn: one s/round per backend, interleaved inside
        for name in ("lockstep", "sequential", "vmap"):
            if name in res:
                out[f"{section}/{name}"] = Quantity(res[name], "s", False)
    return out


def run_one(tree: Tree, bench_dir: Path, section: str, quick: bool, inner: int | None,
            scratch: Path) -> dict[str, Any]:
    """One section of one tree in a fresh process; its figures and conditions."""
    out = Path(tempfile.mkdtemp(dir=scratch, prefix=f"{tree.label}-{section}-"))
    rest = (["--quick"] if quick else []) + (["--repeats", str(inner)] if inner else [])
    load = os.getloadavg()[0]
    t = time.perf_counter()
    res = _drive(tree, bench_dir, section, out, rest, 900 if quick else 7200)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        raise SystemExit(f"{tree.label} ({tree.spec}) {section} failed:\n{res.stderr[-3000:]}")
    got = json.loads((out / ("results-quick.json" if quick else "results.json")).read_text())
    shutil.rmtree(out, ignore_errors=True)
    values = quantities(section, got["sections"][section])
    return {"tree": tree.label, "section": section, "load_before": round(load, 2),
            "load_after": round(os.getloadavg()[0], 2), "wall_s": round(wall, 1),
            "values": {k: q.value for k, q in values.items()},
            "units": {k: [q.unit, q.control] for k, q in values.items()}}


def paired(a: list[float], b: list[float], draws: int = DRAWS, seed: int = 0) -> dict[str, Any]:
    """The median of the paired ratios b_i / a_i and its 95 % percentile-bootstrap
    interval: the repeats resampled with replacement, the median of each resample's
    ratios, their 2.5th and 97.5th percentiles. Seeded, so the same pairs always
    give the same interval."""
    ratios = [y / x for x, y in zip(a, b, strict=True)]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                  for _ in range(draws))
    lo, hi = meds[round(0.025 * (draws - 1))], meds[round(0.975 * (draws - 1))]
    return {"ratios": ratios, "ratio": statistics.median(ratios), "ci95": [lo, hi]}


def verdict(ratio: float, ci95: list[float], unit: str) -> str:
    if ci95[0] <= 1.0 <= ci95[1] or abs(ratio - 1.0) <= NOISE:
        return "within noise"
    if unit == "MB":
        return "smaller" if ratio < 1.0 else "larger"
    return "faster" if ratio < 1.0 else "slower"


def summarise(runs: list[dict[str, Any]], repeats: int) -> tuple[dict[str, Any], list[str]]:
    """Per quantity, A's and B's figures by repeat and their comparison; and the
    quantities that some run lacked (left out, named)."""
    by: dict[str, dict[str, list[float]]] = {}
    units: dict[str, list[Any]] = {}
    for r in runs:
        for k, v in r["values"].items():
            by.setdefault(k, {"A": [], "B": []})[r["tree"]].append(float(v))
            units[k] = r["units"][k]
    out: dict[str, Any] = {}
    missing = []
    for k, got in by.items():
        a, b = got["A"], got["B"]
        if len(a) != repeats or len(b) != repeats or min(a) <= 0:
            missing.append(k)
            continue
        unit, control = units[k]
        p = paired(a, b)
        out[k] = {"section": k.split("/")[0], "unit": unit, "control": control, "a": a, "b": b,
                  "median_a": statistics.median(a), "median_b": statistics.median(b), **p,
                  "verdict": verdict(p["ratio"], p["ci95"], unit)}
    return out, missing


def bench_dir_for(tree: Tree, section: str, b: Tree) -> Path:
    """The tree's own benchmarks/, or B's where the tree's bench.py lacks the section."""
    if section in tree.sections:
        return tree.root / "benchmarks"
    if section not in b.sections:
        raise SystemExit(f"B's bench.py has no section {section!r}")
    return b.root / "benchmarks"


def interleave(trees: tuple[Tree, Tree], sections: list[str], repeats: int, quick: bool,
               inner: int | None, scratch: Path) -> list[dict[str, Any]]:
    """A then B, then B then A, ... for every section in every repeat."""
    runs = []
    for rep in range(repeats):
        for section in sections:
            for tree in (trees if rep % 2 == 0 else trees[::-1]):
                bench_dir = bench_dir_for(tree, section, trees[1])
                print(f"ab: repeat {rep + 1}/{repeats} {section} {tree.label} …",
                      file=sys.stderr, flush=True)
                run = run_one(tree, bench_dir, section, quick, inner, scratch)
                runs.append({"repeat": rep, **run})
    return runs


def _fmt(v: float, unit: str) -> str:
    return f"{v:.0f} MB" if unit == "MB" else f"{v:.3f} s"


def markdown(res: dict[str, Any]) -> str:
    a, b = res["a"], res["b"]
    lines = ["# make bench: interleaved A/B", "",
             f"`{res['command']}`: {res['repeats']} repeats, each section once per tree and "
             "repeat (A then B, then B then A), each run a fresh process; bench.py's own "
             f"repeats inside a run: {res['inner_repeats'] or 'its default'}"
             f"{', toy sizes (--quick)' if res['quick'] else ''}.", "",
             *(f"- {k.upper()}: `{t['spec']}` ({t['commit'] or 'no git'}"
               f"{', a worktree' if t['worktree'] else '; ' + t['root']})"
               for k, t in (("a", a), ("b", b))),
             "- workload code (bench.py's section, from which tree's benchmarks/): "
             + "; ".join(f"{s}: A {w['A']}, B {w['B']}" for s, w in res["bench_from"].items()),
             f"- machine: {res['machine']['cpus']} cores, torch {res['machine']['torch']}, "
             f"Python {res['machine']['python']}; load average (1, 5, 15 min) "
             f"{res['load_start']} at the start, {res['load_end']} at the end; "
             f"{res['wall_s']:.0f} s in all",
             f"- {res['left_out']}", "",
             "Ratio = median over repeats of B/A (the pair of each repeat); interval = 95 % "
             f"bootstrap of that median; within noise = the interval holds 1 or the ratio is "
             f"within ±{NOISE:.0%}. (control) = no fedloom in it: it tells the machine's drift.",
             "", "| quantity | A (median) | B (median) | B/A | 95 % interval | verdict |",
             "|---|---|---|---|---|---|"]
    for k, q in res["quantities"].items():
        name = f"{k} (control)" if q["control"] else k
        lines.append(f"| {name} | {_fmt(q['median_a'], q['unit'])} | "
                     f"{_fmt(q['median_b'], q['unit'])} | {q['ratio']:.3f} | "
                     f"{q['ci95'][0]:.3f} – {q['ci95'][1]:.3f} | {q['verdict']} |")
    if res["missing"]:
        lines += ["", f"Not in every run of both trees, so not compared: {res['missing']}."]
    return "\n".join([*lines, ""])


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def compare(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    load_start = _load()
    trees: list[Tree] = []
    try:
        for label, spec in (("A", args.a), ("B", args.b)):
            trees.append(resolve(label, spec, scratch))
            prepare(trees[-1], scratch)
        a, b = trees
        sections = list(args.only or DEFAULT_SECTIONS)
        bench_from = {s: {t.label: "own" if s in t.sections else "B's" for t in trees}
                      for s in sections}
        runs = interleave((a, b), sections, args.repeats, args.quick, args.inner_repeats,
                          scratch)
    finally:
        for t in trees:
            if t.worktree:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                str(t.root)], check=False, capture_output=True)
    quants, missing = summarise(runs, args.repeats)
    import torch

    return {"command": "python benchmarks/ab.py " + " ".join(sys.argv[1:]),
            "a": a.describe(), "b": b.describe(), "sections": sections,
            "bench_from": bench_from, "repeats": args.repeats, "quick": args.quick,
            "inner_repeats": args.inner_repeats,
            "left_out": "Flower and Ray left out of round_time (not the engine)",
            "machine": {"cpus": os.cpu_count(), "processor": platform.processor()
                        or platform.machine(), "torch": torch.__version__,
                        "python": platform.python_version()},
            "load_start": load_start, "load_end": _load(),
            "wall_s": round(time.perf_counter() - t0, 1),
            "quantities": quants, "missing": missing, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", required=True, help="the old tree: a git revision or a source folder")
    p.add_argument("--b", required=True, help="the new tree: a git revision or a source folder")
    p.add_argument("--only", nargs="+", choices=ENGINE_SECTIONS, default=None)
    p.add_argument("--repeats", type=int, default=5, help="A/B pairs per section")
    p.add_argument("--inner-repeats", type=int, default=None,
                   help="bench.py's --repeats inside each run (default: bench.py's)")
    p.add_argument("--quick", action="store_true", help="bench.py's toy sizes")
    p.add_argument("--out", default=None, help="folder for ab.json and ab.md")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    out = Path(args.out) if args.out else (
        Path(tempfile.gettempdir()) / "fedloom-ab-quick" if args.quick else HERE)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fedloom-ab-") as d:
        res = compare(args, Path(d))
    (out / "ab.json").write_text(json.dumps(res, indent=1))
    md = markdown(res)
    (out / "ab.md").write_text(md)
    print(md)
    print(f"ab: wrote {out / 'ab.json'} and {out / 'ab.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
