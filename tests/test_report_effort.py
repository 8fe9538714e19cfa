"""The claim page's head: decided cells and compute (fedloom.report.effort)."""

from __future__ import annotations

import json
from pathlib import Path

from fedloom.report.effort import compute, decided, head_lines


def _run(root: Path, name: str, seed: int, wall: float | None) -> Path:
    d = root / "mnist" / name / f"seed{seed}"
    d.mkdir(parents=True)
    if wall is not None:
        (d / "summary.json").write_text(json.dumps({"wall_s_total": wall}))
    return d


def test_decided_counts_only_cells_with_a_verdict() -> None:
    recs = [{"verdict": v} for v in ("better", "no evidence", "worse", "equivalent",
                                     "no evidence")]
    assert decided(recs) == (3, 5)
    assert decided([]) == (0, 0)


def test_compute_counts_a_continued_halving_trial_once(tmp_path: Path) -> None:
    # rungs of one trial: @r10 (10 rounds, 1 s) continued to the last rung (30 rounds,
    # whose history holds the first 10: 3 s): one run of 3 s, not two of 4 s
    r10 = _run(tmp_path, "CRAFT@tune=client.lr=0.1@r10", 100, 1.0)
    r30 = _run(tmp_path, "CRAFT@tune=client.lr=0.1", 100, 3.0)
    other = _run(tmp_path, "CRAFT@tune=client.lr=0.3@r10", 100, 1.5)  # stopped at rung 0
    main = [_run(tmp_path, "CRAFT", s, 5.0) for s in (1, 2)]
    unfinished = _run(tmp_path, "CRAFT", 3, None)
    out = compute({"tuning": [r10, r30, other], "reported": [*main, unfinished],
                   "sensitivity": [main[0]]})  # a folder in two kinds counts once
    assert out["tuning"] == (2, 4.5)
    assert out["reported"] == (2, 10.0)
    assert out["sensitivity"] == (0, 0.0)


def test_compute_skips_a_damaged_summary(tmp_path: Path) -> None:
    d = _run(tmp_path, "FedAvg", 1, None)
    (d / "summary.json").write_text("{not json")
    e = _run(tmp_path, "FedAvg", 2, None)
    (e / "summary.json").write_text(json.dumps({"wall_s_total": "NaN-ish"}))
    assert compute({"reported": [d, e]}) == {"reported": (0, 0.0)}


def test_head_line_states_fraction_before_and_compute(tmp_path: Path) -> None:
    d = _run(tmp_path, "FedAvg", 1, 7200.0)
    recs = [{"verdict": "better"}, {"verdict": "no evidence"}, {"verdict": "no evidence"},
            {"verdict": "no evidence"}]
    text = head_lines(recs, {"tuning": [], "reported": [d]}, 3 * 3600.0, 2,
                      before="1 of 4 (25 %): 3 fixed seeds")[0]
    assert "**Decided: 1 of 4 claim cells (25 %).**" in text
    assert "Before this protocol: 1 of 4 (25 %): 3 fixed seeds." in text
    assert "1 run (1 reported), 2.00 CPU-hours" in text
    assert "3.00 h of wall time with 2 single-thread workers" in text
    # no claims: only the compute; nothing finished: said so
    only = head_lines([], {"reported": []}, 0.0, 1)[0]
    assert only.startswith("**Compute: 0 runs (none finished)")
