"""The tuning protocol (fedloom.tuning) and a sweep run under it (fedloom.sweep).

Samplers and checks are tested directly; one tiny sweep (digits, 2 rounds, runs
through ``fedloom.cli.main`` in this process) checks the bookkeeping: equal
budgets, tuning seeds kept apart, the page's claims, trials and sensitivity."""

import json
import math

import pytest
import yaml

from conftest import TINY, cli_in_process
from fedloom.config import ConfigError
from fedloom.sweep import load_suite, run_suite, validate_suite
from fedloom.tuning import (
    Range,
    Trial,
    best_trial,
    grid_points,
    load_protocol,
    overrides,
    parse_space,
    point_slug,
    tpe_point,
)

SPACE = {"client.lr": [0.01, 0.03, 0.1], "server.lr": [0.5, 1.0]}


def test_grid_is_a_fixed_permutation_nested_in_larger_budgets():
    six = grid_points(SPACE, 6, 0, "s", "m")
    assert sorted(map(point_slug, six)) == sorted(
        f"client.lr={a!r},server.lr={b!r}" for a in SPACE["client.lr"] for b in SPACE["server.lr"])
    assert grid_points(SPACE, 3, 0, "s", "m") == six[:3]  # a doubled budget keeps the first
    assert grid_points(SPACE, 6, 0, "s", "m") == six      # the same on every call
    assert grid_points(SPACE, 6, 1, "s", "m") != six      # the sampler seed draws the order


def test_grid_smaller_than_the_budget_is_refused_by_method_and_setting():
    with pytest.raises(ConfigError, match=r"methods\.FedAvg \(setting mnist\): its space has 6 "
                                          r"points, fewer than tuning\.budget 8"):
        grid_points(SPACE, 8, 0, "mnist", "FedAvg")
    with pytest.raises(ConfigError, match="needs lists"):
        grid_points({"client.lr": Range(0.01, 0.1, True)}, 1, 0, "s", "m")


def test_tpe_point_depends_only_on_its_history():
    pytest.importorskip("optuna")
    space = {"client.lr": Range(1e-3, 1.0, log=True), "server.lr": [0.5, 1.0]}
    hist: list[Trial] = []
    for i in range(6):
        p = tpe_point(space, hist, i, 0, "s", "m", lower=False, startup=3)
        assert p == tpe_point(space, hist, i, 0, "s", "m", lower=False, startup=3)
        assert 1e-3 <= p["client.lr"] <= 1.0 and p["server.lr"] in (0.5, 1.0)
        # a score that favours small steps; a NaN (diverged) trial on the way
        score = math.nan if i == 2 else -abs(math.log10(p["client.lr"]) + 2)
        hist.append(Trial(i, p, {101: score}))
    # the first trials do not change when the budget grows (trial i sees trials < i only)
    assert tpe_point(space, hist[:1], 1, 0, "s", "m", lower=False, startup=3) == hist[1].params


def test_best_trial_nan_is_worst_and_ties_go_to_the_earliest():
    ts = [Trial(0, {"a": 1}, {1: math.nan}), Trial(1, {"a": 2}, {1: 0.5, 2: 0.7}),
          Trial(2, {"a": 3}, {1: 0.6}), Trial(3, {"a": 4}, {1: 0.6, 2: math.inf})]
    assert best_trial(ts, lower=False).index == 1  # 0.6 == 0.6: trial 1 came first
    assert best_trial(ts, lower=True).index == 1
    assert best_trial(ts[:1], lower=False).index == 0  # all diverged: still a choice


def test_overrides_read_back_exactly_and_slugs_stay_short_and_distinct():
    from fedloom.config import load_config

    cfg = load_config("configs/quickstart.yaml",
                      overrides({"client.lr": 0.1 + 0.2, "server.lr": 1e-7}))
    assert cfg.client.lr == 0.1 + 0.2 and cfg.server.lr == 1e-7
    long_a = {f"aggregator.options.k{i}": 0.123456789 for i in range(12)}
    long_b = {**long_a, "aggregator.options.k11": 0.5}
    assert len(point_slug(long_a)) <= 120 and point_slug(long_a) != point_slug(long_b)


