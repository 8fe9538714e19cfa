"""fedloom compare, the sweep report's edges, and per-round logging (metrics.csv,
TensorBoard, callbacks)."""

from __future__ import annotations

import csv
import itertools
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import fedloom
from conftest import TINY
from fedloom.cli import main
from fedloom.config import ConfigError, load_config
from fedloom.report.compare import (
    compare_table,
    find_run_dirs,
    group_runs,
    load_run,
    mean_sd,
)
from fedloom.sweep import load_suite, main_specs

# Three small runs: FedAvg on seeds 1 and 2, the coordinate-wise median on seed 1.
CFG = {**TINY, "rounds": 3, "checkpoint": {"every": 0}}
RUNS = {"fedavg/seed1": ("fedavg", 1), "fedavg/seed2": ("fedavg", 2),
        "median/seed1": ("median", 1)}


@pytest.fixture(scope="module")
def three_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cmp") / "runs"
    for rel, (agg, seed) in RUNS.items():
        fedloom.run(CFG, [f"aggregator.name={agg}", f"seed={seed}"], out=root / rel)
    return root


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _acc(root: Path, rel: str) -> list[float]:
    return [m["test_acc"] for m in _jsonl(root / rel / "metrics.jsonl")]


# ------------------------------------------------------------------------ compare
def test_groups_differ_only_by_seed(three_runs):
    runs = [load_run(p) for p in find_run_dirs([three_runs])]
    groups = group_runs(runs)
    assert [g.keys for g in groups] == [{"aggregator.name": "fedavg"},
                                         {"aggregator.name": "median"}]
    assert [sorted(g.seeds) for g in groups] == [[1, 2], [1]]
    assert [g.label for g in groups] == ["fedavg", "median"]
    # --group-by pools runs that share the key; a key no run has is refused
    assert [len(g.runs) for g in group_runs(runs, ["model.name"])] == [3]
    with pytest.raises(ValueError, match=r"--group-by model\.nope"):
        group_runs(runs, ["model.nope"])


def test_means_and_sd_from_metrics_jsonl(three_runs):
    runs = [load_run(p) for p in find_run_dirs([three_runs])]
    groups = group_runs(runs)
    a1, a2, m1 = (_acc(three_runs, r) for r in RUNS)
    for at, pick in (("final", lambda a: a[-1]), ("best", max), (2, lambda a: a[1])):
        _, _, recs = compare_table(groups, ["test_acc"], at)
        x, y = pick(a1), pick(a2)
        # mean of two values and their sample sd |x − y| / √2 (ddof = 1)
        assert recs[0]["test_acc_mean"] == pytest.approx((x + y) / 2, abs=1e-12)
        assert recs[0]["test_acc_sd"] == pytest.approx(abs(x - y) / math.sqrt(2), abs=1e-12)
        assert recs[1]["test_acc_mean"] == pytest.approx(pick(m1)) and recs[1]["test_acc_sd"] == 0
    # "best" of a loss is its minimum
    losses = [m["test_loss"] for m in _jsonl(three_runs / "median/seed1/metrics.jsonl")]
    _, _, recs = compare_table(groups, ["test_loss"], "best")
    assert recs[1]["test_loss_mean"] == pytest.approx(min(losses))
    # NaN is left out and counted; inf is kept (a diverged run shows)
    assert mean_sd([1.0, float("nan"), 3.0]) == pytest.approx((2.0, math.sqrt(2)))
    assert mean_sd([1.0, float("inf")])[0] == float("inf")


