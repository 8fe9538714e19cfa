"""Runs and the command line: the server step's `auto` default, the divergence
warning, extending a finished run, file modes, versions, --version, --help, the
summary table without client test splits, `fedloom datasets` and `fedloom schema`."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import re
import stat
import typing
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import fedloom
from fedloom.aggregate.base import default_server_lr
from fedloom.cli import build_parser, main
from fedloom.config import Config, ConfigError, load_config, yaml_load
from fedloom.data import from_arrays
from fedloom.engine.build import resolve_auto
from fedloom.engine.runs.summary import DivergenceWatch
from fedloom.registry import available, get

ROUNDS = ["rounds=1"]


# ------------------------------------------------------------------ server.lr: auto
def test_auto_server_lr_is_each_rules_public_default():
    # The public code's steps: CRAFT's utils/config.yaml server_lr = 0.1 (its step
    # fixed; its default rprop step is at the mean update's length: 1.0); FedAvg
    # (McMahan et al.) w ← Σ p_k w_k is η_g = 1, and the rules at FedAvg's scale.
    assert default_server_lr("craft") == 1.0
    assert default_server_lr("craft", {"step": "fixed"}) == 0.1
    assert default_server_lr("fedavg") == 1.0
    for name in available("aggregator"):
        factory = get("aggregator", name)
        stated = getattr(factory, "default_server_lr", None)
        if factory.__module__.startswith("fedloom."):  # every built-in rule states its own
            assert stated is not None, f"{name} states no default_server_lr"
        stated = 1.0 if stated is None else stated     # a plug-in that does not: FedAvg's
        pick = getattr(factory, "server_lr_for", None)  # a rule whose options decide it
        stated = pick({}) if callable(pick) else stated
        assert default_server_lr(name) == stated > 0
        cfg = resolve_auto(load_config({"aggregator": {"name": name}}))
        assert cfg.server.lr == stated
    # A number given stays as given (the shipped configs all set server.lr: 1.0).
    assert resolve_auto(load_config({"aggregator": {"name": "craft"},
                                     "server": {"lr": 1.0}})).server.lr == 1.0
    assert load_config({}).server.lr == "auto"
    with pytest.raises(ConfigError, match=r"server\.lr: must be > 0"):
        load_config({"server": {"lr": -1}})
    with pytest.raises(ConfigError, match=r"server\.lr: must be"):
        load_config({"server": {"lr": "fast"}})


def test_auto_server_lr_is_recorded_and_equals_the_explicit_step(tiny, tmp_path):
    fixed = ["aggregator.name=craft", "aggregator.options.step=fixed"]  # the public 0.1
    res = fedloom.run(tiny, [*ROUNDS, *fixed], out=tmp_path / "r")
    saved = yaml_load((tmp_path / "r" / "config.yaml").read_text())
    assert saved["server"]["lr"] == 0.1
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["server_lr"] == 0.1
    explicit = fedloom.run(tiny, [*ROUNDS, *fixed, "server.lr=0.1"])
    assert explicit.summary["model_sha256"] == res.summary["model_sha256"]
    # FedAvg's default is unchanged by `auto`: the same bits as server.lr=1.0.
    a = fedloom.run(tiny, ROUNDS)
    b = fedloom.run(tiny, [*ROUNDS, "server.lr=1.0"])
    assert a.summary["model_sha256"] == b.summary["model_sha256"]
    # config.yaml holds the number: the run resumes, and reruns from it, alike.
    again = fedloom.run(tiny, [*ROUNDS, *fixed], out=tmp_path / "r", resume=True)
    assert again.summary["model_sha256"] == res.summary["model_sha256"]


# ------------------------------------------------------------- divergence warning
def test_divergence_rule_trips_once():
    cfg = load_config({"server": {"lr": 1.0}})
    w = DivergenceWatch(cfg, num_classes=10)
    assert w.see({"round": 1, "train_loss": 1.0}) is None
    assert w.see({"round": 2, "train_loss": 9.9}) is None        # below 10 × 1.0
    msg = w.see({"round": 3, "train_loss": 10.5})
    assert msg is not None and msg.startswith("round 3:") and "client.lr=0.01" in msg
    assert w.see({"round": 4, "train_loss": float("nan")}) is None  # once only
    nan = DivergenceWatch(cfg, num_classes=10)
    assert "not finite" in nan.see({"round": 1, "train_loss": float("inf")})
    # A first round that already blew up: above 10 · ln 10 = 23.03.
    assert DivergenceWatch(cfg, 10).see({"round": 1, "train_loss": 23.0}) is None
    assert "uniform" in DivergenceWatch(cfg, 10).see({"round": 1, "train_loss": 23.1})
    # The step above the rule's public default is named first.
    craft = DivergenceWatch(load_config({"aggregator": {"name": "craft",
                                                        "options": {"step": "fixed"}},
                                         "server": {"lr": 1.0}}), 10)
    craft.see({"round": 1, "train_loss": 2.0})
    assert "server.lr=1, above craft's public default 0.1" in craft.see(
        {"round": 2, "train_loss": 30.0})


def _unscaled_arrays():
    """Two classes from columns 0 and 1; column 2, noise in other units (std 1e4,
    mean 5e4): SGD at lr 0.1 on the raw columns blows up in round 1."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(600, 8)).astype(np.float32)
    y = (X[:, 0] + X[:, 1] > 0).astype(np.int64)
    X[:, 2] = X[:, 2] * 1e4 + 5e4
    return from_arrays(X, y)


