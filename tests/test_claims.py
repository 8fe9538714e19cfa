"""Claims tables (fedloom.report.claims): pairing, censoring, cells without data."""

import math

import pytest

from fedloom.report.claims import claim_table, seed_values, sensitivity_table


def _run(seed, accs, **final):
    """A run_stats-like dict: test_acc at rounds 1, 2, …; final metrics as given."""
    ms = [{"round": i + 1, "test_acc": a, "uplink_bytes_total": 0} for i, a in enumerate(accs)]
    return {"_seed": seed, "_metrics": ms, "test_acc": accs[-1], **final}


def test_rounds_to_target_censors_at_the_horizon():
    runs = [_run(1, [0.1, 0.5, 0.9]), _run(2, [0.1, 0.2, 0.3])]
    vals, censored = seed_values(runs, "rounds_to_target", target=0.8)
    assert vals == {1: 3.0, 2: 4.0} and censored == 1  # never reached: last round + 1
    assert seed_values(runs, "rounds_to_target", target=None) == ({}, 0)


def test_claim_cells_pair_by_seed_and_say_why_a_cell_is_empty():
    # A reaches 0.8 in 1–2 rounds on every seed, B in 3 or never: A is faster on each seed
    a = [_run(s, [0.85, 0.9, 0.9]) if s != 2 else _run(s, [0.5, 0.85, 0.9]) for s in (1, 2, 3)]
    b = [_run(1, [0.1, 0.5, 0.9]), _run(2, [0.1, 0.2, 0.3]), _run(3, [0.1, 0.85, 0.9])]
    table = {"s1": {"A": {"runs": a}, "B": {"runs": b}}, "s2": {"A": {"runs": a}}}
    claims = [{"claim": "A faster", "method": "A", "against": ["B"],
               "metric": "rounds_to_target", "better": "lower"},
              {"claim": "A higher", "method": "A", "against": ["B"], "metric": "test_acc",
               "settings": ["s2"]}]
    header, rows, recs = claim_table(claims, table, ["s1", "s2", "s3"],
                                     {"s1": 0.8, "s2": None})
    assert header == ["claim", "against", "s1", "s2"]  # s3 has no runs: no column
    # differences A − B: 1 − 3, 2 − 4 (censored), 1 − 2 → mean −1.67, sd 0.577
    (rec,) = [r for r in recs if r["metric"] == "rounds_to_target"]
    assert rec["diff"] == pytest.approx(-5 / 3) and rec["censored"] == 1
    # half-width t_{0.975,2} · 0.577 / √3 = 4.303 · 0.333 = 1.434 → [−3.10, −0.23]
    assert rec["high"] == pytest.approx(-5 / 3 + 4.302652729911275 / 3)
    assert rec["verdict"] == "better"
    assert rows[0][2].startswith("**better** -1.7 rounds") and "1 run never reached" in rows[0][2]
    assert rows[0][3] == "–"        # s2 has no B
    assert rows[1][2] == "–"        # the second claim applies to s2 only…
    assert rows[1][3] == "–"        # …where B is missing


def test_sensitivity_table_orders_values_and_counts_missing_seeds():
    lines = {"A": [(0.1, [0.5, 0.7]), (0.01, [0.2, math.nan])]}
    header, rows = sensitivity_table(lines, "test_acc")
    assert header == ["method", "0.01", "0.1"]
    assert rows[0][1] == "20.0 ± 0.0 (1/2)" and rows[0][2].startswith("60.0 ± 14.1")
