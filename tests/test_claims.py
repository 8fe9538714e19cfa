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


def test_a_claims_direction_comes_from_its_metric_and_a_contradiction_is_refused(tmp_path):
    """A claim on a loss judged as "higher is better" turned its verdicts over (a
    higher loss printed as better); the suite now takes the direction the metric's
    name states and refuses one that contradicts it, in one line naming the field."""
    import yaml

    from conftest import TINY
    from fedloom.config import ConfigError
    from fedloom.report.claims import claim_direction
    from fedloom.sweep import load_suite

    assert [claim_direction(m) for m in ("test_loss", "client_ppl_worst10",
                                         "uplink_bytes_total", "client_acc_std",
                                         "rounds_to_target", "test_acc", "updates_applied")
            ] == ["lower", "lower", "lower", "lower", "lower", "higher", None]
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))

    def load(claim):
        suite = {"name": "t", "out": str(tmp_path / "runs"), "doc": str(tmp_path / "t.md"),
                 "seeds": [1], "settings": {"s": {"config": str(cfg)}},
                 "methods": {"A": [], "B": []},
                 "claims": [{"claim": "c", "method": "A", "against": ["B"], **claim}]}
        path = tmp_path / "suite.yaml"
        path.write_text(yaml.safe_dump(suite, sort_keys=False))
        return load_suite(path)

    assert load({"metric": "test_loss"}).report.claims[0]["better"] == "lower"
    assert load({"metric": "test_acc"}).report.claims[0]["better"] == "higher"
    assert load({"metric": "updates_applied",
                 "better": "lower"}).report.claims[0]["better"] == "lower"
    for claim, msg in [({"metric": "test_loss", "better": "higher"},
                        r"claims\[0\]\.better: higher, but test_loss improves when it is lower"),
                       ({"metric": "test_acc", "better": "lower"}, r"claims\[0\]\.better: lower"),
                       ({"metric": "updates_applied"}, r"claims\[0\]\.better: missing")]:
        with pytest.raises(ConfigError, match=msg) as err:
            load(claim)
        assert "\n" not in str(err.value)


def test_a_loss_cell_reads_to_the_third_decimal_and_lower_is_better():
    # differences of test loss A − B: +0.010, +0.012, +0.014 nats (A's loss higher on
    # every seed): with lower better that is worse, and one decimal would print +0.0.
    # t-interval: 0.012 ± 4.303 · 0.002 / √3 = [+0.007, +0.017], inside ±0.05: a claim
    # with that margin asks "level?", and the answer is equivalent (the sign stays)
    a = [_run(s, [0.5], test_loss=3.0 + d)
         for s, d in zip((1, 2, 3), (0.010, 0.012, 0.014), strict=True)]
    b = [_run(s, [0.5], test_loss=3.0) for s in (1, 2, 3)]
    table = {"s": {"A": {"runs": a}, "B": {"runs": b}}}
    claim = {"claim": "A level with B", "method": "A", "against": ["B"],
             "metric": "test_loss", "better": "lower"}
    _, rows, recs = claim_table([claim], table, ["s"], {"s": None})
    assert recs[0]["verdict"] == "worse" and rows[0][2].startswith("**worse** +0.012 [+0.007, ")
    _, rows, recs = claim_table([{**claim, "margin": 0.05}], table, ["s"], {"s": None})
    assert rows[0][2].startswith("**equivalent** +0.012 [+0.007, ")
    _, rows, recs = claim_table([claim], table, ["s"], {"s": None}, sequential=True)
    assert rows[0][2].startswith(f"**{recs[0]['verdict']}** (n=3) +0.012 [")


def test_a_sequential_cell_says_when_its_mean_left_the_running_interval():
    # seeds 1-3 differ by about +2 pp; seeds 4-12 by +80 pp (the method collapses on
    # the baseline's side): the running intersection keeps the first looks' narrow
    # interval, which the 12-seed mean (+54.7 pp) lies far outside. The cell says so.
    diffs = [0.02, 0.021, 0.019] + [0.8] * 9
    a = [_run(s, [0.5], client_acc_mean=0.1 + d) for s, d in enumerate(diffs, 1)]
    b = [_run(s, [0.5], client_acc_mean=0.1) for s in range(1, 13)]
    table = {"s": {"A": {"runs": a}, "B": {"runs": b}}}
    claim = {"claim": "A above B", "method": "A", "against": ["B"],
             "metric": "client_acc_mean", "better": "higher"}
    _, rows, recs = claim_table([claim], table, ["s"], {"s": None}, sequential=True,
                                max_seeds=12)
    rec = recs[0]
    assert not rec["low"] <= rec["diff"] <= rec["high"]
    assert rec["verdict"] == "inconsistent" and "the sequence missed" in rows[0][2]
    # seeds that agree: no such words
    same = [_run(s, [0.5], client_acc_mean=0.12 + 0.001 * (s % 3)) for s in range(1, 13)]
    _, rows, _ = claim_table([claim], {"s": {"A": {"runs": same}, "B": {"runs": b}}}, ["s"],
                             {"s": None}, sequential=True, max_seeds=12)
    assert "missed" not in rows[0][2]
