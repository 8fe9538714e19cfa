"""Out-of-tree plug-ins: entry points and ``module:attr`` names work in the config
schema, the CLI and sweeps exactly like built-ins.

The example package ``examples/plugin`` (``fedloom-example-plugin``) must be
installed in the test environment: ``make test`` does it (``pip install -e
examples/plugin --no-deps``). It provides the aggregator ``geomed`` through the
``fedloom.aggregators`` entry point and the partitioner
``fedloom_example_plugin.partition:round_robin``, named by ``module:attr``.
"""

from __future__ import annotations

import importlib.metadata
import json

import pytest
import torch
import yaml

import fedloom
from conftest import TINY
from fedloom.cli import main
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment
from fedloom.registry import available, get, origin

ROUND_ROBIN = "fedloom_example_plugin.partition:round_robin"


@pytest.fixture(scope="module", autouse=True)
def _installed() -> None:
    try:
        importlib.metadata.distribution("fedloom-example-plugin")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("fedloom-example-plugin is not installed: run `make test`, or "
                    "`pip install -e examples/plugin --no-deps`")


def _config(tmp_path, **extra) -> str:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**TINY, "rounds": 2, "checkpoint": {"every": 0}, **extra}))
    return str(path)


def test_entry_point_is_listed_and_built_like_a_builtin():
    assert "geomed" in available("aggregator")
    assert origin("aggregator", "geomed").startswith("entry point of fedloom-example-plugin")
    assert origin("aggregator", "fedavg") == "fedloom"
    agg = fedloom.make_aggregator("geomed", iters=50)
    # Property: four rows around 0 and one at 1e3: the geometric median stays with
    # the four (the mean moves by 200); identical rows give that row.
    rows = torch.zeros(5, 3, dtype=torch.float64)
    rows[:4] = torch.tensor([[1.0, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0]])
    rows[4] = 1e3
    z, _, metrics = agg(rows, torch.ones(5), None)
    assert float(torch.linalg.vector_norm(z)) < 1.0 and metrics["geomed_iters"] >= 1
    same, _, _ = agg(rows[:1].repeat(3, 1), torch.ones(3), None)
    assert torch.allclose(same, rows[0])
    with pytest.raises(ValueError, match=r"aggregator\.options\.bogus"):
        fedloom.make_aggregator("geomed", bogus=1)


def test_algorithm_listing_shows_plugins_but_the_reference_does_not(capsys):
    assert main(["algorithms"]) == 0
    listing = capsys.readouterr().out
    assert "aggregator       geomed         iters=4, nu=1e-06, tol=1e-08  [entry point of " \
           "fedloom-example-plugin" in listing
    assert main(["algorithms", "--markdown"]) == 0
    assert "geomed" not in capsys.readouterr().out


def test_config_schema_checks_plugin_names_and_references():
    cfg = load_config(TINY, ["aggregator.name=geomed", f"data.partition={ROUND_ROBIN}"])
    assert cfg.aggregator.name == "geomed"
    # an unknown name still lists the known ones, plug-ins included
    with pytest.raises(ConfigError, match=r"^aggregator\.name: unknown aggregator 'geomd' "
                                          r"\(did you mean geomed\? available: .*geomed"):
        load_config(TINY, ["aggregator.name=geomd"])
    # a reference that cannot be imported, or is not a factory: one line naming the field
    with pytest.raises(ConfigError, match=r"^compression\.feedback\.name: feedback "
                                          r"'no_such_mod:f': cannot import it "
                                          r"\(ModuleNotFoundError"):
        load_config(TINY, ["compression.feedback=no_such_mod:f"])
    with pytest.raises(ConfigError, match=r"^data\.partition\.name: .*not a factory"):
        load_config(TINY, ["data.partition=fedloom_example_plugin:__doc__"])


