"""The sequential protocol: the confidence sequence (fedloom.report.sequential) and the
sweep that gives seeds only to undecided pairs (fedloom.sweep.sequential).

The coverage tests are the t-interval's (tests/test_stats.py), with the stopping
rule applied: 4,000 experiments under the null, looks after 3, 5, 7, 9, 11 and 12
seeds, each stopped at its first decided verdict."""

import json
import math
import re
import subprocess

import numpy as np
import pytest
import yaml
from scipy.stats import t as student_t

from conftest import TINY
from fedloom.report.sequential import (
    LOOKS,
    boundary,
    confidence_sequence,
    null_experiments,
    sequential_paired,
    simulate,
)
from fedloom.report.stats import paired


@pytest.mark.parametrize("kind", ["normal", "uniform", "skewed"])
def test_the_confidence_sequence_keeps_95_percent_under_optional_stopping(kind):
    d = null_experiments(kind, 4000)
    assert d.shape == (4000, 12) and np.abs(d).max() <= 1.0  # bounded differences
    cs = simulate(d, LOOKS, method="cs")
    assert cs["coverage"] >= 0.95
    # and no better or worse reported more often than 5 % (the true difference is 0)
    assert 1.0 - cs["decided"] >= 0.95


@pytest.mark.parametrize("kind", ["normal", "uniform", "skewed"])
def test_the_naive_t_interval_re_tested_after_each_batch_does_not(kind):
    # the reason the confidence sequence exists: six looks at a 95 % t-interval cover
    # the true mean in about 83 % of experiments
    t = simulate(null_experiments(kind, 4000), LOOKS, method="t")
    assert t["coverage"] < 0.90


def test_with_a_margin_the_null_is_called_equivalent_not_better_or_worse():
    d = null_experiments("normal", 4000)  # sd 2 pp
    res = simulate(d, LOOKS, method="cs", margin=0.05)
    assert res["coverage"] >= 0.95 and res["decided"] > 0.9  # mostly "equivalent" by now


def test_a_clear_effect_is_decided_before_max():
    # power: a 2 pp gain with a 1 pp seed-to-seed spread
    rng = np.random.default_rng(3)
    d = rng.normal(0.02, 0.01, (2000, 12))
    res = simulate(d, LOOKS, method="cs", mu=0.02)
    assert res["decided"] > 0.95 and res["seeds_mean"] < 8
    assert res["coverage"] >= 0.95


def test_the_boundary_is_a_wider_t_and_its_cost_shrinks_with_n():
    c = boundary(np.array([2, 3, 6, 12, 100]))
    assert math.isinf(c[0])  # two pairs: no finite interval yet
    t = [student_t.ppf(0.975, n - 1) for n in (3, 6, 12, 100)]
    ratios = c[1:] / t
    assert np.all(ratios > 1.5) and np.all(np.diff(ratios) < 0.05)
    assert ratios[0] == pytest.approx(2.40, abs=0.01)  # the docs' widths table
    assert ratios[1] == pytest.approx(2.00, abs=0.01)
    assert ratios[2] == pytest.approx(1.92, abs=0.01)


def test_the_running_intersection_never_widens_and_is_translation_invariant():
    rng = np.random.default_rng(0)
    d = rng.normal(0.01, 0.02, (50, 12))
    _, low, high = confidence_sequence(d)
    lo, hi = np.nan_to_num(low, neginf=-9.0), np.nan_to_num(high, posinf=9.0)
    assert np.all(np.diff(lo, axis=1) >= 0) and np.all(np.diff(hi, axis=1) <= 0)
    _, low2, high2 = confidence_sequence(d + 100.0)
    fin = np.isfinite(low)
    assert np.allclose(low2[fin] - 100.0, low[fin], atol=1e-9)
    assert np.allclose(high2[fin] - 100.0, high[fin], atol=1e-9)


def test_sequential_paired_reads_verdicts_as_paired_does():
    a = {s: 0.80 + 0.02 + 0.001 * (s % 3) for s in range(1, 7)}
    b = {s: 0.80 for s in range(1, 7)}
    cs, t = sequential_paired(a, b), paired(a, b)
    assert cs.verdict == t.verdict == "better" and cs.method == "cs" and cs.n == 6
    assert cs.low < t.low and cs.high > t.high  # wider than the t-interval
    assert sequential_paired(a, b, better="lower").verdict == "worse"
    same = {s: 0.8 + 0.001 * (-1) ** s for s in range(1, 13)}
    assert sequential_paired(same, b, margin=0.01).verdict == "equivalent"
    assert sequential_paired(same, b).verdict == "no evidence"
    two = sequential_paired({1: 0.9, 2: 0.91}, {1: 0.5, 2: 0.5})
    assert two.verdict == "no evidence" and math.isinf(two.high)  # no finite CS at n = 2
    assert two.text(100, "pp") == "no evidence +40.5 pp (no finite interval yet) (2 seeds)"
    # pairs in seed order, whatever the dict order
    rev = sequential_paired(dict(reversed(list(a.items()))), b)
    assert (rev.low, rev.high) == (cs.low, cs.high)


