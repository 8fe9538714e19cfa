"""A model and data given in Python are recorded in the run directory
(fedloom.engine.given): `fedloom run RUN/config.yaml` and fedloom.run of that file
give the run's model bit for bit, or refuse in one line naming what is missing and
how to pass it; never another model or other data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import yaml

import fedloom
from fedloom import cli
from fedloom.config import ConfigError
from fedloom.data import from_arrays
from fedloom.engine import given
from fedloom.engine.runs.directory import load_model
from fedloom.recorded import UNRECORDED, WEIGHTS

CFG = {"seed": 5, "rounds": 2, "data": {"num_clients": 4, "partition": {"name": "iid"}},
       "cohort": {"size": 2}, "client": {"lr": 0.1, "batch_size": 16, "epochs": 1},
       "eval": {"every": 1}, "logging": {"plots": False}}

# The user's own module: a network whose constructor keeps its arguments, one that
# keeps one under another name, and a factory function.
NETS = textwrap.dedent('''
    import torch


    class Net(torch.nn.Module):
        def __init__(self, d, hidden=16, k=3):
            super().__init__()
            self.d, self.hidden, self.k = d, hidden, k
            self.body = torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.ReLU(),
                                            torch.nn.Linear(hidden, k))

        def forward(self, x):
            return self.body(x)


    class Hidden(Net):
        def __init__(self, width=16):
            super().__init__(8, width)
            del self.hidden


    def make_net():
        return Net(8, 12)
''')


@pytest.fixture
def nets(tmp_path, monkeypatch):
    """The module ``nets_h5`` in ``tmp_path`` (the folder the reruns start in), imported."""
    (tmp_path / "nets_h5.py").write_text(NETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    import importlib

    sys.modules.pop("nets_h5", None)
    return importlib.import_module("nets_h5")


def _arrays(clients=False):
    rng = np.random.default_rng(0)
    X = rng.normal(size=(160, 8)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 1)
    return from_arrays(X, y, client=np.arange(160) % 4 if clients else None)


def _rerun_cli(run, out, capsys):
    """``fedloom run RUN/config.yaml --out OUT`` in this process: exit code, error lines,
    the summary it wrote (None when it wrote none)."""
    capsys.readouterr()
    rc = cli.main(["run", str(run / "config.yaml"), "--out", str(out), "--quiet"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    summary = out / "summary.json"
    return rc, err, json.loads(summary.read_text()) if summary.exists() else None


def test_a_module_and_arrays_rerun_from_the_record(nets, tmp_path):
    """The module's class, arguments and own weights, and the arrays, are recorded:
    the console command (a new process in the folder of the user's module) and
    fedloom.run of config.yaml give the run's model_sha256; load_model rebuilds it."""
    torch.manual_seed(1)  # the module's own weights are w_0: fedloom keeps them
    net = nets.Net(8, 16)
    run = tmp_path / "run"
    first = fedloom.run(CFG, out=run, model=net, data=_arrays())
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["name"] == "object nets_h5.Net"
    assert saved["model"]["options"] == {"d": 8, "hidden": 16, "k": 3,
                                         WEIGHTS: "run:initial_model.pt"}
    assert saved["data"]["name"] == "npz" and saved["data"]["options"]["path"] == "run:data.npz"
    assert (run / "initial_model.pt").is_file() and (run / "data.npz").is_file()
    again = fedloom.run(run / "config.yaml", out=tmp_path / "again")
    assert again.summary["model_sha256"] == first.summary["model_sha256"]
    # the console command, another process, from the user's folder by a relative path
    p = subprocess.run([sys.executable, "-m", "fedloom.cli", "run", "run/config.yaml",
                        "--out", "cli", "--quiet"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    cli_summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert cli_summary["model_sha256"] == first.summary["model_sha256"]
    loaded = load_model(run)
    assert isinstance(loaded, nets.Net)
    for a, b in zip(loaded.state_dict().values(), first.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
    # the rerun recorded them again in its own directory: it reruns without the first
    again_saved = yaml.safe_load((tmp_path / "again" / "config.yaml").read_text())
    assert {k: again_saved[k] for k in ("model", "data")} == {k: saved[k]
                                                            for k in ("model", "data")}
    shutil.rmtree(run)
    third = fedloom.run(tmp_path / "again" / "config.yaml")
    assert third.summary["model_sha256"] == first.summary["model_sha256"]


def test_a_resume_from_the_record_continues_the_run(nets, tmp_path, capsys):
    """The run's own config.yaml, read again for a resume with more rounds, is the same
    config (its files named run:NAME again), as a resume with the objects given is."""
    run = tmp_path / "run"
    fedloom.run(CFG, out=run, model=nets.Net(8), data=_arrays())
    capsys.readouterr()
    rc = cli.main(["run", str(run / "config.yaml"), "rounds=3", "--out", str(run),
                   "--resume", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    rows = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(r)["round"] for r in rows] == [1, 2, 3]


def test_a_factory_function_is_recorded_by_reference(nets, tmp_path, capsys):
    """The factory is called again as the run called it; the data's client ids (its
    natural split) are kept with its arrays."""
    run = tmp_path / "run"
    first = fedloom.run(CFG, out=run, model=nets.make_net, data=_arrays(clients=True))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["name"] == "object nets_h5:make_net"
    assert saved["model"]["options"] == {}
    rc, err, again = _rerun_cli(run, tmp_path / "again", capsys)
    assert rc == 0, err
    assert again["model_sha256"] == first.summary["model_sha256"]


@pytest.mark.parametrize("make, why", [
    (lambda nets: nets.Hidden(12), "width: the object keeps no attribute"),
    (lambda nets: (lambda: nets.Net(8)), "lambda"),
])
def test_a_model_that_cannot_be_recorded_is_refused_on_a_rerun(nets, tmp_path, capsys,
                                                               make, why):
    """The run itself runs; its config.yaml says why the model is not recorded, and a
    rerun without model= is refused in one line naming it and how to pass it."""
    run = tmp_path / "run"
    fedloom.run(CFG, out=run, model=make(nets), data=_arrays())
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert why in saved["model"]["options"][UNRECORDED]
    rc, err, _ = _rerun_cli(run, tmp_path / "again", capsys)
    assert rc == 2 and len(err) == 1, err
    assert "model: " in err[0] and "model=..." in err[0] and why in err[0], err
    assert not (tmp_path / "again").exists()
    with pytest.raises(ConfigError, match="cannot be rebuilt from the record"):
        fedloom.run(run / "config.yaml")
    # given again, the rerun runs
    assert fedloom.run(run / "config.yaml", model=nets.Net(8)).summary["model_sha256"]


def test_data_over_the_bound_is_refused_naming_the_option(nets, tmp_path, capsys,
                                                          monkeypatch):
    monkeypatch.setattr(given, "RECORD_DATA_BYTES", 1000)
    run, data, net = tmp_path / "run", _arrays(), nets.Net(8)
    first = fedloom.run(CFG, out=run, model=net, data=data)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["data"]["options"]["path"].startswith(UNRECORDED)
    assert not (run / "data.npz").exists()
    rc, err, _ = _rerun_cli(run, tmp_path / "again", capsys)
    assert rc == 2 and len(err) == 1, err
    assert "record_data=True" in err[0] and "data=..." in err[0], err
    again = fedloom.run(run / "config.yaml", data=data)
    assert again.summary["model_sha256"] == first.summary["model_sha256"]
    # record_data=True records it whatever its size
    big = fedloom.run(CFG, out=tmp_path / "big", model=net, data=data, record_data=True)
    assert (tmp_path / "big" / "data.npz").is_file()
    assert big.summary["model_sha256"] == first.summary["model_sha256"]


@pytest.mark.parametrize("damage", ["truncated", "other values"])
def test_a_damaged_data_npz_is_one_line(nets, tmp_path, capsys, damage):
    run = tmp_path / "run"
    fedloom.run(CFG, out=run, model=nets.Net(8), data=_arrays())
    npz = run / "data.npz"
    if damage == "truncated":
        npz.write_bytes(npz.read_bytes()[:300])
    else:
        with np.load(npz) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["X"][0, 0] += 1.0
        np.savez(npz, **arrays)
    rc, err, _ = _rerun_cli(run, tmp_path / "again", capsys)
    assert rc == 2 and len(err) == 1, err
    assert "data.npz" in err[0], err
    assert not (tmp_path / "again").exists()


def _without_options(data: dict) -> dict:
    """A saved data section as an earlier version wrote it: the source's keys flat."""
    return {k: v for k, v in data.items() if k != "options"}


def test_a_run_of_an_earlier_version_given_objects_still_resumes(nets, tmp_path):
    """An earlier version wrote the configured model and data into config.yaml for a
    model and data given in Python: a resume with them given again is not refused."""
    run, net, data = tmp_path / "run", nets.Net(8), _arrays()
    fedloom.run(CFG, out=run, model=net, data=data)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["model"] = {"name": "mlp", "options": {}, "buffers": "average"}
    saved["data"] = {**_without_options(saved["data"]), "name": "mnist", "path": ""}
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    res = fedloom.run(CFG, ["rounds=3"], out=run, resume=True, model=net, data=data)
    assert res.summary["rounds"] == 3


@pytest.mark.parametrize("change, why", [
    ({"test_mask": np.zeros(160, bool)}, "test flags"),
    ({"groups": np.arange(160) % 4}, "natural=False"),
    ({"classes": ["a", "b", "c"]}, "class names"),
    ({"x": torch.zeros(160, 8, dtype=torch.float64)}, "load as other data"),
])
def test_data_that_an_npz_would_change_is_not_recorded(change, why):
    """Only arrays that load back as the same data are kept; the record says why not."""
    import dataclasses

    from fedloom.config import DataConfig

    split, arrays = given._data_record(DataConfig(), dataclasses.replace(_arrays(), **change),
                                       None)
    assert arrays is None and split.options["path"].startswith(UNRECORDED)
    assert why in split.options["path"]


def test_load_model_of_an_unrecorded_module_says_to_pass_it(nets, tmp_path):
    run = tmp_path / "run"
    fedloom.run(CFG, out=run, model=nets.Hidden(12), data=_arrays())
    with pytest.raises(ValueError, match=r"cannot be rebuilt from the record .*; pass it as "
                                         r"load_model\(.*model=\.\.\.\)$"):
        load_model(run)
    assert isinstance(load_model(run, model=nets.Hidden(12)), nets.Hidden)


def test_a_run_directory_of_an_earlier_version_is_not_rerun_on_other_inputs(nets, tmp_path,
                                                                          capsys):
    """An earlier version wrote the configured model and data into config.yaml for ones
    given in Python: a rerun of it without them is refused in one line (model.pt and
    data.json say what the run was given), where it trained the configured ones."""
    run, net, data = tmp_path / "run", nets.Net(8), _arrays()
    fedloom.run(CFG, out=run, model=net, data=data)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["model"] = {"name": "mlp", "options": {}, "buffers": "average"}
    saved["data"] = {**_without_options(saved["data"]), "name": "digits", "path": ""}
    (run / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    rc, err, _ = _rerun_cli(run, tmp_path / "again", capsys)
    assert rc == 2 and len(err) == 1, err
    assert "given its data and model in Python" in err[0] and "model=..." in err[0], err
    with pytest.raises(ConfigError, match=r"given its model in Python.*model=\.\.\.\)$"):
        fedloom.run(run / "config.yaml", data=data)
    # given again, it reruns to the run's model
    again = fedloom.run(run / "config.yaml", model=net, data=data)
    assert again.summary["model_sha256"] == json.loads(
        (run / "summary.json").read_text())["model_sha256"]
