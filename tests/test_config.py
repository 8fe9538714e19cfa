import subprocess
import sys

import pytest
import yaml

from conftest import cli_in_process
from fedloom.config import Config, ConfigError, apply_overrides, load_config

REQUIRED_KEYS = ["seed", "rounds", "cohort.size", "client.lr", "eval.every", "checkpoint.every",
                 "backend"]


def test_required_keys_exist_and_override():
    cfg = load_config({}, ["seed=7", "rounds=4", "cohort.size=3", "client.lr=0.5",
                           "eval.every=2", "checkpoint.every=0", "backend=sequential"])
    assert (cfg.seed, cfg.rounds, cfg.cohort.size, cfg.client.lr) == (7, 4, 3, 0.5)
    assert (cfg.eval.every, cfg.checkpoint.every, cfg.backend.name) == (2, 0, "sequential")


def test_overrides_parse_yaml_values_and_nest():
    d = apply_overrides({"model": {"name": "mlp"}}, ["model.options.hidden=[8, 4]",
                                                     "client.steps=null",
                                                     "aggregator.options.weighted=false"])
    assert d["model"] == {"name": "mlp", "options": {"hidden": [8, 4]}}
    cfg = load_config(d)
    assert cfg.model.options["hidden"] == [8, 4] and cfg.client.steps is None
    assert cfg.aggregator.options == {"weighted": False}


@pytest.mark.parametrize(
    "override,message",
    [
        ("client.lrr=0.1", "client.lrr: unknown key"),
        ("client.lr=-1", "client.lr: must be > 0, got -1"),
        ("client.lr=fast", "client.lr: must be a number"),
        ("rounds=1.5", "rounds: must be an integer"),
        ("rounds=0", "rounds: must be >= 1"),
        ("data.partition=random", "data.partition.name: unknown partitioner 'random' "
                                       "(available: classes, contiguous, dirichlet, iid, "
                                       "mixed, natural, shards, sizes)"),
        ("compression.feedback=ef3", "compression.feedback.name: unknown feedback 'ef3'"),
        ("compression.adaptive=fl", "compression.adaptive.name: unknown planner 'fl'"),
        ("model.options.hidden=[8, -1]", "model.options.hidden: must be >= 1"),
        ("backend=gpu", "backend.name: unknown backend 'gpu'"),
        ("data.name=imagenet", "data.name: unknown dataset 'imagenet'"),
        ("aggregator.name=nope", "aggregator.name: unknown aggregator"),
        ("cohort.size=1000", "cohort.size: must be <= data.num_clients"),
        ("client=3", "client: must be a mapping"),
        ("nokey", "expected KEY=VALUE"),
        ("client.lr.x=1", "client.lr: must be a number"),
    ],
)
def test_bad_values_name_the_field(override, message):
    with pytest.raises(ConfigError) as e:
        load_config({}, [override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("override,line", [
    ("agregator.name=craft", "agregator: unknown key (did you mean aggregator? expected one of: "),
    ("aggregator.optons.step=rprop",
     "aggregator.optons: unknown key (did you mean options? expected one of: name, options)"),
    ("client.lrr=0.1", "client.lrr: unknown key (did you mean lr? "),
    ("aggregator.name=crafty", "unknown aggregator 'crafty' (did you mean craft? available: "),
    ("server.optimizer={name: adam, options: {beta: 0.9}}",
     "server.optimizer.options.beta: unknown option for server_optimizer 'adam' (did you mean "
     "beta2 or beta1? expected one of: beta1, beta2, eps)"),
])
def test_a_misspelled_key_names_the_closest(override, line):
    with pytest.raises(ConfigError) as e:
        load_config({}, [override])
    assert line in str(e.value) and "\n" not in str(e.value)


def test_a_misspelled_section_in_yaml_names_the_closest(tmp_path):
    p = tmp_path / "exp.yaml"
    p.write_text("agregator:\n  name: craft\nclient:\n  lerning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"^agregator: unknown key \(did you mean aggregator\? "):
        load_config(p)
    p.write_text("aggregator:\n  optons: {}\n")
    with pytest.raises(ConfigError, match=r"^aggregator.optons: unknown key \(did you mean opt"):
        load_config(p)
    # Nothing close: the list alone, as before.
    with pytest.raises(ConfigError, match=r"^zzz: unknown key \(expected one of: aggregator, "):
        load_config({"zzz": 1})
    with pytest.raises(ConfigError, match=r"did you mean quickstart\? shipped: "):
        load_config("quickstrt")


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    good = tmp_path / "exp.yaml"
    good.write_text(yaml.safe_dump({"rounds": 2}))
    assert load_config(good).name == "exp"
    assert isinstance(load_config(Config()), Config)


def _cli(*args, cwd, in_process=False):
    run = cli_in_process if in_process else subprocess.run
    return run([sys.executable, "-m", "fedloom.cli", *args], cwd=cwd,
               capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize(
    "override,field",
    [("client.lr=-0.1", "client.lr"), ("foo=1", "foo"), ("rounds=abc", "rounds"),
     ("aggregator.options.nope=1", "aggregator.options.nope")],
)
def test_cli_bad_config_exits_2_naming_field_and_leaves_no_run_dir(tmp_path, tiny, override,
                                                                   field):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(tiny))
    out = tmp_path / "run"
    # the first case as a process (`python -m fedloom.cli`'s exit code), the others
    # through fedloom.cli.main in this process
    p = _cli("run", str(cfg), override, "--out", str(out), "--quiet", cwd=tmp_path,
             in_process=override != "client.lr=-0.1")
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedloom: error: ") and field in lines[0]
    assert not out.exists()
    assert not (tmp_path / "runs").exists()
