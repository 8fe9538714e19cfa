"""The head of a claim page: how many claim cells it decided, and what that cost.

A page's verdicts are only as good as the compute behind them, and the sequential
protocol spends it unevenly (more seeds where a cell is still open), so every page
states both:

- **decided**: claim cells whose verdict is *better*, *worse* or *equivalent*, out of
  every cell with a verdict (``–`` and "no target" cells are not counted); with
  ``report.before`` (free text, e.g. ``"15 of 80 (19 %): 3 fixed seeds, 6 grid
  trials"``) the page also says what an earlier protocol decided;
- **compute**: the runs behind the page (tuning trials, reported runs, sensitivity
  runs) and their CPU-hours, summed from each run's own round time
  (``summary.json``'s ``wall_s_total``; every run is single-threaded, so its wall time
  is its CPU time; process start-up, data loading and evaluation outside the rounds
  are not in it, and the sweep's wall time is given beside it as the upper bound). A
  trial of successive halving that was continued from one rung to the next is one
  run: its last rung's history holds the earlier rungs' rounds, so it is counted
  once (the largest ``wall_s_total`` of its rung folders).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fedloom.report.sequential import UNDECIDED

__all__ = ["compute", "decided", "head_lines"]

_RUNG = re.compile(r"@r\d+$")


def decided(records: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """(decided, cells) over claim records (:func:`fedloom.report.claims.claim_table`)."""
    cells = [r for r in records if r.get("verdict")]
    return sum(r["verdict"] not in UNDECIDED for r in cells), len(cells)


def _wall(out: Path) -> float | None:
    try:
        s = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    w = s.get("wall_s_total")
    return float(w) if isinstance(w, int | float) else None


def compute(groups: Mapping[str, Iterable[Path]]) -> dict[str, tuple[int, float]]:
    """{kind: (runs, seconds)} over run folders by kind ("tuning", "reported",
    "sensitivity"); a folder in two kinds counts in the first; halving's rung folders
    of one trial (``…@r10``, ``…@r30``, ``…``) count as one run (module docstring).
    Folders without a finished summary are skipped."""
    seen: set[Path] = set()
    out: dict[str, tuple[int, float]] = {}
    for kind, dirs in groups.items():
        trials: dict[tuple[str, str], float] = {}
        for d in dirs:
            if d in seen:
                continue
            seen.add(d)
            w = _wall(d)
            if w is None:
                continue
            key = (str(d.parent.parent / _RUNG.sub("", d.parent.name)), d.name)
            trials[key] = max(trials.get(key, 0.0), w)
        out[kind] = (len(trials), sum(trials.values()))
    return out


def head_lines(records: Sequence[Mapping[str, Any]], groups: Mapping[str, Iterable[Path]],
               elapsed_s: float, workers: int, before: str | None = None) -> list[str]:
    """The page's head paragraph (module docstring)."""
    lines = []
    if records:
        d, n = decided(records)
        text = f"**Decided: {d} of {n} claim cells ({100 * d / n:.0f} %).**" if n else \
            "**Decided: no claim cell has runs yet.**"
        if before:
            text += f" Before this protocol: {before.strip()}."
        lines.append(text)
    spent = compute(groups)
    runs = sum(r for r, _ in spent.values())
    secs = sum(s for _, s in spent.values())
    parts = ", ".join(f"{r:,} {k}" for k, (r, _) in spent.items() if r) or "none finished"
    noun = "run" if runs == 1 else "runs"
    lines.append(f"**Compute: {runs:,} {noun} ({parts}), {secs / 3600:.2f} CPU-hours** of "
                 "training rounds (each run's own round time, one thread; start-up and data "
                 f"loading not included); the sweep took {elapsed_s / 3600:.2f} h of wall "
                 f"time with {workers} single-thread worker{'s' if workers != 1 else ''}.")
    return [" ".join(lines), ""]
