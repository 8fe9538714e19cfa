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
    Group,
    Run,
    cap_lines,
    compare_table,
    facet_groups,
    facet_keys,
    find_run_dirs,
    group_runs,
    load_run,
    mean_sd,
    panel_labels,
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
                   "test_acc, test_acc_peak, test_acc_window?)"]


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


# ------------------------------------------------------------------ faceted plots
def _group(label: str, **keys) -> Group:
    """A group of one run whose config is ``keys`` (dotted) and nothing else."""
    config: dict = {}
    for k, v in keys.items():
        *head, tail = k.split(".")
        node = config
        for h in head:
            node = node.setdefault(h, {})
        node[tail] = v
    return Group(dict(keys), [Run(Path(label), config, {}, [])], label)


def _stats(final: float, rounds: int = 4, clients: int = 5) -> dict:
    """run_stats-like: test_acc rising to ``final``, 1 MB a round, per-client accuracy."""
    rows = [{"round": r, "test_acc": final * r / rounds, "uplink_bytes_total": r * 10**6}
            for r in range(1, rounds + 1)]
    return {"_metrics": rows, "_client_acc": {"client_acc": list(
        np.linspace(final - 0.1, final, clients))}}


def test_facet_keys_prefer_data_name_then_partition():
    groups = [_group(f"g{i}", **{"aggregator.name": agg, "data.num_clients": n,
                                 "data.partition.alpha": a, "data.name": ds})
              for i, (ds, a, n, agg) in enumerate(
                  [("mnist", 0.1, 100, "fedavg"), ("mnist", 0.1, 100, "median"),
                   ("digits", 0.5, 10, "fedavg")])]
    assert facet_keys(groups) == ["data.name", "data.partition.alpha", "data.num_clients"]
    facets = facet_groups(groups)
    assert {k: [g.label for g in v] for k, v in facets.items()} == {
        "data.name=mnist, alpha=0.1, num_clients=100": ["g0", "g1"],
        "data.name=digits, alpha=0.5, num_clients=10": ["g2"]}
    # nothing data-related differs: one facet, as without facets
    same = [_group(f"h{i}", **{"data.name": "mnist", "aggregator.name": agg})
            for i, agg in enumerate(("fedavg", "median"))]
    assert facet_keys(same) == [] and facet_groups(same) == {"": same}
    # keys named explicitly: any config key, also one that does not differ; a
    # key no run's config has is refused by name
    assert list(facet_groups(same, ["data.name"])) == ["data.name=mnist"]
    assert list(facet_groups(groups, ["aggregator.name"])) == [
        "aggregator.name=fedavg", "aggregator.name=median"]
    with pytest.raises(ValueError, match=r"^--facet data\.nope: no run's config has that key$"):
        facet_groups(groups, ["data.nope"])


def test_panel_labels_drop_facet_key_and_keys_constant_in_the_panel():
    keys = [("mnist", "fedavg", 1.0, 0.1), ("mnist", "median", 1.0, 0.1),
            ("digits", "fedavg", 0.5, 0.1), ("digits", "median", 0.5, 0.05),
            ("cifar10", "craft", 0.5, 0.1)]
    groups = [_group(f"g{i}", **{"data.name": ds, "client.lr": clr, "server.lr": slr,
                                 "aggregator.name": agg})
              for i, (ds, agg, slr, clr) in enumerate(keys)]
    fk = facet_keys(groups)
    facets = facet_groups(groups, fk)
    got = {f: panel_labels(gs, fk) for f, gs in facets.items()}
    assert got == {
        # server.lr and client.lr do not differ within the panel: only the method
        "data.name=mnist": ["fedavg", "median"],
        # client.lr differs too (by its last component: server.lr does not differ here)
        "data.name=digits": ["fedavg, lr=0.1", "median, lr=0.05"],
        # a panel of one: all its keys but the facet's, two lr keys told apart
        "data.name=cifar10": ["craft, client.lr=0.1, server.lr=0.5"]}
    # labels that would repeat are told apart rather than one group hiding the other
    twins = [_group("a", **{"aggregator.name": "x"}), _group("b", **{"aggregator.name": "x"})]
    assert panel_labels(twins) == ["x", "x #2"]


