"""``benchmarks/ab.py --quick``: the interleaved A/B of two trees runs and its report
holds together, with A = B = this working tree. ``make test`` runs one section (the
lockstep one, the quickest); the default sections are marked slow, as bench.py's
whole smoke run is. No time is asserted: only the JSON's shape, that the runs
alternate A, B then B, A, and that every ratio and interval comes from the pairs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ab  # noqa: E402


def _run_ab(tmp_path: Path, *only: str) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks/ab.py"), "--a", str(ROOT), "--b", str(ROOT),
           "--quick", "--repeats", "2", "--out", str(tmp_path)]
    if only:
        cmd += ["--only", *only]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads((tmp_path / "ab.json").read_text())


def _check(got: dict, sections: set[str], tmp_path: Path) -> None:
    assert set(got["sections"]) == sections and got["repeats"] == 2 and got["quick"]
    assert got["a"]["worktree"] is False and got["b"]["worktree"] is False
    assert len(got["load_start"]) == len(got["load_end"]) == 3
    # both trees ran each section in every repeat, A first then B first
    for s in sections:
        order = [r["tree"] for r in got["runs"] if r["section"] == s]
        assert order == ["A", "B", "B", "A"]
        assert got["bench_from"][s] == {"A": "own", "B": "own"}
    assert got["quantities"] and not got["missing"]
    assert {q["section"] for q in got["quantities"].values()} == sections
    for name, q in got["quantities"].items():
        assert len(q["a"]) == len(q["b"]) == 2, name
        pairs = [b / a for a, b in zip(q["a"], q["b"], strict=True)]
        assert q["ratios"] == pytest.approx(pairs)
        lo, hi = q["ci95"]
        assert all(math.isfinite(v) for v in (q["ratio"], lo, hi)), name
        # a bootstrap of the median of the pairs stays within the pairs
        assert min(pairs) <= lo <= q["ratio"] <= hi <= max(pairs), name
        assert q["ci95"] == pytest.approx(ab.paired(q["a"], q["b"])["ci95"])
        assert q["verdict"] == ab.verdict(q["ratio"], q["ci95"], q["unit"])
    md = (tmp_path / "ab.md").read_text()
    assert "| quantity | A (median) | B (median) | B/A | 95 % interval | verdict |" in md
    assert all(f"| {name}" in md for name in got["quantities"])


def test_ab_quick_lockstep_pairs_and_intervals(tmp_path):
    got = _run_ab(tmp_path, "lockstep")
    _check(got, {"lockstep"}, tmp_path)
    assert set(got["quantities"]) == {"lockstep/lockstep", "lockstep/sequential",
                                      "lockstep/vmap"}


@pytest.mark.slow
def test_ab_quick_default_sections(tmp_path):
    got = _run_ab(tmp_path)
    _check(got, {"round_time", "first_round", "lockstep"}, tmp_path)
    q = got["quantities"]
    assert {"round_time/10/sequential", "round_time/10/vmap", "round_time/10/lockstep",
            "round_time/10/process", "first_round/seconds_to_end_of_round_1"} <= set(q)
    assert q["round_time/10/plain_torch"]["control"] and q["first_round/peak_rss_mb"][
        "unit"] == "MB"


def test_verdict_and_interval_rules():
    # identical pairs: ratio 1, a point interval, within noise
    p = ab.paired([1.0, 2.0, 3.0], [1.0, 2.0, 3.0])
    assert p["ratio"] == 1.0 and p["ci95"] == [1.0, 1.0]
    assert ab.verdict(p["ratio"], p["ci95"], "s") == "within noise"
    # B twice as slow in every pair: the interval excludes 1
    p = ab.paired([1.0, 1.1, 0.9, 1.0], [2.0, 2.2, 1.8, 2.0])
    assert p["ci95"] == pytest.approx([2.0, 2.0])
    assert ab.verdict(p["ratio"], p["ci95"], "s") == "slower"
    assert ab.verdict(0.5, [0.4, 0.6], "s") == "faster"
    assert ab.verdict(0.5, [0.4, 0.6], "MB") == "smaller"
    # within ±5 % counts as noise even where the interval misses 1
    assert ab.verdict(1.04, [1.03, 1.05], "s") == "within noise"
    assert ab.verdict(0.9, [0.8, 1.01], "s") == "within noise"