def test_the_widths_command_prints_the_docs_table(capsys):
    from fedloom.report.sequential import main

    assert main(["--widths"]) == 0
    out = capsys.readouterr().out
    assert "| 3 | 4.30 | 10.33 | 2.40× |" in out and "| 12 | 2.20 | 4.22 | 1.92× |" in out


def test_the_docs_tables_are_the_commands_output(capsys):
    from pathlib import Path

    from fedloom.report.sequential import main

    main(["--widths", "--coverage"])
    page = (Path(__file__).resolve().parents[1] / "docs" / "howto" / "sweeps.md").read_text()
    widths, coverage = capsys.readouterr().out.strip().split("\n\n")
    assert widths in page

    def numbers(line):
        return [float(x) for x in re.findall(r"\d+\.\d+", line)]

    # the simulated coverages to within 0.2 pp (a different random stream may move one
    # experiment of 4,000)
    for line in coverage.splitlines()[2:]:
        label = line.split("|")[1]
        (doc_line,) = [ln for ln in page.splitlines() if ln.startswith(f"|{label}|")]
        assert numbers(doc_line) == pytest.approx(numbers(line), abs=0.2)


# ---- the sweep ---------------------------------------------------------------------------

# The fake runs' accuracy by method and seed: B is 5 pp above A on every seed (decided
# at min), C equals A up to a ±0.5 pp seed-dependent wobble (never decided).
def _acc(method, seed):
    wobble = 0.005 * math.sin(7.0 * seed + len(method))
    return {"A": 0.70, "B": 0.75 + 0.002 * math.cos(seed), "C": 0.70 + wobble}[method]


def _fake_run(calls):
    def run(cmd, **kw):
        out = cmd[cmd.index("--out") + 1]
        seed = int(next(a for a in cmd if a.startswith("seed=")).split("=")[1])
        method = next(a for a in cmd if a.startswith("client.lr=")).split("=")[1]
        method = {"0.1": "A", "0.2": "B", "0.3": "C"}[method]
        calls.append((method, seed))
        from pathlib import Path

        p = Path(out)
        p.mkdir(parents=True, exist_ok=True)
        acc = _acc(method, seed)
        (p / "metrics.jsonl").write_text(json.dumps(
            {"round": 1, "test_acc": acc, "uplink_bytes": 0, "uplink_bytes_total": 0}) + "\n")
        (p / "summary.json").write_text(json.dumps({"test_acc": acc, "wall_s_total": 0.0}))
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return run