def test_cli_csv_markdown_target_and_plots(three_runs, tmp_path, capsys):
    a1, a2, m1 = (_acc(three_runs, r) for r in RUNS)
    target = min(a1[-1], a2[-1])  # both FedAvg seeds reach it, by their last round at least
    out_csv, out_md, plots = tmp_path / "t.csv", tmp_path / "t.md", tmp_path / "plots"
    rc = main(["compare", str(three_runs), "--metric", "test_acc", "test_loss",
               "--target", str(target), "--csv", str(out_csv), "--markdown", str(out_md),
               "--plots", str(plots)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "3 runs in 2 groups" in out and "test_acc (final)" in out
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["aggregator.name"] for r in rows] == ["fedavg", "median"]
    assert float(rows[0]["test_acc_mean"]) == pytest.approx((a1[-1] + a2[-1]) / 2, rel=1e-12)
    assert rows[0]["seeds"] == "1 2" and rows[0]["runs"] == "2"
    # rounds to target: each run's first round with test_acc >= target (1-based), and
    # uplink_bytes_total at that round
    def reach(rel):
        ms = _jsonl(three_runs / rel / "metrics.jsonl")
        m = next(m for m in ms if m["test_acc"] >= target)
        return m["round"], m["uplink_bytes_total"]

    hits = [reach("fedavg/seed1"), reach("fedavg/seed2")]
    assert float(rows[0]["rounds_to_target_mean"]) == pytest.approx(np.mean([h[0] for h in hits]))
    assert float(rows[0]["uplink_bytes_to_target_mean"]) == pytest.approx(
        np.mean([h[1] for h in hits]))
    assert rows[0]["target_reached"] == "2"
    assert rows[1]["target_reached"] == str(int(any(a >= target for a in m1)))
    md = out_md.read_text().splitlines()
    assert md[2].startswith("| aggregator.name | seeds | test_acc (final) | test_loss (final) |")
    assert md[3] == "|" + "---|" * 6
    assert md[4].startswith("| fedavg | 1,2 | ") and md[5].startswith("| median | 1 | ")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plots skipped: matplotlib is not installed" in out
    else:
        assert (plots / "curves.png").stat().st_size > 0
        assert (plots / "client_acc_cdf.png").stat().st_size > 0


def test_compare_errors(tmp_path, capsys, three_runs):
    assert main(["compare", str(tmp_path / "nope")]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["compare", str(tmp_path / "empty")]) == 2
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('garbage\n{"round": 1}\n')
    assert main(["compare", str(bad)]) == 2
    assert main(["compare", str(three_runs), "--metric", "test_accc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fedloom: error: {tmp_path / 'nope'}: not found",
                   f"fedloom: error: {tmp_path / 'empty'}: holds no run directory (one with "
                   "summary.json or metrics.jsonl)",
                   f"fedloom: error: {bad / 'metrics.jsonl'}: line 1 is not a metrics record",
                   "fedloom: error: --metric test_accc: no run has it (did you mean "
                   "test_acc, test_acc_peak?)"]


def test_plot_axes_integer_rounds_bands_and_log_labels_apart():
    plt = pytest.importorskip("matplotlib.pyplot")
    from fedloom.report.compare import curves_figure

    def stats(seed, per_round_mb):
        rng = np.random.default_rng(seed)
        rows = [{"round": r, "test_acc": 0.5 + 0.01 * r + 0.02 * rng.random(),
                 "uplink_bytes_total": int(per_round_mb * r * 1e6)} for r in range(1, 8)]
        return {"_metrics": rows}

    # cumulative uplink over 0.85 decades (7 rounds) and over ~4 decades (a 1e4 × cheaper run)
    for mbs in ((30.0,), (30.0, 0.003)):
        groups = {f"m{i}": [stats(1, mb), stats(2, mb)] for i, mb in enumerate(mbs)}
        fig = curves_figure("t", groups)
        fig.canvas.draw()
        ax_round, ax_bytes = fig.axes[:2]
        lo, hi = ax_round.get_xlim()
        ticks = [t for t in ax_round.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks)
        # one band (fill_between) per group of two seeds, in each panel
        assert len(ax_round.collections) == len(mbs) == len(ax_bytes.collections)
        boxes = [t.get_window_extent() for t in ax_bytes.get_xticklabels()
                 if t.get_text() and t.get_visible()]
        assert len(boxes) >= 2
        boxes.sort(key=lambda b: b.x0)
        assert all(a.x1 <= b.x0 for a, b in itertools.pairwise(boxes))
        plt.close(fig)


# -------------------------------------------------------------------------- sweep
def _tiny_cfg(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({**CFG, "rounds": 2}))
    return path


def _write_suite(path: Path, **suite) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"name": "t", "seeds": [1], **suite}, sort_keys=False))
    return path


def _sweep_layout(three_runs: Path, out: Path, **which: str) -> None:
    """The fixture's runs copied to where a sweep's runs of ``which`` go (the report
    reads run directories only; copies spare the test two runs)."""
    for method, rel in which.items():
        shutil.copytree(three_runs / rel, out / "digits" / method / "seed1")


