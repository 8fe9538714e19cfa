"""A resume, or a sweep's reuse of a run, on other data than the run was trained on.

The run directory records the fingerprint of its data (``data.json``,
:mod:`fedloom.engine.runs.datarecord`); a resume on other data is refused in one line
naming the data and what changed, exit 2, nothing written, unless the change is
allowed (``--allow-data-change``, ``allow_data_change=True``), which the record then
notes. Fingerprints are compared with ones computed here, never with recorded values.
"""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import fedloom
from conftest import cli_in_process
from fedloom import cli
from fedloom.config import load_config
from fedloom.data import from_arrays, load_dataset
from fedloom.data.fingerprint import fingerprint
from fedloom.engine.runs.checkpoint import RunDirError
from fedloom.engine.runs.datarecord import DATA_FILE, DataChangedError

CFG = {"name": "user", "seed": 1, "rounds": 2,
       "data": {"name": "csv", "options": {"path": "d.csv"}, "num_clients": 6,
                "partition": {"name": "dirichlet", "options": {"alpha": 1.0, "min_samples": 5}}},
       "model": {"name": "mlp", "options": {"hidden": [8]}}, "cohort": {"size": 3},
       "client": {"lr": 0.1, "batch_size": 8}, "checkpoint": {"every": 1},
       "logging": {"plots": False}}


def _arrays(n: int = 600) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 5))
    y = (X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 1).astype(np.int64)
    return X, y


def _write_csv(path: Path, X: np.ndarray, y: np.ndarray) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([f"f{i}" for i in range(X.shape[1])] + ["label"])
        for i in range(len(y)):
            w.writerow([repr(float(v)) for v in X[i]] + [int(y[i])])


def _files(run: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of the run directory, its bytes and mtime; ``.lock`` aside (each run
    writes its pid into it when it takes the lock)."""
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


def _cli(capsys, *args: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = cli.main(["run", "cfg.yaml", *args, "--out", "r", "--quiet"])
    return rc, [x for x in capsys.readouterr().err.splitlines()
                if x.strip() and "device cpu" not in x]


def test_resume_on_a_cut_csv_is_refused_then_allowed_and_noted(tmp_path, monkeypatch, capsys,
                                                               caplog):
    """The reproduction of #52: 2 rounds on a 600-row CSV, the file cut to 300 rows,
    ``--resume`` to 4 rounds: refused (one line naming the file and the sample counts,
    exit 2, nothing written). With ``--allow-data-change`` it runs rounds 3–4 on the
    300 rows and ``data.json`` holds their fingerprint and the change at round 2."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(CFG))
    X, y = _arrays()
    _write_csv(tmp_path / "d.csv", X, y)
    full = (tmp_path / "d.csv").stat().st_size
    assert _cli(capsys)[0] == 0
    first = json.loads((tmp_path / "r" / DATA_FILE).read_text())
    cfg = load_config(CFG)
    assert first == {"fingerprint": fingerprint(load_dataset(cfg.data, cfg.seed), "d.csv",
                                                "d.csv"),
                     "since_round": 0, "changes": []}
    _write_csv(tmp_path / "d.csv", X[:300], y[:300])
    cut = (tmp_path / "d.csv").stat().st_size
    before = _files(tmp_path / "r")
    rc, err = _cli(capsys, "rounds=4", "--resume")
    assert rc == 2 and len(err) == 1, err
    assert err[0] == ("fedloom: error: d.csv: not the data the run in r was trained on: samples "
                      f"300 (was 600); file bytes {cut} (was {full}); resume needs the same data "
                      "(--allow-data-change, or run(..., allow_data_change=True), continues on "
                      "this data and notes it in data.json)")
    assert _files(tmp_path / "r") == before

    caplog.clear()
    assert _cli(capsys, "rounds=4", "--resume", "--allow-data-change")[0] == 0
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        f"d.csv: the data changed after round 2 (samples 300 (was 600); file bytes {cut} (was "
        f"{full})); rounds from 3 on train on it (allowed; noted in r/data.json)"]
    rec = json.loads((tmp_path / "r" / DATA_FILE).read_text())
    assert rec["fingerprint"] == fingerprint(load_dataset(cfg.data, cfg.seed), "d.csv", "d.csv")
    assert rec["changes"] == [{"round": 2, "what": rec["changes"][0]["what"],
                               "was": first["fingerprint"]}]
    assert [json.loads(x)["round"] for x in (tmp_path / "r" / "metrics.jsonl").open()] == \
        [1, 2, 3, 4]
    # the new data is the run's now: extended on it, nothing to allow, the change kept
    assert _cli(capsys, "rounds=5", "--resume") == (0, [])
    assert json.loads((tmp_path / "r" / DATA_FILE).read_text())["changes"] == rec["changes"]
    # the flag is for a resume only
    assert _cli(capsys, "--allow-data-change")[0] == 2


