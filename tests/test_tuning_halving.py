"""Successive halving as a tuning sampler (fedloom.tuning, fedloom.sweep.halving).

The sweep's runs are replaced by a fake whose ``test_acc`` is a known function of
the point and the rounds (it records what it ran, and from which round a continued
run started), so promotion, budgets, determinism and prefix stability are checked
exactly and fast; one tiny real sweep (digits) checks that a continued trial is the
run of that many rounds from the start, bit for bit."""

import json
import math
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import TINY, cli_in_process
from fedloom.config import ConfigError
from fedloom.sweep import load_suite
from fedloom.sweep.tune import tune_protocol
from fedloom.tuning import (
    Trial,
    halving_choice,
    halving_rungs,
    load_protocol,
    plan_rounds,
    point_slug,
    promote,
)

# The fake's score at 1 round of each lr: distinct, so no tie decides a test.
Q = {0.01: 0.30, 0.02: 0.40, 0.03: 0.50, 0.05: 0.70, 0.08: 0.75, 0.1: 0.80, 0.2: 0.65,
     0.3: 0.60, 0.5: 0.85}
LRS = list(Q)
DIVERGES = 0.5  # method B's run at this lr blows up (the engine's warning in its summary)
CLIMBER = 0.08  # third at 1 round, first from 3 rounds on
LATE = 0.01     # last at 1 round, best of all at 9: never promoted, so never seen there


def _acc(lr: float, rounds: int) -> float:
    """The fake's score: ``Q``, a little better with more rounds, and the two late
    bloomers' bonuses."""
    return (Q[lr] + 0.001 * rounds + (0.2 if lr == CLIMBER and rounds >= 3 else 0.0)
            + (0.5 if lr == LATE and rounds >= 9 else 0.0))