def test_sweep_report_only_without_doc_prints_and_writes_csv(tmp_path, capsys, three_runs):
    _tiny_cfg(tmp_path / "tiny.yaml")
    suite = _write_suite(tmp_path / "suite.yaml", out=str(tmp_path / "runs"),
                         settings={"digits": {"config": "tiny.yaml"}},
                         methods={"FedAvg": [], "Median": ["aggregator.name=median"]})
    _sweep_layout(three_runs, tmp_path / "runs", FedAvg="fedavg/seed1", Median="median/seed1")
    out_csv = tmp_path / "r.csv"
    assert main(["sweep", str(suite), "--report-only", "--csv", str(out_csv)]) == 0
    out = capsys.readouterr().out
    assert "## Results" in out and "| FedAvg |" in out and "| Median |" in out
    with open(out_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["setting"], r["method"]) for r in rows] == [("digits", "FedAvg"),
                                                            ("digits", "Median")]
    acc = _jsonl(tmp_path / "runs/digits/Median/seed1/metrics.jsonl")[-1]["test_acc"]
    assert float(rows[1]["test_acc_mean"]) == pytest.approx(acc)


def test_suite_config_relative_to_suite_then_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    here = _tiny_cfg(tmp_path / "sub" / "tiny.yaml")
    suite = _write_suite(tmp_path / "sub" / "suite.yaml",
                         settings={"a": {"config": "tiny.yaml"},          # beside the suite
                                   "b": {"config": "cwd/tiny.yaml"}},     # from the cwd
                         methods={"FedAvg": []})
    _tiny_cfg(tmp_path / "cwd" / "tiny.yaml")
    s = load_suite(suite)
    assert s.settings["a"]["config"] == str(here)
    assert s.settings["b"]["config"] == "cwd/tiny.yaml"
    assert [sp.config for sp in main_specs(s, {})] == [str(here), "cwd/tiny.yaml"]
    # beside the suite wins over the cwd
    _tiny_cfg(tmp_path / "tiny.yaml")
    assert load_suite(suite).settings["a"]["config"] == str(here)
    bad = _write_suite(tmp_path / "sub" / "bad.yaml", settings={"a": {"config": "no.yaml"}},
                       methods={"FedAvg": []})
    with pytest.raises(ConfigError, match=r"bad.yaml: settings.a.config: no.yaml not found"):
        load_suite(bad)


