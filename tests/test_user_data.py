"""Your own data and model: arrays, .npz, CSV, validation, user modules."""

import csv
import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml
from torch import nn

import fedloom
from conftest import cli_in_process
from fedloom.config import load_config
from fedloom.data import from_arrays
from fedloom.engine.experiment import Experiment

CFG = {"name": "user", "seed": 1, "rounds": 2, "data": {"num_clients": 6, "partition":
       {"name": "dirichlet", "options": {"alpha": 1.0, "min_samples": 5}}},
       "model": {"name": "mlp", "options": {"hidden": [8]}}, "cohort": {"size": 3},
       "client": {"lr": 0.1, "batch_size": 8}, "checkpoint": {"every": 0}}


def _arrays(n=240, d=5, classes=3, seed=0, clients=None):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 1).astype(np.int64)
    y[:classes] = np.arange(classes)
    c = None if clients is None else rng.integers(0, clients, n)
    return X, y, c


def _write_csv(path, X, y, c=None):
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([f"f{i}" for i in range(X.shape[1])] + ["label"] + (["who"] if c is not None
                                                                        else []))
        for i in range(len(y)):
            w.writerow([repr(float(v)) for v in X[i]] + [int(y[i])] +
                       ([int(c[i])] if c is not None else []))


@pytest.mark.parametrize("natural", [False, True])
def test_arrays_npz_csv_give_the_same_partition_and_model(tmp_path, natural):
    X, y, c = _arrays(clients=4 if natural else None)
    ref = fedloom.run(CFG, data=from_arrays(X, y, client=c))
    np.savez(tmp_path / "d.npz", X=X, y=y, **({"client": c} if natural else {}))
    via_npz = fedloom.run(CFG, ["data.name=npz", f"data.options.path={tmp_path / 'd.npz'}"])
    _write_csv(tmp_path / "d.csv", X, y, c)
    ov = ["data.name=csv", f"data.options.path={tmp_path / 'd.csv'}", "data.options.label=label"]
    if natural:
        ov.append("data.options.client=who")
    via_csv = fedloom.run(CFG, ov)
    assert ref.summary["model_sha256"] == via_npz.summary["model_sha256"] == \
        via_csv.summary["model_sha256"]
    e1 = Experiment.from_config(load_config(CFG), data=from_arrays(X, y, client=c))
    e2 = Experiment.from_config(
        load_config(CFG, ["data.name=npz", f"data.options.path={tmp_path / 'd.npz'}"]))
    assert all(np.array_equal(a, b) for a, b in zip(e1.fed.train, e2.fed.train, strict=True))
    if natural:
        assert e1.fed.num_clients == 4  # one client per id, whatever data.num_clients says
        for k in range(4):
            owner = c[np.concatenate([e1.fed.train[k], e1.fed.test[k]])]
            assert len(set(owner.tolist())) == 1  # a client's samples stay together