def test_unscaled_arrays_that_diverge_are_told_of_data_standardize():
    """The divergence warning names the features' scale beside the step sizes (a CSV
    says it when it loads; arrays given in Python were blamed on the learning rate
    alone), and not once data.standardize scales them."""
    cfg = {"seed": 0, "rounds": 2, "data": {"name": "synthetic", "num_clients": 4,
                                            "partition": {"name": "iid"}},
           "model": {"name": "mlp"}, "cohort": {"size": 4},
           "client": {"lr": 0.1, "batch_size": 16}, "checkpoint": {"every": 0}}
    raw = fedloom.run(cfg, data=_unscaled_arrays())
    (msg,) = raw.summary["warnings"]
    assert "likely client.lr=0.1" in msg
    found = re.search(r"; the features look unscaled \(column std from (\S+) to (\S+)\): "
                      r"data\.standardize=true scales each to mean 0, std 1$", msg)
    assert found is not None, msg
    low, high = map(float, found.groups())
    assert 0.5 < low < 2 and 5e3 < high < 2e4  # the unit columns' and column 2's std
    scaled = fedloom.run(cfg, ["data.standardize=true"], data=_unscaled_arrays())
    assert not scaled.summary.get("warnings")


def test_images_and_scaled_columns_get_no_scale_hint():
    cfg = load_config({"server": {"lr": 1.0}})
    scaled = DivergenceWatch(cfg, 10, torch.randn(50, 4))
    assert "unscaled" not in scaled.see({"round": 1, "train_loss": 30.0})
    # pixels (digits: 1×8×8) are not columns: their spread is not a unit mistake
    pixels = torch.randn(50, 1, 8, 8) * torch.logspace(-3, 3, 64).view(1, 1, 8, 8)
    assert "unscaled" not in DivergenceWatch(cfg, 10, pixels).see(
        {"round": 1, "train_loss": 30.0})


def test_exploding_server_lr_is_warned_once_and_in_the_summary(tiny, tmp_path, caplog):
    # Digits, tiny MLP, server.lr = 50: the training loss goes 1.89 → 85 in round 2.
    with caplog.at_level(logging.WARNING, logger="fedloom"):
        res = fedloom.run(tiny, ["server.lr=50"], out=tmp_path / "r")
    hits = [r.getMessage() for r in caplog.records if "training loss" in r.getMessage()]
    assert len(hits) == 1 and "server.lr=50" in hits[0], hits
    assert res.summary["warnings"] == hits
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["warnings"] == hits
    calm = fedloom.run(tiny, ["rounds=2"])
    assert "warnings" not in calm.summary