@pytest.mark.parametrize("methods, tune, says", [
    ({"FedAvg": [], "Bad": ["aggregator.name=nosuch"]}, {},
     "methods.Bad (setting digits): aggregator.name: "),
    ({"FedAvg": [], "CRAFT": ["aggregator.name=craft", "server.lr=$TUNE"]},
     {"CRAFT": {"key": "server.lr", "grid": [0.5, -1]}},
     "methods.CRAFT (setting digits with $TUNE=-1): server.lr: "),
])
def test_sweep_bad_method_one_line_before_any_run(tmp_path, capsys, methods, tune, says):
    _tiny_cfg(tmp_path / "tiny.yaml")
    suite = _write_suite(tmp_path / "suite.yaml", out=str(tmp_path / "runs"),
                         settings={"digits": {"config": "tiny.yaml"}}, methods=methods,
                         tune=tune)
    assert main(["sweep", str(suite), "--workers", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fedloom: error: {suite}: {says}"), err
    assert not (tmp_path / "runs").exists()  # nothing ran, the tuning runs included


def test_sweep_failed_run_reports_the_rest_one_line_exit_1(tmp_path, capsys, three_runs,
                                                           monkeypatch):
    _tiny_cfg(tmp_path / "tiny.yaml")
    suite = _write_suite(tmp_path / "suite.yaml", out=str(tmp_path / "runs"),
                         doc=str(tmp_path / "doc" / "t.md"),
                         settings={"digits": {"config": "tiny.yaml"}},
                         methods={"FedAvg": [], "Median": ["aggregator.name=median"]})
    _sweep_layout(three_runs, tmp_path / "runs", FedAvg="fedavg/seed1")
    calls = []

    def failing_run(cmd, **kw):  # the one run left to do exits 2, as `fedloom run` would
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 2, "", "fedloom: error: data.path: gone\n")

    monkeypatch.setattr("fedloom.sweep.subprocess.run", failing_run)
    assert main(["sweep", str(suite), "--workers", "1"]) == 1
    assert len(calls) == 1 and "aggregator.name=median" in calls[0]
    cap = capsys.readouterr()
    assert cap.err.strip().splitlines() == [
        "fedloom: error: 1 of 1 runs failed; first: digits/Median/seed1 failed: fedloom: "
        "error: data.path: gone"]
    doc = (tmp_path / "doc" / "t.md").read_text()
    assert "| FedAvg |" in doc and "| Median |" not in doc and "1 of 2 runs have not" in doc


# ------------------------------------------------------------------------ logging
def _cell(text: str):
    if text == "":
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _csv_rows(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        r = csv.reader(f)
        header = next(r)
        rows = [{k: _cell(v) for k, v in zip(header, line, strict=True) if v != ""}
                for line in r]
    return header, rows


def test_metrics_csv_equals_jsonl_across_a_resume(tmp_path):
    # eval every 2 rounds: test_acc first appears in round 2 (the header widens then);
    # the checkpoint is at round 2, the run stops after round 3, so the resume drops
    # round 3 from metrics.jsonl and runs it again
    ov = ["rounds=4", "eval.every=2", "checkpoint.every=2"]
    out = tmp_path / "run"
    seen: list[int] = []

    def stop(state, m):
        seen.append(m["round"])
        if m["round"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fedloom.run(TINY, ov, out=out, callbacks=[stop])
    header, rows = _csv_rows(out / "metrics.csv")
    assert rows == _jsonl(out / "metrics.jsonl") and len(rows) == 3
    fedloom.run(TINY, ov, out=out, resume=True, callbacks=[lambda st, m: seen.append(m["round"])])
    assert seen == [1, 2, 3, 3, 4]  # the callback hook: (state, metrics) after each round
    jl = _jsonl(out / "metrics.jsonl")
    header, rows = _csv_rows(out / "metrics.csv")
    assert [m["round"] for m in jl] == [1, 2, 3, 4] and rows == jl
    union: dict[str, None] = {}
    for m in jl:
        union.update(dict.fromkeys(m))
    assert header == list(union)  # union of keys, in order of first appearance


def test_metrics_csv_can_be_turned_off(tmp_path):
    fedloom.run(TINY, ["rounds=1", "logging.csv=false"], out=tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_tensorboard_scalars_and_resume_purge(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ov = ["rounds=4", "checkpoint.every=2", "logging.tensorboard=true"]
    out = tmp_path / "run"

    def stop(state, m):
        if m["round"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fedloom.run(TINY, ov, out=out, callbacks=[stop])
    # round 3 runs again; other logging settings do not stop a resume
    fedloom.run(TINY, [*ov, "logging.csv=false"], out=out, resume=True)
    assert not (out / "metrics.csv").exists()  # the first leg's copy would be stale
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    jl = _jsonl(out / "metrics.jsonl")
    got = acc.Scalars("test_acc")
    # the killed run's round 3 is purged (purge_step=3): each round once, the resumed values
    assert [e.step for e in got] == [1, 2, 3, 4]
    assert [e.value for e in got] == pytest.approx([m["test_acc"] for m in jl], rel=1e-6)
    assert "uplink_bytes_total" in acc.Tags()["scalars"]


def test_tensorboard_config_errors(monkeypatch):
    # in memory there is no run directory to write into (or, without the package, that)
    with pytest.raises(ConfigError, match=r"logging\.tensorboard: (writes into the run dir|needs)"):
        fedloom.run(TINY, ["logging.tensorboard=true"])
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"^logging.tensorboard: needs the tensorboard "
                                          r"package \(pip install 'fedloom\[tensorboard\]'\)$"):
        load_config(TINY, ["logging.tensorboard=true"])


def test_load_run_refuses_an_alias_bomb_in_config_yaml(tmp_path):
    """A run directory's config.yaml is read with the config's bounded loader: nine
    levels of nine aliases (9^9 nodes once expanded) are refused naming the file,
    well under a second, instead of being expanded."""
    import time

    from fedloom.report.compare import load_run

    lines = ["a0: &a0 [x]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]"
                               for i in range(1, 10)]
    (tmp_path / "config.yaml").write_text("\n".join(lines) + "\n")
    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"config\.yaml: aliases expand"):
        load_run(tmp_path)
    assert time.perf_counter() - t < 10.0  # a hang guard: expanding took minutes