@pytest.mark.parametrize("raw, match", [
    ({"seeds": [1]}, "budget: needs a whole number"),
    ({"budget": 2, "seeds": [1]}, "seeds: 1 is also a reported seed"),
    ({"budget": 2, "seeds": []}, "seeds: needs a non-empty list"),
    ({"budget": 2, "seeds": [9], "sampler": "random"}, "sampler: 'random'"),
    ({"budget": 2, "seeds": [9], "bogus": 1}, "bogus: unknown key"),
    ({"budget": 2, "seeds": [9], "space": {"client.lr": []}}, "client.lr: needs a non-empty"),
    ({"budget": 2, "seeds": [9], "space": {"client.lr": [0.1, 0.1]}}, "listed twice"),
    ({"budget": 2, "seeds": [9], "space": {"client.lr": {"low": 0, "high": 1, "log": True}}},
     "log range needs low > 0"),
    ({"budget": 2, "seeds": [9], "space": {"client.lr": [float("nan")]}}, "must be finite"),
    ({"budget": 2, "seeds": [9], "sensitivity": {"key": "client.lr", "bogus": 1}},
     "sensitivity.bogus: unknown key"),
    ({"budget": 2, "seeds": [9], "sensitivity": {"values": [0.1]}}, "needs key:"),
])
def test_protocol_errors_name_the_field(raw, match):
    with pytest.raises(ConfigError, match=match):
        load_protocol(raw, "suite.yaml: tuning", reported=[1, 2])


def test_space_parses_ranges_and_lists():
    sp = parse_space({"a": [1, 2], "b": {"low": 0.1, "high": 1.0, "log": True}}, "x")
    assert sp == {"a": [1, 2], "b": Range(0.1, 1.0, True)}