# The config of a run given its data in Python (data.name names nothing then).
_GIVEN = {k: v for k, v in CFG["data"].items() if k not in ("name", "options")}


def _stop_at_2(st, m):
    if st.next_round == 2:
        raise KeyboardInterrupt


def test_arrays_given_in_python_are_checked_on_resume(tmp_path):
    """Data given to ``fedloom.run(data=...)``: the same arrays resume to the
    uninterrupted run's model; one value changed is refused (``DataChangedError``,
    nothing written), and with ``allow_data_change=True`` continued and noted."""
    X, y = _arrays(240)
    cfg = {**CFG, "data": _GIVEN, "rounds": 4}
    ref = fedloom.run(cfg, data=from_arrays(X, y))
    with pytest.raises(KeyboardInterrupt):
        fedloom.run(cfg, data=from_arrays(X, y), out=tmp_path / "r", callbacks=[_stop_at_2])
    X2 = X.copy()
    X2[17, 3] += 1e-3
    before = _files(tmp_path / "r")
    with pytest.raises(DataChangedError, match=r"^the data given in Python \(run\(data=\.\.\.\)\)"
                                               r": not the data .* other values, same sizes"):
        fedloom.run(cfg, data=from_arrays(X2, y), out=tmp_path / "r", resume=True)
    assert _files(tmp_path / "r") == before
    same = fedloom.run(cfg, data=from_arrays(X, y), out=tmp_path / "r", resume=True)
    assert same.summary["model_sha256"] == ref.summary["model_sha256"]

    with pytest.raises(KeyboardInterrupt):
        fedloom.run(cfg, data=from_arrays(X, y), out=tmp_path / "s", callbacks=[_stop_at_2])
    fedloom.run(cfg, data=from_arrays(X2, y), out=tmp_path / "s", resume=True,
                allow_data_change=True)
    rec = json.loads((tmp_path / "s" / DATA_FILE).read_text())
    src = "the data given in Python (run(data=...))"
    assert rec["fingerprint"] == fingerprint(from_arrays(X2, y), src)
    assert [(c["round"], c["was"]) for c in rec["changes"]] == [
        (2, fingerprint(from_arrays(X, y), src))]


def test_a_run_from_before_the_record_resumes_unchecked(tmp_path, caplog):
    """No ``data.json`` (a run of an older fedloom): the resume is not refused, says so
    and records the data from the round it continues at."""
    X, y = _arrays(240)
    cfg = {**CFG, "data": _GIVEN, "rounds": 4}
    with pytest.raises(KeyboardInterrupt):
        fedloom.run(cfg, data=from_arrays(X, y), out=tmp_path / "r", callbacks=[_stop_at_2])
    (tmp_path / "r" / DATA_FILE).unlink()
    with caplog.at_level(logging.INFO, logger="fedloom"):
        fedloom.run(cfg, data=from_arrays(X[:200], y[:200]), out=tmp_path / "r", resume=True)
    assert any("no record of the data of rounds 1–2" in r.getMessage() for r in caplog.records)
    rec = json.loads((tmp_path / "r" / DATA_FILE).read_text())
    assert rec["since_round"] == 2 and rec["changes"] == []
    # a damaged record is one line naming it, nothing resumed
    (tmp_path / "r" / DATA_FILE).write_text("{")
    with pytest.raises(RunDirError, match=r"data\.json: not UTF-8 JSON: the run's data record "
                                          r"is damaged"):
        fedloom.run({**cfg, "rounds": 5}, data=from_arrays(X[:200], y[:200]),
                    out=tmp_path / "r", resume=True)


