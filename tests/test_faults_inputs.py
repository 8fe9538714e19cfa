"""Bad inputs: one line naming the field or file and the reason, exit 2, no run directory.

Each case goes through the command line (``fedloom.cli.main`` in this process;
tests/test_user_data.py has other npz cases, one of them through a ``python -m
fedloom.cli`` subprocess). A case
passes when the command returns 2, writes exactly one stderr line
``fedloom: error: …`` that names the field or file, and leaves neither the run
directory nor a parent it would have created.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

import fedloom
from conftest import TINY
from fedloom.data import DataError, from_arrays
from fedloom.data.user import load_npz

ROUND = ["rounds=1", "checkpoint.every=0"]
USER = ["data.num_clients=4", "cohort.size=2",
        "data.partition.options.min_samples=5"]  # 200 samples


def _arrays(n=200, d=5, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, 3, n)
    return X, y


def _csv_text(X, y, client=None):
    head = "label,f1,f2" + (",who" if client is not None else "") + "\n"
    rows = [f"{c},{a:.4f},{b:.4f}" + (f",{client[i]}" if client is not None else "")
            for i, (a, b, c) in enumerate(zip(X[:, 0], X[:, 1], y, strict=True))]
    return head + "\n".join(rows) + "\n"


def _case(name, tmp_path):
    """``(overrides, config file or None, out dir or None, token the line must name)``."""
    X, y = _arrays()
    npz = tmp_path / "d.npz"
    if name == "randk_count_0":
        return ["compression.name=randk", "compression.options.count=0"], None, None, \
            "compression.options.count"
    if name == "qsgd_levels_2.5":
        return ["compression.name=qsgd", "compression.options.levels=2.5"], None, None, \
            "compression.options.levels"
    if name == "topk_ratio_lots":
        return ["compression.name=topk", "compression.options.ratio=lots"], None, None, \
            "compression.options.ratio"
    if name == "num_clients_5000":  # digits has 1797 samples
        return ["data.num_clients=5000"], None, None, "data.num_clients"
    if name == "empty_npz":
        npz.write_bytes(b"")
    elif name == "truncated_npz":
        np.savez(npz, X=X, y=y)
        npz.write_bytes(npz.read_bytes()[: npz.stat().st_size // 2])
    elif name == "label_1e9_npz":
        y = y.copy()
        y[3] = 10**9  # would size a 10^9-wide output layer
        np.savez(npz, X=X, y=y)
    elif name == "object_array_npz":
        obj = np.empty(len(y), dtype=object)
        obj[:] = [list(r) for r in X]
        np.savez(npz, X=obj, y=y)
    if name.endswith("_npz"):
        return ["data.name=npz", f"data.options.path={npz}"], None, None, str(npz)
    if name == "latin1_csv":
        csv = tmp_path / "d.csv"
        csv.write_bytes(_csv_text(X, y).replace("f1", "caf\xe9", 1).encode("latin-1"))
        return ["data.name=csv", f"data.options.path={csv}"], None, None, str(csv)
    if name == "binary_yaml":
        cfg = tmp_path / "bin.yaml"
        cfg.write_bytes(bytes(range(256)) * 4)
        return [], cfg, None, str(cfg)
    if name == "out_under_file":
        (tmp_path / "file").write_text("x")
        return [], None, tmp_path / "file" / "new" / "run", "--out"
    if name == "out_is_file":
        (tmp_path / "file").write_text("x")
        return [], None, tmp_path / "file", "--out"
    if name == "out_in_proc":  # mkdir fails there even for root, whom access() lets write
        return [], None, Path("/proc/fedloom-no-such-dir/run"), "--out"
    raise AssertionError(name)


CASES = ["randk_count_0", "qsgd_levels_2.5", "topk_ratio_lots", "num_clients_5000",
         "empty_npz", "truncated_npz", "label_1e9_npz", "object_array_npz", "latin1_csv",
         "binary_yaml", "out_under_file", "out_is_file", "out_in_proc"]


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_one_line_exit_2_and_no_run_dir(name, tmp_path, capsys):
    from fedloom.cli import main

    overrides, cfg_file, out, token = _case(name, tmp_path)
    if cfg_file is None:
        cfg_file = tmp_path / "tiny.yaml"
        cfg_file.write_text(yaml.safe_dump(TINY))
    if name == "out_in_proc" and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    out = out if out is not None else tmp_path / "new" / "run"
    capsys.readouterr()
    rc = main(["run", str(cfg_file), *ROUND, *overrides, "--out", str(out), "--quiet"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("fedloom: error: "), err
    assert token in err[0], err
    assert not out.is_dir()
    assert not (tmp_path / "new").exists()  # no parent made for the run either
    assert not list(tmp_path.glob(".fedloom-probe-*"))


def test_utf8_bom_csv_reads_as_without_bom(tmp_path):
    """Excel's "CSV UTF-8" starts with a byte-order mark; it is not part of the first
    column's name, so the label column is found and the model is bit-identical."""
    X, y = _arrays()
    plain, bom = tmp_path / "plain.csv", tmp_path / "bom.csv"
    plain.write_text(_csv_text(X, y), encoding="utf-8")
    bom.write_bytes(b"\xef\xbb\xbf" + _csv_text(X, y).encode())
    a = fedloom.run(TINY, [*ROUND, *USER, "data.name=csv", f"data.options.path={plain}"])
    b = fedloom.run(TINY, [*ROUND, *USER, "data.name=csv", f"data.options.path={bom}"])
    assert a.summary["model_sha256"] == b.summary["model_sha256"]


def test_user_arrays_override_the_configured_source():
    """``run(cfg, data=from_arrays(...))`` ignores ``data.name``: leaving the
    template's ``synthetic`` in place gives the run of ``data.name=npz``, with
    client ids (a natural split; was a partition error) and without."""
    X, y = _arrays()
    for client in (np.arange(len(y)) % 4, None):
        runs = [fedloom.run(TINY, [*ROUND, *USER, f"data.name={n}"],
                            data=from_arrays(X, y, client=client)).summary["model_sha256"]
                for n in ("synthetic", "npz")]
        assert runs[0] == runs[1]


def test_labels_are_class_indices_below_the_sample_count(tmp_path):
    X, y = _arrays()
    y = y.copy()
    y[0] = 200  # 200 samples: 0..199 are possible class indices, 200 is not
    with pytest.raises(DataError, match=r"y: label 200 is not a class index below the "
                                        r"number of samples \(200\)"):
        from_arrays(X, y)
    y[0] = 199
    assert from_arrays(X, y).num_classes == 200  # the largest allowed
    big = np.r_[y[:-1].astype(np.uint64), np.array([2**64 - 1], dtype=np.uint64)]
    with pytest.raises(DataError, match="labels must be class indices, found 18446744073709551615"):
        from_arrays(X, big)  # not wrapped around to -1 by a cast


def test_npz_member_damage_names_the_array(tmp_path):
    """A flipped byte inside a stored member fails its CRC: the line names the array."""
    X, y = _arrays()
    p = tmp_path / "d.npz"
    np.savez(p, X=X, y=y)
    raw = bytearray(p.read_bytes())
    raw[200] ^= 0xFF  # inside X.npy's data (X is the first member, 4 kB)
    p.write_bytes(bytes(raw))
    from fedloom.config import DataConfig

    with pytest.raises(DataError, match=r"array 'X' is unreadable \(BadZipFile"):
        load_npz(DataConfig(name="npz"), 0, path=str(p))