def test_global_test_set_and_standardize():
    X, y, _ = _arrays()
    X = X * 10 + 3
    Xt, yt, _ = _arrays(n=50, seed=1)
    exp = Experiment.from_config(load_config(CFG, ["data.standardize=true"]),
                     data=from_arrays(X, y, X_test=Xt, y_test=yt))
    train = np.concatenate(exp.fed.train)
    xs = exp.x[torch.from_numpy(train)].double()
    assert torch.allclose(xs.mean(0), torch.zeros(5, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(xs.std(0, unbiased=False), torch.ones(5, dtype=torch.float64),
                          atol=1e-4)
    assert exp.evaluator.x_test.shape[0] == 50  # the given global test set, standardised alike
    mu = torch.from_numpy(X[train]).double().mean(0)
    sd = torch.from_numpy(X[train]).double().std(0, unbiased=False)
    expected = ((torch.from_numpy(Xt).double() - mu) / sd).float()
    assert torch.allclose(exp.evaluator.x_test, expected, atol=1e-5)


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(5, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def test_user_module_with_norm_layer_gets_layer_groups_and_runs_craft():
    X, y, _ = _arrays()
    layout = fedloom.Layout.from_module(NormNet())
    assert [g.tensors for g in layout.groups] == [
        ("fc1.weight", "fc1.bias", "norm.weight", "norm.bias"), ("fc2.weight", "fc2.bias")]
    res = fedloom.run(CFG, ["aggregator.name=craft", "dtype=float64"],
                      data=from_arrays(X, y), model=NormNet)
    assert res.layout == layout
    assert res.metrics[-1]["craft_max_violation"] < 1e-8
    inst = NormNet()
    w0 = fedloom.Layout.from_module(inst).flatten(inst)
    again = fedloom.run(CFG, ["rounds=1"], data=from_arrays(X, y), model=inst)
    assert torch.equal(fedloom.Layout.from_module(inst).flatten(inst), w0)  # not mutated
    assert again.w.shape == w0.shape


@pytest.mark.parametrize("case,message", [
    ("missing_y", "missing array 'y'"),
    ("length", "X has 240 samples but y has 239"),
    ("float_labels", "labels must be integers"),
    ("negative", "labels must be >= 0"),
    ("nan", "NaN or Inf in sample 7"),
    ("client_len", "client has 10 entries for 240 samples"),
    ("min_samples", "data.min_samples: client 5 has 2 samples"),
])
def test_bad_npz_inputs_exit_2_with_one_line(tmp_path, case, message):
    X, y, _ = _arrays()
    arrays = {"X": X, "y": y}
    if case == "missing_y":
        del arrays["y"]
    elif case == "length":
        arrays["y"] = y[:-1]
    elif case == "float_labels":
        arrays["y"] = y + 0.5
    elif case == "negative":
        arrays["y"] = y - 1
    elif case == "nan":
        arrays["X"] = X.copy()
        arrays["X"][7, 2] = np.nan
    elif case == "client_len":
        arrays["client"] = np.zeros(10, dtype=np.int64)
    elif case == "min_samples":
        cl = np.zeros(240, dtype=np.int64)
        cl[:2] = 5
        arrays["client"] = cl
    np.savez(tmp_path / "bad.npz", **arrays)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    out = tmp_path / "run"
    # the first case as a process (`python -m fedloom.cli`'s exit code), the others
    # through fedloom.cli.main in this process
    run = subprocess.run if case == "missing_y" else cli_in_process
    p = run([sys.executable, "-m", "fedloom.cli", "run", str(cfg), "data.name=npz",
             f"data.options.path={tmp_path / 'bad.npz'}", "data.min_samples=3", "--out", str(out),
             "--quiet"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not out.exists()


def test_bad_inputs_from_python_raise_value_error(tmp_path):
    X, y, _ = _arrays()
    with pytest.raises(ValueError, match="file not found"):
        fedloom.run(CFG, ["data.name=npz", f"data.options.path={tmp_path / 'nope.npz'}"])
    with pytest.raises(ValueError, match="X has 240 samples but y has 10"):
        from_arrays(X, y[:10])
    with pytest.raises(ValueError, match=r"model: outputs shape \(7,\) per sample"):
        fedloom.run(CFG, data=from_arrays(X, y), model=lambda: nn.Linear(5, 7))
    bad = tmp_path / "t.csv"
    bad.write_text("a,label\n1.0,0\nxyz,1\n")
    with pytest.raises(ValueError, match="line 3, column 'a'"):
        fedloom.run(CFG, ["data.name=csv", f"data.options.path={bad}"])
    with pytest.raises(ValueError, match="no label column 'target'"):
        fedloom.run(CFG, ["data.name=csv", f"data.options.path={bad}", "data.options.label=target"])


def test_one_based_labels_are_named_before_the_model_is_checked(tmp_path):
    X, y, _ = _arrays()
    # Labels 1..3 with a model of 3 outputs: the labels are named, not the model.
    with pytest.raises(ValueError) as e:
        fedloom.run(CFG, data=from_arrays(X, y + 1), model=lambda: nn.Linear(5, 3))
    line = str(e.value)
    assert line.startswith("X: y: labels run from 1 to 3 and none is 0") and "\n" not in line
    assert "pass y - 1" in line and "numpy.unique(y, return_inverse=True)" in line
    with pytest.raises(ValueError, match=r"from 1 to 3 .* pass y - 1 \(and y_test\)"):
        from_arrays(X, y + 1, X_test=X[:5], y_test=y[:5] + 1)
    with pytest.raises(ValueError, match=r"labels run from 5 to 7 .*pass y - 5"):
        from_arrays(X, y + 5)
    # A 0 among the test labels is a class index 0; a CSV's integer labels are kept as
    # written (a class per value, the module's rule for tables).
    assert from_arrays(X, y + 1, X_test=X[:5], y_test=y[:5]).num_classes == 4
    p = tmp_path / "one.npz"
    np.savez(p, X=X, y=y + 1)
    with pytest.raises(ValueError, match=f"{p}: y: labels run from 1 to 3"):
        fedloom.run(CFG, ["data.name=npz", f"data.options.path={p}"])
    table = tmp_path / "one.csv"
    _write_csv(table, X, y + 1)
    res = fedloom.run(CFG, ["rounds=1", "data.name=csv", f"data.options.path={table}"])
    assert res.summary["rounds"] == 1


def _write_table(path, header, rows):
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def test_csv_text_ids_and_labels_and_chosen_features(tmp_path):
    """Text client ids and labels are coded 0..K-1 in sorted order (labels.json keeps
    the class names), data.options.features picks columns: the model is the one of the integer
    codes and the chosen columns as arrays."""
    X, y, c = _arrays(clients=4)
    names = np.array(["eel", "cat", "dog"])      # sorted: cat 0, dog 1, eel 2
    sites = np.array(["site_b", "site_a", "site_d", "site_c"])
    header = ["f0", "note", "f1", "f2", "f3", "f4", "kind", "who"]
    rows = [[repr(float(X[i, 0])), f"free text {i}", *[repr(float(v)) for v in X[i, 1:]],
             names[y[i]], sites[c[i]]] for i in range(len(y))]
    path = tmp_path / "d.csv"
    _write_table(path, header, rows)
    ov = ["data.name=csv", f"data.options.path={path}", "data.options.label=kind",
          "data.options.client=who",
          "data.options.features=[f0, f2, f4]"]
    res = fedloom.run(CFG, ov, out=tmp_path / "run")
    assert json.loads((tmp_path / "run" / "labels.json").read_text()) == \
        {"cat": 0, "dog": 1, "eel": 2}
    code_y = np.searchsorted(np.sort(names), names[y])
    code_c = np.searchsorted(np.sort(sites), sites[c])
    ref = fedloom.run(CFG, data=from_arrays(X[:, [0, 2, 4]], code_y, client=code_c))
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    # Integer labels are class indices as they are: no labels.json.
    _write_csv(tmp_path / "n.csv", X, y)
    fedloom.run(CFG, ["data.name=csv", f"data.options.path={tmp_path / 'n.csv'}"],
                out=tmp_path / "n")
    assert not (tmp_path / "n" / "labels.json").exists()


@pytest.mark.parametrize("case,message", [
    ("text_feature", "column 'note': 'free text 0' is not a number; leave the column out"),
    ("unknown_feature", "no feature column 'f9' (data.options.features"),
    ("label_as_feature", "column 'label' is the label or client column"),
    ("float_label", "column 'label': '0.5' is neither a class index nor a class name"),
    ("empty_client", "line 3, column 'who': empty cell"),
    ("short_row", "line 4, column 'label': empty cell (or the line has fewer fields"),
    ("blank_lines", "line 6, column 'f0': 'x' is not a number"),
])
def test_bad_csv_columns_are_one_line_exit_2(tmp_path, case, message, capsys):
    from fedloom.cli import main

    rows = [[f"{i / 10}", f"free text {i}", str(i % 2), f"s{i % 3}"] for i in range(30)]
    features = "[f0]"
    if case == "text_feature":
        features = ""
    elif case == "unknown_feature":
        features = "[f0, f9]"
    elif case == "label_as_feature":
        features = "[f0, label]"
    elif case == "float_label":
        rows[0][2] = "0.5"
    elif case == "empty_client":
        rows[1][3] = ""
    elif case == "short_row":
        rows[2] = rows[2][:2]
    elif case == "blank_lines":  # line numbers count the blank lines
        rows[2][0] = "x"           # line 6: the header, row 0, two blank lines, rows 1, 2
        rows[1:1] = [[], []]
    path = tmp_path / "bad.csv"
    _write_table(path, ["f0", "note", "label", "who"], rows)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    ov = ["data.name=csv", f"data.options.path={path}", "data.options.client=who",
          "data.min_samples=1"]
    if features:
        ov.append(f"data.options.features={features}")
    capsys.readouterr()
    rc = main(["run", str(cfg), *ov, "--out", str(tmp_path / "run"), "--quiet"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2
    assert len(err) == 1 and str(path) in err[0] and message in err[0], err
    assert not (tmp_path / "run").exists()


def test_unscaled_csv_features_get_a_one_line_hint(tmp_path, caplog):
    X, y, _ = _arrays()
    scaled = tmp_path / "s.csv"
    _write_csv(scaled, X, y)
    wide = X.copy()
    wide[:, 3] *= 1000.0                                     # std 1 and ~1000: spread 1e3
    unscaled = tmp_path / "u.csv"
    _write_csv(unscaled, wide, y)
    offset = X.copy()
    offset[:, 1] += 2020.0                                   # |mean| 2020, std 1 (a year)
    shifted = tmp_path / "o.csv"
    _write_csv(shifted, offset, y)

    def hints(path, *extra):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedloom"):
            fedloom.run(CFG, ["rounds=1", "data.name=csv", f"data.options.path={path}", *extra])
        # the load's hint (a run that diverges names the scale in its warning too)
        return [r.getMessage() for r in caplog.records
                if "look unscaled" in r.getMessage() and "training loss" not in r.getMessage()]

    assert hints(scaled) == []
    wide_hint = hints(unscaled)
    assert len(wide_hint) == 1 and str(unscaled) in wide_hint[0]
    assert "data.standardize=true" in wide_hint[0]
    assert "column 'f1' has mean 2.02e+03" in hints(shifted)[0]
    assert hints(unscaled, "data.standardize=true") == []