def test_a_sweep_refuses_a_finished_run_trained_on_other_data(tmp_path, monkeypatch):
    """A sweep reuses a finished run only if its data is the setting's data now: a CSV
    cut after the run stops the sweep (one line naming the run, the file, what
    changed), nothing run; the CSV as it was, the run is reused."""
    from fedloom.sweep import StaleRunsError, run_suite

    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    cmds: list[list[str]] = []

    def run(cmd, **kw):
        cmds.append(list(cmd))
        return cli_in_process(cmd, **kw)

    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", run)
    X, y = _arrays()
    data = tmp_path / "d.csv"
    _write_csv(data, X, y)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(
        {**CFG, "rounds": 1, "data": {**CFG["data"], "options": {"path": str(data)}}}))
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({
        "name": "t", "out": str(tmp_path / "runs"), "seeds": [1],
        "settings": {"csv": {"config": str(tmp_path / "cfg.yaml")}},
        "methods": {"FedAvg": []}}, sort_keys=False))
    run_suite(suite, workers=1, log=lambda s: None)
    assert len(cmds) == 1
    _write_csv(data, X[:300], y[:300])
    cmds.clear()
    with pytest.raises(StaleRunsError, match=r"^1 finished runs were trained on other data than "
                                             rf"their setting names now \(first: .*seed1: {data}: "
                                             r"samples 300 \(was 600\)"):
        run_suite(suite, workers=1, log=lambda s: None)
    assert not cmds
    _write_csv(data, X, y)
    said: list[str] = []
    run_suite(suite, workers=1, log=said.append)
    assert not cmds and any("0 of 1 runs to do" in s for s in said), said


def test_the_fingerprint_is_of_the_values_not_their_layout(monkeypatch):
    """A strided tensor (a text source's windows) hashes as its contiguous copy, chunk
    by chunk, on one thread or several; one value, one label, one client id or the
    order of two rows changed is other data."""
    import fedloom.data.fingerprint as fpm

    X, y = _arrays(64)
    c = np.arange(64) % 4
    ds = from_arrays(X, y, client=c)
    fp = fingerprint(ds, "a")
    monkeypatch.setattr(fpm, "_CHUNK_BYTES", 40)  # two rows of X a chunk, five ids
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fingerprint(ds, "a")
        torch.set_num_threads(max(2, threads))
        assert fingerprint(ds, "a") == one
    finally:
        torch.set_num_threads(threads)
    strided = torch.from_numpy(np.asfortranarray(ds.x.numpy()))
    assert not strided.is_contiguous()
    ds.x = strided
    assert fingerprint(ds, "a") == one
    monkeypatch.undo()
    assert fingerprint(ds, "a") == fp
    y2, c2, X1 = y.copy(), c.copy(), X.copy()
    y2[5] = (y2[5] + 1) % 3
    c2[7] = 9
    X1[3, 4] += 1e-3
    swap = [1, 0, *range(2, 64)]
    for other in (from_arrays(X1, y, client=c), from_arrays(X, y2, client=c),
                  from_arrays(X, y, client=c2), from_arrays(X[swap], y[swap], client=c[swap])):
        assert fingerprint(other, "a")["sha256"] != fp["sha256"]