def _suite(tmp_path, **extra):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "rounds": 2, "checkpoint": {"every": 0}}))
    suite = {
        "name": "t", "out": str(tmp_path / "runs"), "doc": str(tmp_path / "doc" / "t.md"),
        "seeds": [1, 2],
        "tuning": {"budget": 2, "seeds": [7], "metric": "test_acc", "rounds": 1,
                   "space": {"client.lr": [0.05, 0.2], "server.lr": [1.0]},
                   # values: client.lr's list in each method's space
                   "sensitivity": {"key": "client.lr"}},
        "settings": {"digits": {"config": str(cfg)}},
        "methods": {
            "FedAvg": [],
            "FedProx": {"overrides": [], "space": {"client.prox_mu": [0.0, 0.1]}},
            "Prox-0.1": {"overrides": ["client.prox_mu=0.1"]},
        },
        "share_tuning": {"Prox-0.1": "FedProx"},
        "claims": [{"claim": "FedProx beats FedAvg", "method": "FedProx",
                    "against": ["FedAvg", "Prox-0.1"], "metric": "test_acc"}],
        "report": {"compare": {"baseline": "FedAvg", "candidates": ["FedProx"]}},
        **extra,
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def test_sweep_under_the_protocol_tunes_reports_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")  # one process per run
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", cli_in_process)
    path = _suite(tmp_path)
    logs: list[str] = []
    suite = run_suite(path, workers=1, log=logs.append)
    # equal budget: FedAvg's grid has 2 points, FedProx's 4, each got 2 trials on seed 7
    assert {k: len(v) for k, v in suite.trials.items()} == {("digits", "FedAvg"): 2,
                                                            ("digits", "FedProx"): 2}
    tune_dirs = [p.parent.parent.name for p in (tmp_path / "runs").rglob("seed7/summary.json")]
    assert len(tune_dirs) == 4 and all("@tune=" in d for d in tune_dirs)
    # tuning seeds are never reported seeds, and reported runs never sit in tuning folders
    assert not [p for p in (tmp_path / "runs").rglob("seed[12]") if "@tune=" in str(p)]
    rec = json.loads((tmp_path / "runs" / "t.tuning.json").read_text())
    assert rec["budget"] == 2 and set(rec["settings"]["digits"]) == {"FedAvg", "FedProx"}
    for t in rec["settings"]["digits"]["FedProx"]["trials"]:
        assert set(t["scores"]) == {"7"} and 0.0 <= t["score"] <= 1.0
    # the shared method borrows FedProx's steps but keeps its own prox_mu
    chosen = rec["settings"]["digits"]["FedProx"]["chosen"]
    cfg = yaml.safe_load((tmp_path / "runs" / "digits" / "Prox-0.1" / "seed1" /
                          "config.yaml").read_text())
    assert cfg["client"]["prox_mu"] == 0.1 and cfg["client"]["lr"] == chosen["client.lr"]
    assert cfg["rounds"] == 2  # main runs keep the setting's rounds; tuning runs used 1
    tcfg = next((tmp_path / "runs" / "digits").glob("FedAvg@tune=*/seed7/config.yaml"))
    assert yaml.safe_load(tcfg.read_text())["rounds"] == 1
    doc = (tmp_path / "doc" / "t.md").read_text()
    assert doc.index("## Claims") < doc.index("## Tuning") < doc.index("## Results")
    assert "| FedProx beats FedAvg | FedAvg |" in doc and "(2 seeds)" in doc
    assert "**2 trials** per setting" in doc and "<details>" in doc and "←" in doc
    # client.lr's grid is [0.05, 0.2]: any choice sits at its edge, and the page says so
    lr = rec["settings"]["digits"]["FedAvg"]["chosen"]["client.lr"]
    end = "lowest" if lr == 0.05 else "highest"
    assert f"FedAvg `client.lr` = {lr:g} (the {end} searched)" in doc
    assert "Sensitivity to `client.lr`" in doc
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert (tmp_path / "doc" / "t-digits-sensitivity.png").stat().st_size > 0
    assert "Paired over the seeds" in doc and "summed" not in doc
    again: list[str] = []
    run_suite(path, workers=1, log=again.append)
    assert all("0 of" in s for s in again if "runs to do" in s)
    only = run_suite(path, report_only=True, log=lambda s: None)
    assert "## Claims" in only.report_text


def test_protocol_suite_checks_every_point_before_running(tmp_path):
    path = _suite(tmp_path, methods={"FedAvg": [], "Bad": {
        "overrides": [], "space": {"client.batch_size": [0, 16]}}}, share_tuning={},
        claims=[])
    with pytest.raises(ConfigError, match=r"methods\.Bad \(setting digits at .*batch_size"):
        validate_suite(load_suite(path))
    path = _suite(tmp_path, tuning={"budget": 3, "seeds": [7],
                                    "space": {"client.lr": [0.05, 0.2]}})
    with pytest.raises(ConfigError, match=r"its space has 2 points, fewer than tuning\.budget 3"):
        validate_suite(load_suite(path))


@pytest.mark.parametrize("extra, match", [
    ({"tune": {"FedAvg": {"key": "server.lr", "grid": [1.0]}}}, "tune: and tuning: both"),
    ({"claims": [{"claim": "x", "method": "Nope", "against": ["FedAvg"], "metric": "m"}]},
     "'Nope' is not a method"),
    ({"claims": [{"claim": "x", "method": "FedAvg", "against": "FedProx"}]}, "metric: missing"),
    ({"share_tuning": {"Prox-0.1": "Ghost"}}, "'Ghost' is not a tuned method"),
    ({"methods": {"A": ["server.lr=$TUNE"]}}, r"\$TUNE belongs to tune:"),
    ({"methods": {"A": {"overrides": [], "grid": [1]}}}, "methods.A.grid: unknown key"),
    ({"settings": {"digits": {"config": "tiny.yaml", "tuning_rounds": 0}}},
     "settings.digits.tuning_rounds: needs"),
])
def test_protocol_suite_errors(tmp_path, extra, match):
    if "methods" in extra:
        extra = {**extra, "share_tuning": {}, "claims": []}
    with pytest.raises(ConfigError, match=match):
        load_suite(_suite(tmp_path, **extra))


def test_sweep_with_tpe_resumes_to_the_same_trials(tmp_path, monkeypatch):
    pytest.importorskip("optuna")
    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", cli_in_process)
    path = _suite(tmp_path, tuning={
        "budget": 3, "seeds": [7], "metric": "test_acc", "rounds": 1, "sampler": "tpe",
        "startup": 2, "space": {"client.lr": {"low": 0.02, "high": 0.5, "log": True},
                                "server.lr": [0.5, 1.0]}},
        methods={"FedAvg": []}, share_tuning={}, claims=[], report={})
    first = run_suite(path, workers=1, log=lambda s: None)
    trials = first.trials[("digits", "FedAvg")]
    assert len(trials) == 3
    for t in trials:
        assert 0.02 <= t.params["client.lr"] <= 0.5 and t.params["server.lr"] in (0.5, 1.0)
        assert t.params["client.lr"] == float(f"{t.params['client.lr']:.3g}")
    again: list[str] = []
    second = run_suite(path, workers=1, log=again.append)  # the same points: nothing runs
    assert [t.params for t in second.trials[("digits", "FedAvg")]] == [t.params for t in trials]
    assert all("0 of" in s for s in again if "runs to do" in s)


def test_a_finished_run_of_another_config_is_refused_not_reused(tmp_path, monkeypatch):
    """Main runs are named by setting, method and seed: when a method's point changes,
    its old run must not stand in for the new one."""
    from fedloom.sweep import SweepError

    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", cli_in_process)
    path = _suite(tmp_path, methods={"FedAvg": {"overrides": [], "tune": False}},
                  share_tuning={}, claims=[], report={})
    run_suite(path, workers=1, log=lambda s: None)
    raw = yaml.safe_load(path.read_text())
    raw["methods"]["FedAvg"]["overrides"] = ["client.lr=0.2"]
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(SweepError, match=r"finished runs hold another config .*client\.lr: "
                                         r"0\.1 → 0\.2"):
        run_suite(path, workers=1, log=lambda s: None)


def test_a_finished_run_whose_method_resolved_its_config_is_reused(tmp_path, monkeypatch):
    """FedBN's run saves ``model.buffers: local`` (the method resolves it), the suite
    asks for the default: the run is the same config and is reused, not refused."""
    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", cli_in_process)
    path = _suite(tmp_path, methods={"FedBN": {"overrides": ["client.method=fedbn"],
                                               "tune": False}},
                  share_tuning={}, claims=[], report={})
    run_suite(path, workers=1, log=lambda s: None)
    again: list[str] = []
    run_suite(path, workers=1, log=again.append)
    assert all("0 of" in s for s in again if "runs to do" in s)


def test_a_method_can_be_chosen_on_its_own_metric(tmp_path, monkeypatch):
    """``methods.M.metric``: that method's trials are scored and chosen on its metric
    (a loss: lowest wins), the others on the protocol's; the record says which."""
    import json

    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", cli_in_process)
    path = _suite(tmp_path, methods={"FedAvg": [],
                                     "ByLoss": {"overrides": [], "metric": "test_loss"}},
                  share_tuning={}, claims=[], report={})
    res = run_suite(path, workers=1, log=lambda s: None)
    by_loss = res.trials[("digits", "ByLoss")]
    by_acc = res.trials[("digits", "FedAvg")]
    # the same points (the whole 2-point grid), scored by different metrics
    assert sorted(map(str, (t.params for t in by_loss))) == sorted(
        map(str, (t.params for t in by_acc)))
    assert all(0 < t.score < 10 for t in by_loss) and all(0 <= t.score <= 1 for t in by_acc)
    best = min(by_loss, key=lambda t: t.score)
    record = json.loads((tmp_path / "runs" / "t.tuning.json").read_text())
    assert record["method_metric"] == {"ByLoss": "test_loss"}
    chosen = record["settings"]["digits"]["ByLoss"]["chosen"]
    assert chosen == best.params
    with pytest.raises(ConfigError, match=r"methods\.X\.metric"):
        load_suite(_suite(tmp_path, methods={"X": {"metric": ""}}, share_tuning={},
                          claims=[], report={}))


def test_a_stale_trial_is_refused_not_scored_and_a_stopped_trial_resumes(tmp_path, monkeypatch):
    """A sweep stopped mid-tuning and continued with a method's overrides changed: its
    trials in ``out:`` hold the old config, finished or stopped, and the sweep stops
    there (nothing run, no trial of the old config scored or chosen). Continued as it
    was, the stopped trial resumes and scores."""
    import shutil

    from fedloom.sweep import StaleRunsError

    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    cmds: list[list[str]] = []

    def run(cmd, **kw):
        cmds.append(list(cmd))
        return cli_in_process(cmd, **kw)

    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", run)
    tuning = {"budget": 2, "seeds": [7], "metric": "test_acc", "rounds": 1,
              "space": {"client.lr": [0.05, 0.2]}}
    path = _suite(tmp_path, tuning=tuning, methods={"FedAvg": []}, share_tuning={}, claims=[],
                  report={})
    run_suite(path, workers=1, log=lambda s: None)
    runs = tmp_path / "runs" / "digits"
    done, stopped = sorted(runs.glob("FedAvg@tune=*/seed7"))
    # stopped mid-tuning: the second trial has not finished, no main run has started
    (stopped / "summary.json").unlink()
    shutil.rmtree(runs / "FedAvg")
    changed = yaml.safe_load(path.read_text())
    changed["methods"]["FedAvg"] = ["client.batch_size=8"]
    path.write_text(yaml.safe_dump(changed, sort_keys=False))
    cmds.clear()
    with pytest.raises(StaleRunsError, match=r"^1 finished and 1 stopped runs hold another "
                                             r"config .*client\.batch_size: 16 → 8"):
        run_suite(path, workers=1, log=lambda s: None)
    assert not cmds and not (runs / "FedAvg").exists()
    shutil.rmtree(done)  # the stopped trial alone: it could not resume either
    with pytest.raises(StaleRunsError, match=r"^1 stopped runs hold another config"):
        run_suite(path, workers=1, log=lambda s: None)
    assert not cmds and not (stopped / "summary.json").exists()
    changed["methods"]["FedAvg"] = []
    path.write_text(yaml.safe_dump(changed, sort_keys=False))
    suite = run_suite(path, workers=1, log=lambda s: None)
    assert [c for c in cmds if str(stopped) in c and "--resume" in c]
    assert (stopped / "summary.json").exists() and (done / "summary.json").exists()
    assert all(math.isfinite(t.score) for t in suite.trials[("digits", "FedAvg")])


def test_grid_edge_names_the_end_a_choice_sits_at():
    from fedloom.report.sweep_tuning import grid_edge
    from fedloom.tuning import Range

    grid = [0.003, 0.01, 0.03, 0.1]
    assert [grid_edge(v, grid) for v in grid] == ["lowest", None, None, "highest"]
    assert grid_edge(1.0, [1.0]) is None  # one value: nothing was searched
    assert grid_edge("adam", ["sgd", "adam"]) is None and grid_edge(True, [True, False]) is None
    assert grid_edge(float("nan"), grid) is None
    # a range: within 1 % of its width of an end, on the log scale for a log range
    assert grid_edge(1.05e-3, Range(1e-3, 1.0, log=True)) == "lowest"
    assert grid_edge(0.03, Range(1e-3, 1.0, log=True)) is None
    assert grid_edge(0.995, Range(0.0, 1.0)) == "highest"