def _suite(tmp_path, seeds, **extra):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "rounds": 1}))
    suite = {
        "name": "seq", "out": str(tmp_path / "runs"), "doc": str(tmp_path / "doc" / "seq.md"),
        "seeds": seeds, "settings": {"s": {"config": str(cfg)}},
        "methods": {"A": ["client.lr=0.1"], "B": ["client.lr=0.2"], "C": ["client.lr=0.3"]},
        "claims": [{"claim": "B beats A", "method": "B", "against": ["A"],
                    "metric": "test_acc"},
                   {"claim": "C beats A", "method": "C", "against": ["A"],
                    "metric": "test_acc"}],
        **extra,
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def test_the_sweep_gives_more_seeds_only_to_open_pairs_and_resumes(tmp_path, monkeypatch):
    from fedloom.sweep import run_suite

    calls = []
    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", _fake_run(calls))
    path = _suite(tmp_path, {"min": 3, "max": 7, "batch": 2})
    run_suite(path, workers=1, log=lambda s: None)
    seeds = {m: sorted(s for mm, s in calls if mm == m) for m in "ABC"}
    # B–A is decided at 3 seeds; C–A stays open: C and A go on to 5, then 7
    assert seeds == {"A": [1, 2, 3, 4, 5, 6, 7], "B": [1, 2, 3], "C": [1, 2, 3, 4, 5, 6, 7]}
    doc = (tmp_path / "doc" / "seq.md").read_text()
    assert "**better** (n=3) +4.9 pp [" in doc
    assert "**no evidence** (n=7, max)" in doc
    assert "| B (n=3) |" in doc and "| A (n=7) |" in doc and "confidence sequence" in doc
    # the same suite again: the same page, nothing runs
    calls.clear()
    run_suite(path, workers=1, log=lambda s: None)
    assert calls == [] and (tmp_path / "doc" / "seq.md").read_text().split("## Cost")[0] \
        == doc.split("## Cost")[0]
    # a larger max: the runs done are reused, only the open pair's new seeds run
    path = _suite(tmp_path, {"min": 3, "max": 9, "batch": 2})
    run_suite(path, workers=1, log=lambda s: None)
    assert sorted(calls) == [("A", 8), ("A", 9), ("C", 8), ("C", 9)]
    # --report-only replays the batches from the finished runs
    calls.clear()
    text = run_suite(path, workers=1, log=lambda s: None, report_only=True).report_text
    assert calls == [] and "**no evidence** (n=9, max)" in text


def test_a_seed_list_keeps_the_fixed_protocol(tmp_path, monkeypatch):
    from fedloom.sweep import run_suite

    calls = []
    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", _fake_run(calls))
    path = _suite(tmp_path, [1, 2, 3])
    suite = run_suite(path, workers=1, log=lambda s: None)
    assert suite.sequential is None and len(calls) == 9
    doc = (tmp_path / "doc" / "seq.md").read_text()
    assert "95 % t-interval" in doc and "(n=" not in doc and "**better** +4.9 pp" in doc


@pytest.mark.parametrize("seeds, match", [
    ({"min": 3, "max": 2, "batch": 1}, "seeds.max: 2 is below min: 3"),
    ({"min": 1, "max": 5, "batch": 1}, "seeds.min: needs at least 2"),
    ({"min": 3, "max": 5}, "seeds.batch: needs a whole number"),
    ({"min": 3, "max": 5, "batch": 1, "step": 2}, "seeds.step: unknown key"),
    ("1,2,3", "seeds: needs a list of seeds or"),
])
def test_bad_seeds_name_the_field(tmp_path, seeds, match):
    from fedloom.config import ConfigError
    from fedloom.sweep import load_suite

    with pytest.raises(ConfigError, match=match):
        load_suite(_suite(tmp_path, seeds))


def test_sequential_seeds_need_claims(tmp_path):
    from fedloom.config import ConfigError
    from fedloom.sweep import load_suite

    with pytest.raises(ConfigError, match="needs claims"):
        load_suite(_suite(tmp_path, {"min": 3, "max": 5, "batch": 1}, claims=[]))


def test_verdict_runs_come_before_sensitivity_and_a_killed_sweep_keeps_its_time(
        tmp_path, monkeypatch):
    from fedloom.sweep import run_suite

    calls, order = [], []
    fake = _fake_run(calls)

    def run(cmd, **kw):
        order.append(cmd[cmd.index("--out") + 1])
        return fake(cmd, **kw)

    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", run)
    tuning = {"budget": 2, "seeds": [100], "metric": "test_acc", "rounds": 1,
              "sampler": "grid", "space": {"server.lr": [0.5, 1.0]},
              "sensitivity": {"key": "server.lr"}}
    path = _suite(tmp_path, {"min": 3, "max": 5, "batch": 2}, tuning=tuning)
    run_suite(path, workers=1, log=lambda s: None)
    kinds = ["tune" if "@tune=" in o else "sens" if "@sens=" in o else "main" for o in order]
    assert "sens" in kinds and "main" in kinds
    # tuning, then every seed the claims asked for (both batches), then sensitivity
    assert kinds == sorted(kinds, key=["tune", "main", "sens"].index)
    state = tmp_path / "runs" / "seq.sweep.json"
    spent = json.loads(state.read_text())["elapsed_s"]
    assert spent > 0

    # a sweep killed in its second batch has written its wall time all the same
    path = _suite(tmp_path, {"min": 3, "max": 7, "batch": 2}, tuning=tuning)

    def killed(cmd, **kw):
        if any(a == "seed=6" for a in cmd):
            raise KeyboardInterrupt
        return fake(cmd, **kw)

    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", killed)
    with pytest.raises(KeyboardInterrupt):
        run_suite(path, workers=1, log=lambda s: None)
    assert json.loads(state.read_text())["elapsed_s"] > spent