class FakeRuns:
    """``subprocess.run`` of ``fedloom run``: writes a summary with ``_acc``; a run
    resumed from a copy continues from the rounds the copy had run."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, float, int, int, int]] = []  # folder, lr, seed, from, to

    def __call__(self, cmd, env=None, **kw):
        args = list(cmd[4:])
        out = Path(args[args.index("--out") + 1])
        ov = dict(a.split("=", 1) for a in args[1:] if "=" in a and not a.startswith("-"))
        rounds, lr, seed = int(ov["rounds"]), float(ov["client.lr"]), int(ov["seed"])
        start = 0
        if "--resume" in args:
            start = int((out / "progress").read_text())
            assert start < rounds
        else:
            assert not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        (out / "progress").write_text(str(rounds))
        self.ran.append((out.parent.name, lr, seed, start, rounds))
        summary = {"rounds": rounds, "test_acc": _acc(lr, rounds)}
        if lr == DIVERGES and out.parent.name.startswith("B@"):
            summary["warnings"] = ["round 1: the training loss is not finite"]
        (out / "summary.json").write_text(json.dumps(summary))
        return subprocess.CompletedProcess(cmd, 0, "", "")


def _suite(tmp_path: Path, budget: int = 9, out: str = "runs", **tuning) -> Path:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "rounds": 20}))
    suite = {
        "name": "h", "out": str(tmp_path / out), "doc": None, "seeds": [1],
        "tuning": {"budget": budget, "seeds": [7, 8], "metric": "test_acc", "rounds": 9,
                   "sampler": "halving", "eta": 3, "min_rounds": 1,
                   "space": {"client.lr": LRS}, **tuning},
        "settings": {"s": {"config": str(cfg)}},
        "methods": {"A": [], "B": ["client.prox_mu=0.1"]},
    }
    path = tmp_path / f"suite-{out}.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def _tune(path: Path, monkeypatch, fake: FakeRuns | None = None):
    fake = fake or FakeRuns()
    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", fake)
    suite = load_suite(path)
    chosen = tune_protocol(suite, workers=1, log=lambda s: None)
    return suite, chosen, fake


def test_rungs_plan_and_promotion_rules():
    assert halving_rungs(9, 9, 1, 3) == [(1, 9), (3, 3), (9, 1)]
    assert halving_rungs(12, 30, 10, 3) == [(10, 12), (30, 4)]
    assert halving_rungs(12, 30, 4, 3) == [(4, 12), (12, 4), (30, 1)]
    assert halving_rungs(5, 10, 10, 3) == [(10, 5)]  # one rung: the grid sampler's runs
    assert plan_rounds([(1, 9), (3, 3), (9, 1)]) == 9 + 3 * 2 + 6
    assert plan_rounds([(1, 9), (3, 3), (9, 1)], extend=False) == 9 + 9 + 9
    # the best finite scores, the earlier trial on a tie; NaN never goes on
    assert promote({0: 0.5, 1: 0.7, 2: 0.7, 3: math.nan}, 2, lower=False) == [1, 2]
    assert promote({0: 0.5, 1: math.nan, 2: 0.1}, 2, lower=True) == [2, 0]
    assert promote({0: math.nan, 1: math.inf}, 1, lower=False) == []
    # the choice: the highest rung with a finite score, its best, the earliest on a tie
    ts = [Trial(0, {}, {1: 0.99}, rung=0), Trial(1, {}, {1: 0.5}, rung=1),
          Trial(2, {}, {1: 0.6}, rung=1), Trial(3, {}, {1: math.nan}, rung=2)]
    assert halving_choice(ts, lower=False).index == 2
    assert halving_choice([Trial(0, {}, {1: math.nan}, rung=0)], lower=False).index == 0


@pytest.mark.parametrize("raw, match", [
    ({"sampler": "halving"}, r"min_rounds: sampler: halving needs"),
    ({"sampler": "halving", "min_rounds": 5, "eta": 1}, r"eta: needs a whole number ≥ 2"),
    ({"sampler": "halving", "min_rounds": 50, "rounds": 30}, r"min_rounds: 50 is above"),
    ({"sampler": "grid", "eta": 3}, r"\.eta: only with sampler: halving"),
])
def test_halving_protocol_errors_name_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        load_protocol({"budget": 4, "seeds": [9], **raw}, "tuning", [1])


def test_promotion_follows_the_rung_metric_and_the_choice_the_last_rung(tmp_path, monkeypatch):
    suite, chosen, fake = _tune(_suite(tmp_path), monkeypatch)
    a = suite.trials[("s", "A")]
    by_lr = {t.params["client.lr"]: t for t in a}
    assert sorted(by_lr) == sorted(LRS)
    # rung 0 (1 round): every trial; rung 1 (3 rounds): the best third at 1 round; rung 2
    # (9 rounds): the best of those at 3 rounds
    rung1 = sorted(LRS, key=lambda lr: -_acc(lr, 1))[:3]
    assert rung1 == [DIVERGES, 0.1, CLIMBER]
    assert {lr for lr, t in by_lr.items() if t.rung >= 1} == set(rung1)
    # rung 2 (9 rounds): the best of those at 3 rounds, the climber (not rung 0's best);
    # the late bloomer, best of all at 9 rounds, was stopped at the first rung
    assert [lr for lr, t in by_lr.items() if t.rung == 2] == [CLIMBER]
    assert by_lr[LATE].rung == 0
    assert chosen[("s", "A")] == {"client.lr": CLIMBER}
    for lr, t in by_lr.items():
        assert t.rounds == [1, 3, 9][t.rung]
        assert t.score == pytest.approx(_acc(lr, t.rounds))  # the score at its last rung
        assert set(t.rung_scores) == set([1, 3, 9][: t.rung + 1])
    # a promoted trial continued its run: each (trial, seed) ran 1, then 1 → 3, then 3 → 9
    a_runs = [r for r in fake.ran if r[0].startswith("A@")]
    assert sorted((s, e) for f, lr, seed, s, e in a_runs if lr == CLIMBER and seed == 7) == [
        (0, 1), (1, 3), (3, 9)]
    for folder in ("A@tune=client.lr=0.08@r1", "A@tune=client.lr=0.08@r3",
                   "A@tune=client.lr=0.08"):  # one finished run per (trial, rounds)
        assert (tmp_path / "runs" / "s" / folder / "seed7" / "summary.json").is_file()


def test_budget_in_client_rounds_is_the_same_for_every_method(tmp_path, monkeypatch):
    suite, _, fake = _tune(_suite(tmp_path), monkeypatch)
    proto = suite.tuning.protocol
    plan_a, plan_b = proto.plans[("s", "A")], proto.plans[("s", "B")]
    # rounds 9·1 + 3·(3−1) + 1·(9−3) = 21 per tuning seed, × cohort 4 × 2 tuning seeds
    assert plan_a["client_rounds"] == plan_b["client_rounds"] == 21 * 4 * 2
    assert plan_a["grid"] == plan_b["grid"] == 9 * 9 * 4 * 2
    assert [r["trials"] for r in plan_a["rungs"]] == [9, 3, 1]
    # what the fake ran, counted in client rounds, is what each method used
    for m, plan in (("A", plan_a), ("B", plan_b)):
        ran = sum(e - s for f, lr, seed, s, e in fake.ran if f.startswith(f"{m}@")) * 4
        assert plan["used"] == ran == sum(t.cost for t in suite.trials[("s", m)])
    assert plan_a["used"] == plan_a["client_rounds"]  # nothing diverged
    # B's best point diverges: it stops at the first rung, and nothing else is run
    b = {t.params["client.lr"]: t for t in suite.trials[("s", "B")]}
    assert b[DIVERGES].rung == 0 and math.isnan(b[DIVERGES].score)
    assert [(s, e) for f, lr, seed, s, e in fake.ran
            if f.startswith("B@") and lr == DIVERGES] == [(0, 1), (0, 1)]
    assert sum(t.rung >= 1 for t in b.values()) == 3  # the three best finite went on
    assert plan_b["used"] == plan_b["client_rounds"]  # its slot went to the next best


def test_same_suite_same_trials_and_runs_reused(tmp_path, monkeypatch):
    _, c1, f1 = _tune(_suite(tmp_path, out="one"), monkeypatch)
    _, c2, f2 = _tune(_suite(tmp_path, out="two"), monkeypatch)
    rec = [json.loads((tmp_path / o / "h.tuning.json").read_text()) for o in ("one", "two")]
    assert rec[0] == rec[1] and c1 == c2
    assert [r[1:] for r in f1.ran] == [r[1:] for r in f2.ran]
    # continued: every run is found finished, nothing runs again, the same choice
    _, c3, f3 = _tune(_suite(tmp_path, out="one"), monkeypatch)
    assert not f3.ran and c3 == c1
    assert json.loads((tmp_path / "one" / "h.tuning.json").read_text()) == rec[0]
    # a report only (workers=0) reads the same rungs and choice, running and copying nothing
    before = sorted(p.name for p in (tmp_path / "one" / "s").iterdir())
    assert tune_protocol(load_suite(_suite(tmp_path, out="one")), workers=0,
                         log=lambda s: None) == c1
    assert sorted(p.name for p in (tmp_path / "one" / "s").iterdir()) == before


def test_a_bigger_budget_keeps_the_first_trials_and_their_rung_results(tmp_path, monkeypatch):
    small, _, _ = _tune(_suite(tmp_path, budget=3), monkeypatch)
    big, _, f_big = _tune(_suite(tmp_path, budget=9), monkeypatch)
    for m in ("A", "B"):
        first, more = small.trials[("s", m)], big.trials[("s", m)]
        assert [t.params for t in more[:3]] == [t.params for t in first]
        for t_small, t_big in zip(first, more, strict=False):
            shared = set(t_small.rung_scores) & set(t_big.rung_scores)
            assert 1 in shared
            assert {r: t_big.rung_scores[r] for r in shared} == {
                r: t_small.rung_scores[r] for r in shared}
    # the first trials' runs at 1 round were not run again
    first_lrs = {t.params["client.lr"] for t in small.trials[("s", "A")]}
    assert not [r for r in f_big.ran if r[0].startswith("A@") and r[1] in first_lrs
                and r[4] == 1]


def test_the_page_lists_every_trial_with_its_rung(tmp_path, monkeypatch):
    from fedloom.report.sweep import _protocol_lines

    suite, chosen, _ = _tune(_suite(tmp_path), monkeypatch)
    page = "\n".join(_protocol_lines(suite, chosen))
    assert "| setting | method | trial | point | rung reached | score |" in page
    for (setting, m), ts in suite.trials.items():
        for t in ts:
            cell = "diverged" if math.isnan(t.score) else f"{t.score * 100:.2f}"
            assert (f"| {setting} | {m} | {t.index} | client.lr={t.params['client.lr']:g} | "
                    f"{t.rung} ({t.rounds} rounds) | {cell}") in page
    assert "Successive halving (η = 3)" in page
    assert "Rungs (trials × rounds): 9 × 1, 3 × 3, 1 × 9." in page
    assert "168 planned, against 648" in page and "(26 %)" in page
    assert page.count("← |") == 2


def test_halving_real_runs_continue_bit_for_bit(tmp_path, monkeypatch):
    """Digits, 4 trials, rungs of 1, 2 and 4 rounds; the setting's config has no
    checkpoints (the sweep asks for one at each rung's end). The trial continued to
    4 rounds is the 4-round run from the start (the same model hash)."""
    from fedloom.sweep import run_suite

    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", cli_in_process)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "rounds": 4, "eval": {"every": 2},
                                   "checkpoint": {"every": 0}}))
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({
        "name": "h", "out": str(tmp_path / "runs"), "doc": str(tmp_path / "h.md"),
        "seeds": [1],
        "tuning": {"budget": 4, "seeds": [7], "metric": "test_acc", "sampler": "halving",
                   "eta": 2, "min_rounds": 1,
                   "space": {"client.lr": [0.02, 0.05, 0.1, 0.2]}},
        "settings": {"digits": {"config": str(cfg)}}, "methods": {"FedAvg": []}},
        sort_keys=False))
    suite = run_suite(path, workers=1, log=lambda s: None)
    ts = suite.trials[("digits", "FedAvg")]
    assert sorted(t.rung for t in ts) == [0, 0, 1, 2]
    top = next(t for t in ts if t.rung == 2)
    assert suite.tuning.protocol.plans[("digits", "FedAvg")]["used"] == (4 + 2 * 1 + 1 * 2) * 4
    runs = tmp_path / "runs" / "digits"
    continued = runs / f"FedAvg@tune={point_slug(top.params)}" / "seed7"
    fresh = tmp_path / "fresh"
    assert cli_in_process(_cmd(cfg, top.params, fresh)).returncode == 0
    a = json.loads((continued / "summary.json").read_text())
    b = json.loads((fresh / "summary.json").read_text())
    assert a["rounds"] == b["rounds"] == 4 and a["model_sha256"] == b["model_sha256"]
    # the lower rungs keep the checkpoint a continuation starts from; the last rung's
    # runs, never continued, drop the checkpoints the sweep asked of them
    slug = point_slug(top.params)
    assert (runs / f"FedAvg@tune={slug}@r2" / "seed7" / "checkpoints" / "last.pt").is_file()
    assert not (continued / "checkpoints").exists()
    doc = (tmp_path / "h.md").read_text()
    assert "rung reached" in doc and "2 (4 rounds)" in doc


def _cmd(cfg: Path, params: dict, out: Path) -> list[str]:
    import sys

    return [sys.executable, "-m", "fedloom.cli", "run", str(cfg),
            *(f"{k}={v!r}" for k, v in params.items()), "rounds=4", "seed=7",
            "logging.plots=false", "--out", str(out), "--quiet"]