def test_cap_lines_keeps_the_best_by_final_mean_in_panel_order():
    finals = [0.5, 0.9, 0.7, 0.2, 0.8]
    panel = {f"m{i}": [_stats(f), _stats(f)] for i, f in enumerate(finals)}
    kept, left = cap_lines(panel, "test_acc", 3)
    assert list(kept) == ["m1", "m2", "m4"] and left == ["m0", "m3"]
    assert cap_lines(panel, "test_acc", 0) == (panel, [])  # 0: all
    assert cap_lines(panel, "test_acc", 5) == (panel, [])
    # lower is better for a loss; a group without the metric is the first left out
    loss = {f"m{i}": [{"_metrics": [{"round": 1, "test_loss": f}]}] for i, f in enumerate(finals)}
    loss["none"] = [{"_metrics": [{"round": 1}]}]
    assert cap_lines(loss, "test_loss", 2) == ({"m0": loss["m0"], "m3": loss["m3"]},
                                               ["m1", "m2", "m4", "none"])


def _legends(fig) -> list:
    return [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]


def _assert_legends_outside_axes(fig) -> None:
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    legends = _legends(fig)
    assert legends
    for lg in legends:
        box = lg.get_window_extent(r)
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent(r)), (lg, ax)


@pytest.mark.parametrize("n_facets", [1, 3])
def test_faceted_figures_cap_lines_and_keep_legends_off_the_axes(n_facets):
    plt = pytest.importorskip("matplotlib.pyplot")
    from fedloom.report.compare import cdf_facets_figure, curves_facets_figure

    cap, extra = 3, 2
    facets = {f"data.name=d{j}": {f"method {i} with a long label, lr=0.{i}": [
        _stats(0.3 + 0.05 * i + 0.01 * j), _stats(0.32 + 0.05 * i)]
        for i in range(cap + extra)} for j in range(n_facets)}
    capped = {f: cap_lines(p, "test_acc", cap) for f, p in facets.items()}
    for kept, left in capped.values():
        assert len(kept) == cap and len(left) == extra
        # the best by final accuracy: the last ones here
        assert left == [f"method {i} with a long label, lr=0.{i}" for i in range(extra)]
    panels = {f: kept for f, (kept, _) in capped.items()}
    notes = {f: f"{cap} of {cap + extra} groups" for f in facets}
    fig = curves_facets_figure("test_acc", panels, notes=notes)
    curve_axes = fig.axes
    assert len(curve_axes) == 2 * n_facets
    for ax in curve_axes:
        assert len(ax.get_lines()) == cap and len(ax.collections) == cap  # lines, bands
    texts = [t.get_text() for ax in fig.axes for t in ax.texts] + [fig.get_suptitle()]
    # each facet's name and note over its panels (one facet: in the figure's title)
    assert all(any(f in t and notes[f] in t for t in texts) for f in facets)
    _assert_legends_outside_axes(fig)
    # the figure grows with the number of facets
    if n_facets > 1:
        assert fig.get_figheight() > 3 * n_facets
    plt.close(fig)
    fig = cdf_facets_figure("final model", panels, notes=notes)
    assert len(fig.axes) == n_facets
    assert all(len(ax.get_lines()) == cap for ax in fig.axes)
    _assert_legends_outside_axes(fig)
    plt.close(fig)