def test_cli_runs_the_plugins(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["run", _config(tmp_path), "aggregator.name=geomed", "aggregator.options.iters=2",
               f"data.partition={ROUND_ROBIN}", "--out", str(out), "--quiet"])
    assert rc == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["aggregator"]["name"] == "geomed"
    assert saved["data"]["partition"]["name"] == ROUND_ROBIN
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["geomed_iters"] for m in rows] == [2.0, 2.0]
    # the round-robin split: client k holds samples k, k + 10, … of the 1797 digits
    # (before its own train/test split), so sizes are 180 (k < 7) and 179
    exp = Experiment.from_config(load_config(TINY, [f"data.partition={ROUND_ROBIN}"]))
    sizes = [len(a) + len(b) for a, b in zip(exp.fed.train, exp.fed.test, strict=True)]
    assert sizes == [180] * 7 + [179] * 3
    rc = main(["run", _config(tmp_path), "aggregator.name=geomd", "--out", str(tmp_path / "x")])
    assert rc == 2
    assert "aggregator.name: unknown aggregator 'geomd'" in capsys.readouterr().err


def test_sweep_runs_the_plugins(tmp_path):
    from fedloom.sweep import run_suite

    suite = {
        "name": "p", "out": str(tmp_path / "runs"), "seeds": [1],
        "settings": {"digits": {"config": _config(tmp_path)}},
        "methods": {"GeoMed": ["aggregator.name=geomed", f"data.partition={ROUND_ROBIN}"]},
    }
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    run_suite(path, workers=1, log=lambda s: None)  # in a spawned sweep worker process
    summary = json.loads((tmp_path / "runs" / "digits" / "GeoMed" / "seed1" / "summary.json"
                          ).read_text())
    assert summary["rounds"] == 2 and 0 <= summary["test_acc"] <= 1


def test_feedback_options_by_name():
    """``compression.feedback.options`` reaches the factory: SA-PEF with ``alpha=0.5``
    there is the run with the old ``compression.feedback_options.alpha=0.5``."""
    from fedloom.compress.feedback import make_feedback

    base = ["compression.name=topk", "compression.options.ratio=0.1",
            "compression.feedback=sapef", "rounds=2"]
    a = fedloom.run(TINY, [*base, "compression.feedback.options.alpha=0.5"])
    b = fedloom.run(TINY, [*base, "compression.feedback_options.alpha=0.5"])
    c = fedloom.run(TINY, base)  # the default 0.85
    assert a.summary["model_sha256"] == b.summary["model_sha256"] != c.summary["model_sha256"]
    with pytest.raises(ConfigError, match=r"^compression\.feedback\.options\.gamma: unknown "
                                          r"option for feedback 'sapef'"):
        load_config(TINY, [*base, "compression.feedback.options.gamma=1"])
    # the keyword API: a factory's own names; `schedule` is the former alpha_schedule
    assert make_feedback("sapef", alpha=0.3, schedule="theory").schedule == "theory"
    assert get("feedback", "cser")(period=3).period == 3


def test_reference_names_a_plugin_in_any_field(tmp_path):
    """``module:attr`` for a feedback policy and a planner: the factory is imported by
    name, in the run, exactly as a registered one."""
    a = fedloom.run(TINY, ["compression.name=topk", "compression.options.ratio=0.1",
                           "compression.feedback=ef", "rounds=1"])
    b = fedloom.run(TINY, ["compression.name=topk", "compression.options.ratio=0.1",
                           "compression.feedback=fedloom.compress.feedback:error_feedback",
                           "compression.adaptive=fedloom.hooks:no_planner", "rounds=1"])
    assert a.summary["model_sha256"] == b.summary["model_sha256"]
    # the server optimizer too: a reference to the factory of `adam` is `adam`
    c = fedloom.run(TINY, ["server.optimizer=adam", "server.lr=0.05", "rounds=1"])
    d = fedloom.run(TINY, ["server.optimizer=fedloom.server_opt.optimizers:adam",
                           "server.lr=0.05", "rounds=1"])
    assert c.summary["model_sha256"] == d.summary["model_sha256"] != a.summary["model_sha256"]
    with pytest.raises(ConfigError, match=r"^server\.optimizer\.name: unknown "
                                          r"server_optimizer 'adamw' \(did you mean adam\? "
                                          r"available: adagrad, adam, momentum, sgd, yogi\)"):
        load_config(TINY, ["server.optimizer=adamw"])


