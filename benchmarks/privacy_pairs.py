"""The privacy page's accuracy differences across ε, paired by seed.

``fedloom sweep configs/privacy/suite.yaml`` pairs methods within a setting; a setting
here is a task at one ε, and a seed gives every setting the same split, initial model
and cohorts, so DP-FedAvg at ε is paired seed by seed with its clipping-only row (ε =
∞) and ε = 1 with ε = 8 (95 % t-intervals, :func:`fedloom.report.stats.paired`), read
from the runs' ``summary.json``::

    python benchmarks/privacy_pairs.py [runs/privacy]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fedloom.report.stats import paired

TASKS = {"mnist": (1, 2, 4, 8), "shakespeare": (1, 8)}


def accuracy(root: Path, setting: str, method: str = "DP-FedAvg") -> dict[int, float]:
    """{seed: final test accuracy} of the reported runs (seeds 1, 2, ...) found."""
    out = {}
    for path in sorted((root / setting / method).glob("seed*/summary.json")):
        seed = int(path.parent.name.removeprefix("seed"))
        if seed < 100:  # tuning seeds are not reported
            out[seed] = float(json.loads(path.read_text())["test_acc"])
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(args[0] if args else "runs/privacy")
    for task, eps in TASKS.items():
        clip_only = accuracy(root, f"{task}-inf")
        for e in eps:
            d = paired(accuracy(root, f"{task}-eps{e}"), clip_only)
            print(f"{task}: DP-FedAvg at eps {e} - clipping only: {d.text(scale=100, unit='pp')}")
        d = paired(accuracy(root, f"{task}-eps1"), accuracy(root, f"{task}-eps{eps[-1]}"))
        print(f"{task}: eps 1 - eps {eps[-1]}: {d.text(scale=100, unit='pp')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