def _fake_run(path: Path, config: dict, final: float, seed: int = 1) -> None:
    """A run directory as a finished run leaves it, without running anything."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({**config, "seed": seed}))
    rows = [{"round": r, "test_acc": final * r / 3, "uplink_bytes": 10**6,
             "uplink_bytes_total": r * 10**6} for r in range(1, 4)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    (path / "summary.json").write_text(json.dumps({**rows[-1], "seed": seed}))
    (path / "client_acc.json").write_text(json.dumps({"client_acc": [final - 0.1, final]}))


@pytest.fixture(scope="module")
def facet_runs(tmp_path_factory):
    """Two datasets × three aggregators, one seed each (fabricated, no training)."""
    root = tmp_path_factory.mktemp("facets") / "runs"
    for ds, shift in (("digits", 0.0), ("mnist", 0.05)):
        for agg, final in (("fedavg", 0.8), ("median", 0.6), ("craft", 0.9)):
            _fake_run(root / ds / agg, {"data": {"name": ds}, "aggregator": {"name": agg}},
                      final - shift)
    return root


def test_cli_facet_and_max_lines(facet_runs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plots = tmp_path / "plots"
    base = ["compare", str(facet_runs), "--metric", "test_acc"]
    args = [*base, "--plots", str(plots)]
    assert main([*args, "--max-lines", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    # facets by data.name (the key that differs), labels by the aggregator only
    assert [x for x in out if x.startswith("plots: facet")] == [
        "plots: facet data.name=digits: 3 groups, 2 drawn (best final test_acc); "
        "not drawn: median",
        "plots: facet data.name=mnist: 3 groups, 2 drawn (best final test_acc); "
        "not drawn: median"]
    assert (plots / "curves.png").stat().st_size > 0
    assert (plots / "client_acc_cdf.png").stat().st_size > 0
    # facets off: one panel of all six groups, labelled by both keys
    assert main([*args, "--max-lines", "4", "--facet", "none"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [x for x in out if "drawn" in x] == [
        "plots: 6 groups, 4 drawn (best final test_acc); not drawn: "
        "digits, median | mnist, median"]
    # a key no run has, or none with others: one line, exit 2, nothing written
    assert main([*base, "--facet", "data.nope", "--plots", str(tmp_path / "p2")]) == 2
    assert main([*base, "--facet", "none", "data.name"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "fedloom: error: --facet data.nope: no run's config has that key",
        "fedloom: error: --facet none: give it alone (it turns facets off)"]
    assert not (tmp_path / "p2").exists()
    with pytest.raises(SystemExit):
        main([*args, "--max-lines", "-1"])


# -------------------------------------------------------------------------- sweep
def _tiny_cfg(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # the fixture's runs' config: a sweep reuses a copied run only when its config is
    # the one the suite asks for (fedloom.sweep refuses a stale one)
    path.write_text(yaml.safe_dump(CFG))
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
        return subprocess.CompletedProcess(cmd, 2, "", "fedloom: error: data.options.path: gone\n")

    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")  # one process per run
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", failing_run)
    assert main(["sweep", str(suite), "--workers", "1"]) == 1
    assert len(calls) == 1 and "aggregator.name=median" in calls[0]
    cap = capsys.readouterr()
    assert cap.err.strip().splitlines() == [
        "fedloom: error: 1 of 1 runs failed; first: digits/Median/seed1 failed: fedloom: "
        "error: data.options.path: gone"]
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


def test_baseline_pairs_groups_by_seed(three_runs, capsys):
    from fedloom.report.compare import paired_table

    runs = [load_run(p) for p in find_run_dirs([three_runs])]
    groups = group_runs(runs)
    _, rows, recs = paired_table(groups, "fedavg", ["test_acc"])
    # median ran seed 1 only: one pair, its difference exactly median − fedavg on seed 1
    (rec,) = recs
    a1, _, m1 = (_acc(three_runs, r) for r in RUNS)
    assert rec["n"] == 1 and rec["diff"] == pytest.approx(m1[-1] - a1[-1], abs=1e-12)
    assert rec["verdict"] == "no evidence" and "no interval" in rows[0][1]
    with pytest.raises(ValueError, match=r"--baseline nope: no group has that label"):
        paired_table(groups, "nope", ["test_acc"])
    assert main(["compare", str(three_runs), "--baseline", "fedavg"]) == 0
    assert "Paired with 'fedavg' seed by seed" in capsys.readouterr().out
    assert main(["compare", str(three_runs), "--baseline", "nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