# ------------------------------------------------------------------ extension
def test_resume_with_more_rounds_equals_the_longer_run(tiny, tmp_path, capsys):
    ref = fedloom.run(tiny, ["rounds=2"])
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny))
    out = tmp_path / "run"
    assert main(["run", str(cfg), "rounds=1", "--out", str(out), "--quiet"]) == 0
    first = json.loads((out / "summary.json").read_text())
    assert first["rounds"] == 1 and first["model_sha256"] != ref.summary["model_sha256"]
    assert main(["run", str(cfg), "rounds=2", "--resume", "--out", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2
    assert summary["model_sha256"] == ref.summary["model_sha256"]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in lines] == [1, 2]
    assert yaml_load((out / "config.yaml").read_text())["rounds"] == 2
    # Shortening, or changing anything else, is refused with one line.
    capsys.readouterr()
    assert main(["run", str(cfg), "rounds=1", "--resume", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "extended, not shortened" in err[0], err
    assert main(["run", str(cfg), "rounds=3", "client.lr=0.2", "--resume", "--out", str(out),
                 "--quiet"]) == 2
    assert "only rounds may change" in capsys.readouterr().err


def test_extension_refused_when_the_schedule_depends_on_the_total(tiny, tmp_path):
    ov = ["client.schedule.name=cosine"]
    fedloom.run(tiny, [*ov, "rounds=1"], out=tmp_path / "r")
    with pytest.raises(ConfigError, match=r"rounds: cannot extend .*=cosine depends on the "
                                          r"total"):
        fedloom.run(tiny, [*ov, "rounds=2"], out=tmp_path / "r", resume=True)
    # The exponential schedule does not: extension equals the longer run.
    exp = ["client.schedule.name=exp", "client.schedule.gamma=0.9"]
    fedloom.run(tiny, [*exp, "rounds=1"], out=tmp_path / "e")
    ext = fedloom.run(tiny, [*exp, "rounds=2"], out=tmp_path / "e", resume=True)
    assert ext.summary["model_sha256"] == fedloom.run(tiny, [*exp, "rounds=2"]).summary[
        "model_sha256"]


# ------------------------------------------------------------------ files, versions
def test_run_files_are_readable_by_the_group(tiny, tmp_path):
    old = os.umask(0o027)
    try:
        fedloom.run(tiny, ROUNDS, out=tmp_path / "r")
    finally:
        os.umask(old)
    paths = [p for p in (tmp_path / "r").rglob("*")]
    assert {p.name for p in paths} >= {"config.yaml", "summary.json", "model.pt",
                                       "metrics.jsonl", "last.pt", "client_acc.json"}
    for p in paths:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o750 if p.is_dir() else 0o640), (p, oct(mode))


def test_summary_records_versions(tiny):
    v = fedloom.run(tiny, ["rounds=1"]).summary["versions"]
    assert v == {"fedloom": fedloom.__version__, "torch": torch.__version__,
                 "numpy": np.__version__, "python": platform.python_version()}


# ------------------------------------------------------------------ command line
def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"fedloom {fedloom.__version__} (torch ")


@pytest.mark.parametrize("argv", [
    ["run", "CFG", "--out", "OUT", "rounds=3", "client.lr=0.2"],
    ["run", "CFG", "rounds=3", "--out", "OUT", "client.lr=0.2"],
    ["run", "--quiet", "CFG", "rounds=3", "--out", "OUT", "client.lr=0.2"],
])
def test_options_and_overrides_come_in_any_order(argv):
    args = build_parser().parse_args(argv)
    assert (args.config, args.out, args.overrides) == ("CFG", "OUT", ["rounds=3", "client.lr=0.2"])


def test_partition_takes_its_overrides_after_its_options():
    args = build_parser().parse_args(["partition", "CFG", "--plot", "p.png", "data.seed=1"])
    assert (args.config, args.plot, args.overrides) == ("CFG", "p.png", ["data.seed=1"])


def test_an_override_after_out_reaches_the_run(tiny, tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny))
    out = tmp_path / "r"
    assert main(["run", str(cfg), "--out", str(out), "rounds=1", "--quiet"]) == 0
    assert json.loads((out / "summary.json").read_text())["rounds"] == 1


def test_help_lists_every_command_and_run_help_every_section(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"run", "sweep", "datasets", "schema"} <= set(sub.choices)
    top = parser.format_help()
    desc = top[top.index("Commands:"):]
    for name in sub.choices:
        assert name in desc, name
    run_help = sub.choices["run"].format_help()
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(hints[f.name]):
            assert f"  {f.name}:" in run_help, f.name
            for g in dataclasses.fields(hints[f.name]):
                assert g.name in run_help, f"{f.name}.{g.name}"
        else:
            assert f.name in run_help


def test_summary_table_without_client_test_splits_prints_a_dash(tiny, tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny))
    assert main(["run", str(cfg), "rounds=1", "data.test_fraction=0", "--out",
                 str(tmp_path / "r"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out
    row = next(line for line in out.splitlines() if line.startswith("client acc mean"))
    assert row.split()[-1] == "–"


def test_datasets_lists_every_registered_dataset(capsys):
    assert main(["datasets"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()[1:]
              if line and not line.startswith(" ")}
    assert "shakespeare" in listed
    assert set(available("dataset")) <= listed


# ------------------------------------------------------------------ schema
def _validator(schema):
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_schema_export_validates_the_shipped_configs(capsys):
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    v = _validator(schema)
    root = Path(__file__).resolve().parents[1] / "configs"
    checked = 0
    for path in sorted(root.rglob("*.yaml")):
        data = yaml_load(path.read_text())
        if "methods" in data:  # a sweep suite, not a config
            continue
        load_config(path)  # what the loader accepts, the schema accepts
        assert not list(v.iter_errors(data)), path
        checked += 1
    assert checked >= 5
    bad = [{"server": {"lr": -1}}, {"server": {"lrr": 1}}, {"rounds": 0},
           {"cohort": {"size": 1.5}}, {"compression": {"feedback": 3}}]
    for data in bad:
        assert list(v.iter_errors(data)), data
        with pytest.raises(ConfigError):
            load_config(data)
    assert not list(v.iter_errors({"server": {"lr": "auto"}, "backend": "vmap"}))


def test_schema_defaults_are_the_dataclass_defaults():
    from fedloom.schema import config_schema

    schema = config_schema()

    def walk(cls, node, path):
        hints = typing.get_type_hints(cls)
        props = node["properties"]
        assert set(props) == {f.name for f in dataclasses.fields(cls)}, path
        inst = cls()
        for f in dataclasses.fields(cls):
            sub = props[f.name]
            if dataclasses.is_dataclass(hints[f.name]):
                sub = next((a for a in sub.get("anyOf", []) if a.get("type") == "object"), sub)
                walk(hints[f.name], sub, f"{path}{f.name}.")
            else:
                assert sub["default"] == getattr(inst, f.name), f"{path}{f.name}"

    walk(Config, schema, "")
