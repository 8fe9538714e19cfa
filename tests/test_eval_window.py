"""Claim metrics over a window: ``eval.window`` evaluates every round of the last
⌈window · rounds⌉, ``KEY_window`` is the mean over them (fedloom.report.compare
.window_stats), and ``report.claims_on: window`` puts a suite's claims on it."""

import math
from pathlib import Path

import pytest
import yaml

import fedloom
from conftest import TINY
from fedloom.config import ConfigError, load_config
from fedloom.config.sections import EvalConfig
from fedloom.report.claims import claim_direction, claim_table
from fedloom.report.compare.runs import Run, run_stats, window_stats
from fedloom.sweep.suite import load_suite


def due(rounds, **kw):
    return [r for r in range(1, rounds + 1) if EvalConfig(**kw).due(r, rounds)]


def test_the_window_adds_every_round_of_the_last_ten_percent():
    assert due(30, every=10) == [10, 20, 30]
    # 0.1 · 30 is 3.0000000000000004 in floats: still 3 rounds, not 4
    assert due(30, every=10, window=0.1) == [10, 20, 28, 29, 30]
    assert due(7, every=5, window=0.1) == [5, 7]  # ⌈0.7⌉ = 1: the last round
    assert due(4, every=3, window=1.0) == [1, 2, 3, 4]
    assert EvalConfig(window=0.5).window_rounds(3) == 2


@pytest.mark.parametrize("bad", ["eval.window=1.5", "eval.window=-0.1"])
def test_a_window_outside_0_1_names_the_field(bad):
    with pytest.raises(ConfigError, match=r"eval\.window"):
        load_config(TINY, [bad])


def test_a_run_evaluates_its_window_and_reports_the_mean_over_it():
    res = fedloom.run(TINY, ["rounds=5", "eval.every=5", "eval.window=0.4",
                             "checkpoint.every=0"])
    evaluated = [m["round"] for m in res.metrics if "test_acc" in m]
    assert evaluated == [4, 5]
    out = window_stats(Run(Path("."), {"rounds": 5, "eval": {"every": 5, "window": 0.4}},
                           res.summary, res.metrics))
    accs = [m["client_acc_mean"] for m in res.metrics if "client_acc_mean" in m]
    assert out["client_acc_mean_window"] == pytest.approx(sum(accs) / 2, abs=1e-12)
    assert out["_window"] == (2, 5)


def _run(rows, window=0.0, rounds=None):
    return Run(Path("."), {"rounds": rounds or rows[-1]["round"], "eval": {"window": window}},
               {}, rows)


def test_window_stats_means_the_window_and_falls_back_to_the_last_evaluation():
    rows = [{"round": r, "test_acc": v, "train_loss": 1.0, "uplink_bytes": 1,
             "uplink_bytes_total": r}
            for r, v in zip(range(1, 11), [0.1] * 7 + [0.5, 0.7, 0.9], strict=True)]
    assert window_stats(_run(rows, 0.3))["test_acc_window"] == pytest.approx(0.7)
    assert "train_loss_window" not in window_stats(_run(rows, 0.3))  # not an evaluation
    assert window_stats(_run(rows))["test_acc_window"] == 0.9  # no window: the last
    # a run stopped before its window: its last evaluation
    assert window_stats(_run(rows[:5], 0.3, rounds=10))["test_acc_window"] == 0.1
    # a diverged round in the window makes the mean NaN, never a smaller mean
    nan = [*rows[:9], {"round": 10, "test_acc": float("nan")}]
    assert math.isnan(window_stats(_run(nan, 0.3))["test_acc_window"])
    assert window_stats(_run([], 0.3, rounds=10)) == {}
    assert run_stats(_run(rows, 0.3))["test_acc_window"] == pytest.approx(0.7)


def test_a_windowed_claim_keeps_its_direction():
    assert claim_direction("client_acc_std_window") == "lower"
    assert claim_direction("client_acc_worst10_window") == "higher"
    assert claim_direction("test_loss_window") == "lower"


def _suite(tmp_path, report):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    raw = {"name": "w", "out": str(tmp_path / "runs"), "seeds": [1, 2],
           "settings": {"s": {"config": str(cfg)}},
           "methods": {"A": [], "B": ["client.lr=0.2"]},
           "claims": [{"claim": "A above B", "method": "A", "against": ["B"],
                       "metric": "client_acc_std"}],
           "report": report}
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_claims_on_window_puts_every_claim_on_the_windowed_metric(tmp_path):
    suite = load_suite(_suite(tmp_path, {"claims_on": "window"}))
    assert [(c["metric"], c["better"]) for c in suite.report.claims] == \
        [("client_acc_std_window", "lower")]
    assert load_suite(_suite(tmp_path, {})).report.claims[0]["metric"] == "client_acc_std"
    with pytest.raises(ConfigError, match=r"report\.claims_on"):
        load_suite(_suite(tmp_path, {"claims_on": "best"}))


def test_the_page_states_the_window():
    runs = [{"_seed": s, "_window": (3, 30), "client_acc_mean_window": 0.5 + 0.01 * s,
             "client_acc_mean": 0.5} for s in (1, 2, 3)]
    base = [{**r, "client_acc_mean_window": 0.5} for r in runs]
    table = {"s": {"A": {"runs": runs}, "B": {"runs": base}}}
    claim = {"claim": "A above B", "method": "A", "against": ["B"],
             "metric": "client_acc_mean_window", "better": "higher"}
    _, _, recs = claim_table([claim], table, ["s"], {"s": None})
    assert recs[0]["diff"] == pytest.approx(0.02)
    from fedloom.report.claims import window_note

    note = window_note([claim], table)
    assert "the last 3 of 30 rounds" in note and "claims_on: window" in note
    assert window_note([{**claim, "metric": "client_acc_mean"}], table) == ""