def test_a_broken_entry_point_is_one_line_naming_it(monkeypatch):
    from importlib.metadata import EntryPoint

    from fedloom import registry

    available("aggregator")  # entry points found
    ep = EntryPoint(name="broken", value="no_such_plugin_mod:Agg", group="fedloom.aggregators")
    monkeypatch.setitem(registry._ENTRY_POINTS["aggregator"], "broken", ep)
    monkeypatch.setitem(registry._DIST["aggregator"], "broken", "broken-dist")
    assert "broken" in available("aggregator")
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["aggregator.name=broken"])
    assert str(e.value) == ("aggregator.name: aggregator 'broken': cannot load entry point "
                            "no_such_plugin_mod:Agg of broken-dist (ModuleNotFoundError: No "
                            "module named 'no_such_plugin_mod')")


def test_metric_hooks_by_name_equal_the_boolean_keys():
    """``metrics.hooks: [mismatch]`` with ``options.mismatch.alpha`` is the run with
    ``metrics.mismatch: true`` and ``mismatch_alpha`` (the same hook, built alike)."""
    base = ["compression.name=topk", "compression.options.ratio=0.1",
            "compression.feedback=ef", "rounds=2", "dtype=float64"]
    a = fedloom.run(TINY, [*base, "metrics.mismatch=true", "metrics.mismatch_alpha=0.5"])
    b = fedloom.run(TINY, [*base, "metrics.hooks=[mismatch]",
                           "metrics.options={mismatch: {alpha: 0.5}}"])
    keys = ("grad_mismatch", "residual_sq", "grad_sq")
    assert [[m[k] for k in keys] for m in a.metrics] == [[m[k] for k in keys] for m in b.metrics]
    # round 1: every residual is 0, so ∇f(w) − ∇f(w − α·0) = 0 exactly; round 2: not
    assert a.metrics[0]["grad_mismatch"] == a.metrics[0]["residual_sq"] == 0.0
    assert a.metrics[1]["grad_mismatch"] > 0 and a.metrics[1]["residual_sq"] > 0
    with pytest.raises(ConfigError, match=r"^metrics\.options\.mismatc: metric 'mismatc' is not "
                                          r"on \(on: mismatch; add it to metrics\.hooks\)$"):
        load_config(TINY, ["metrics.hooks=[mismatch]", "metrics.options={mismatc: {}}"])
    with pytest.raises(ConfigError, match=r"^metrics\.hooks\[0\]: unknown metric 'nope'"):
        load_config(TINY, ["metrics.hooks=[nope]"])


def test_a_dataset_named_by_reference_trains():
    """``data.name=module:attr``: the loader is called as a built-in's; four well
    separated blobs are learnt by a linear model in a few rounds."""
    blobs = "fedloom_example_plugin.data:blobs"
    res = fedloom.run({**TINY, "data": {"name": blobs, "num_clients": 10,
                                        "partition": {"name": "iid"}},
                       "model": {"name": "mlp", "options": {"hidden": [], "activation": "none"}},
                       "rounds": 5}, [])
    assert res.config.data.name == blobs
    assert res.summary["test_acc"] > 0.9  # the blobs' centres are 6 spreads apart
    with pytest.raises(ConfigError, match=r"^data\.name: dataset 'fedloom_example_plugin\.data:"
                                          r"nope': cannot import it \(AttributeError"):
        load_config(TINY, ["data.name=fedloom_example_plugin.data:nope"])


@pytest.mark.parametrize("field, kind", [("aggregator", "aggregator"),
                                         ("compression", "compressor")])
def test_a_factory_that_returns_something_else_is_one_line_exit_2(tmp_path, monkeypatch, capsys,
                                                                   field, kind):
    """``module:attr`` whose factory returns no aggregator (no compressor): one line
    naming the field, the factory and what it returned, exit 2, not a traceback from
    inside the first round."""
    (tmp_path / "not_a_rule.py").write_text("def make(**options):\n    return 42\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    capsys.readouterr()
    rc = main(["run", _config(tmp_path), f"{field}.name=not_a_rule:make",
               "--out", str(tmp_path / "run"), "--quiet"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"fedloom: error: {field}.name: not_a_rule:make returned 42 "
                             "(type int)"), err
    assert f"not an {kind}" in err[0] or f"not a {kind}" in err[0], err
