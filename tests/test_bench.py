"""``make bench --quick``: every section runs at toy sizes and the report is written,
so the benchmark script cannot rot. The whole smoke run (minutes on 2 cores) is
marked slow (``make test-all``); ``make test`` runs one section through the same
script, its results file and its report page."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_quick_one_section_writes_its_results_and_page(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench.py"), "--quick",
                          "--only", "topk", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads((tmp_path / "results-quick.json").read_text())
    assert set(got["sections"]) == set(got["conditions"]) == {"topk"}
    tk = got["sections"]["topk"]
    assert all(v["same_indices"] and v["ours"] > 0 for k, v in tk.items() if k != "d")
    md = (tmp_path / "results-quick.md").read_text()
    assert "Conditions of each section" in md and "## 4. Top-k" in md


@pytest.mark.slow
def test_bench_quick_writes_every_section(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks/bench.py"), "--quick",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads((tmp_path / "results-quick.json").read_text())
    s = got["sections"]
    assert set(s) == {"round_time", "first_round", "aggregation", "topk", "memory",
                      "fp16_state", "lockstep", "state_scale", "peers", "lockstep_cnn"}
    for r in s["state_scale"]["runs"].values():
        # memory-mapped EF state: the live file holds the sampled clients' rows only
        assert 0 < r["live"]["rows_with_data"][0] <= r["cohort"] * r["rounds"]
        assert r["live"]["disk_mb"] * 2**20 < r["state_gb"] * 1e9 and r["peak_rss_mb"] > 0
    ls = s["lockstep"]
    assert all(ls[k] > 0 for k in ("lockstep", "sequential", "vmap"))
    assert ls["max_abs_diff_vs_sequential"] <= 1e-5  # the same training, float32 rounding
    cnn = s["lockstep_cnn"]
    assert all(cnn[k] > 0 for k in ("lockstep", "sequential", "vmap"))
    assert cnn["max_abs_diff_vs_sequential"] <= 1e-5
    for row in s["round_time"]["per_round"].values():
        assert {"sequential", "vmap", "process", "plain_torch"} <= set(row)
        assert all(v > 0 for v in row.values())
    for row in s["aggregation"].values():
        assert row["craft_max_violation"] <= 1e-6  # CRAFT's constraints hold
    assert all(v["same_indices"] for k, v in s["topk"].items() if k != "d")
    fr = s["first_round"]
    assert fr["seconds_to_end_of_round_1"] > 0 and fr["import_torch_s"] > 0
    assert fr["import_torch_exit_s"] >= fr["import_torch_s"]
    # each section's conditions travel with its figures, and the page shows them
    assert set(got["conditions"]) == set(s)
    assert all(c["wall_s"] >= 0 and c["load_before"] >= 0 for c in got["conditions"].values())
    md = (tmp_path / "results-quick.md").read_text()
    assert "Conditions of each section" in md and "| peers |" in md
    assert "## 1. Round time" in md and "## 6. fp16 client state" in md
    assert "## 7. Lock-step trainer" in md
    assert "## 7b. Lock-step trainer on a CNN" in md
    assert "## State at scale" in md
