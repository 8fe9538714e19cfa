"""Sweeps given bad names, bad files, or a second sweep on the same ``out:``.

Every name that becomes part of a path (the suite's name, a setting's, a method's,
an old-style tuned value, a report panel's, a ``fedloom run`` config's ``name``) is
tried with a value that would put a file or folder outside the chosen folder:
either the command refuses it (one line naming the field, exit 2, nothing
written) or the name is encoded into one folder inside it. The "outside" target
always lies inside ``tmp_path`` (``out`` is ``tmp_path/a/out``).

The sweeps' runs go through ``fedloom.cli.main`` in this process
(``conftest.cli_in_process``), except where a real worker process is the point.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import TINY, cli_in_process
from fedloom import cli

CONFIG = {**TINY, "rounds": 1, "checkpoint": {"every": 0}}


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*")}


def _write_suite(tmp_path: Path, **extra) -> Path:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    suite = {"name": "t", "out": str(tmp_path / "a" / "out"),
             "doc": str(tmp_path / "a" / "doc" / "t.md"), "seeds": [1],
             "settings": {"digits": {"config": str(cfg)}}, "methods": {"FedAvg": []}, **extra}
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    return path


def _in_process(monkeypatch) -> None:
    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", cli_in_process)


def _one_line(capsys, *tokens: str) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("fedloom: error: "), err
    for t in tokens:
        assert t in lines[0], lines[0]
    return lines[0]


# (case, suite fields, token the line names, the path outside `out` it would have made)
def _bad_suite_cases(tmp_path: Path) -> list[tuple[str, dict, str, Path]]:
    esc = "../../esc"  # from tmp_path/a/out (or tmp_path/a/doc): tmp_path/esc…
    absolute = str(tmp_path / "abs")
    panel = {"name": esc, "metric": "test_acc", "x": {"digits": 1}, "methods": ["FedAvg"]}
    return [
        ("setting", {"settings": {esc: {"config": "tiny.yaml"}}}, "settings", tmp_path / "esc"),
        ("setting-absolute", {"settings": {absolute: {"config": "tiny.yaml"}}}, "settings",
         tmp_path / "abs"),
        ("method-dotdot", {"methods": {"..": []}}, "methods",
         tmp_path / "a" / "out" / "seed1"),
        ("suite-name", {"name": esc}, "name", tmp_path / "esc.sweep.json"),
        ("suite-name-absolute", {"name": absolute}, "name", tmp_path / "abs.sweep.json"),
        ("panel-name", {"report": {"across": {"panels": [panel]}}}, "panels[0].name",
         tmp_path / "esc.png"),
    ]


@pytest.mark.parametrize("case", ["setting", "setting-absolute", "method-dotdot", "suite-name",
                                  "suite-name-absolute", "panel-name"])
def test_a_name_that_would_leave_the_folder_is_one_line_exit_2_nothing_written(
        tmp_path, monkeypatch, capsys, case):
    _in_process(monkeypatch)
    monkeypatch.chdir(tmp_path)
    _, fields, token, outside = next(c for c in _bad_suite_cases(tmp_path) if c[0] == case)
    path = _write_suite(tmp_path, **fields)
    before = _files(tmp_path)
    assert cli.main(["sweep", str(path), "--workers", "1"]) == 2
    _one_line(capsys, str(path), token, "cannot name a file or folder")
    assert not outside.exists()
    assert _files(tmp_path) == before  # nothing written, inside `out` or anywhere


def test_tuned_values_become_one_encoded_folder_inside_out(tmp_path, monkeypatch, capsys):
    """An old-style ``tune:`` value is part of its run folder's name (``@tune=V``):
    one with ``..`` and ``/``, or an override holding a YAML tag, stays one folder
    under ``out``."""
    _in_process(monkeypatch)
    path = _write_suite(tmp_path, methods={"Named": ["name=$TUNE"]},
                        tune={"Named": {"key": "name", "grid": ["x/../../../esc", "!!str a/b"]}})
    assert cli.main(["sweep", str(path), "--workers", "1"]) == 0, capsys.readouterr().err
    out = tmp_path / "a" / "out"
    assert not (tmp_path / "a" / "esc").exists() and not (tmp_path / "esc").exists()
    folders = sorted(p.name for p in (out / "digits").iterdir())
    assert folders == ["Named", "Named@tune=__str_a_b", "Named@tune=x_.._.._.._esc"]
    for f in folders:
        assert (out / "digits" / f / ("seed0" if "@" in f else "seed1") / "summary.json").exists()


def test_tuning_points_become_one_encoded_folder_inside_out(tmp_path, monkeypatch, capsys):
    """Under ``tuning:``, a point's values are part of its trial folder's name
    (``@tune=KEY=V``): one with ``..`` and ``/`` stays one folder under ``out``."""
    _in_process(monkeypatch)
    path = _write_suite(tmp_path, tuning={"budget": 2, "seeds": [7], "rounds": 1,
                                          "space": {"name": ["x/../../../esc", "!!str a/b"]}})
    assert cli.main(["sweep", str(path), "--workers", "1"]) == 0, capsys.readouterr().err
    out = tmp_path / "a" / "out"
    assert not (tmp_path / "a" / "esc").exists() and not (tmp_path / "esc").exists()
    folders = sorted(p.name for p in (out / "digits").iterdir())
    assert folders == ["FedAvg", "FedAvg@tune=name=__str_a_b", "FedAvg@tune=name=x_.._.._.._esc"]


def test_two_methods_that_would_share_a_folder_are_refused(tmp_path, capsys):
    path = _write_suite(tmp_path, methods={"A (x)": [], "A [x]": []})
    before = _files(tmp_path)
    assert cli.main(["sweep", str(path), "--workers", "1"]) == 2
    _one_line(capsys, "A [x]", "A (x)", "A__x_")
    assert _files(tmp_path) == before


@pytest.mark.parametrize("name, outside", [
    ("../../esc", "esc*"), ("ABS", "abs*"), ("!!str a/b", "a/runs/a"),
    ("!!python/name:os.system", "a/runs/!!python"),
])
def test_run_config_name_cannot_put_the_run_outside_runs(tmp_path, monkeypatch, capsys, name,
                                                         outside):
    """``fedloom run`` without ``--out`` makes ``runs/NAME-TIMESTAMP``: a name with
    ``..``, an absolute one, or an override whose YAML tag makes it a path, is refused."""
    cwd = tmp_path / "a"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    if name == "ABS":
        name = str(tmp_path / "abs")
    before = _files(tmp_path)
    assert cli.main(["run", str(cfg), f"name={name}", "--quiet"]) == 2
    _one_line(capsys, "name", "cannot name a file or folder")
    assert not list(tmp_path.glob(outside)) and not list(cwd.glob("runs/*/*"))
    assert _files(tmp_path) == before


def test_a_suite_that_is_not_valid_yaml_is_one_line_exit_2(tmp_path, capsys):
    path = tmp_path / "suite.yaml"
    path.write_text("name: t\nseeds: [1\nsettings: {}\n")
    assert cli.main(["sweep", str(path)]) == 2
    _one_line(capsys, str(path), "not valid YAML", "line")


def test_a_suite_with_a_python_tag_is_one_line_exit_2_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "marker"
    path = tmp_path / "suite.yaml"
    path.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\n"
                    "seeds: [1]\nsettings: {}\nmethods: {}\n")
    assert cli.main(["sweep", str(path)]) == 2
    _one_line(capsys, str(path), "line 1")
    assert not marker.exists()


def test_a_second_sweep_on_the_same_out_is_refused_and_the_first_completes(
        tmp_path, monkeypatch, capsys):
    """While a sweep runs, another on its ``out:`` (here: started from inside the
    first one's first run) is refused in one line naming the holder; the first
    finishes as if alone."""
    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    path = _write_suite(tmp_path, seeds=[1, 2])
    started: list[bool] = []
    second: list[tuple[int, str]] = []

    def run_and_meanwhile_start_another(cmd, **kw):
        if not started:
            started.append(True)
            capsys.readouterr()
            rc = cli.main(["sweep", str(path), "--workers", "1"])
            second.append((rc, capsys.readouterr().err))
        return cli_in_process(cmd, **kw)

    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", run_and_meanwhile_start_another)
    assert cli.main(["sweep", str(path), "--workers", "1"]) == 0
    (rc, err), = second
    assert rc == 2 and err.count("\n") == 1, err
    assert "in use by another fedloom sweep" in err and "pid" in err
    out = tmp_path / "a" / "out" / "digits" / "FedAvg"
    assert sorted(p.name for p in out.iterdir()) == ["seed1", "seed2"]
    assert all((out / s / "summary.json").exists() for s in ("seed1", "seed2"))
    assert (tmp_path / "a" / "doc" / "t.md").exists()


def test_a_sweep_with_worker_processes_exits_without_warnings(tmp_path):
    """``fedloom sweep`` as a process: its workers end cleanly, so Python's
    resource tracker finds nothing leaked (a worker killed at the end left a
    semaphore and a ``resource_tracker … leaked semaphore`` warning)."""
    path = _write_suite(tmp_path)
    p = subprocess.run([sys.executable, "-m", "fedloom.cli", "sweep", str(path),
                        "--workers", "1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "resource_tracker" not in p.stderr and "leaked" not in p.stderr, p.stderr
    assert not p.stderr.strip(), p.stderr


@pytest.mark.parametrize("damage", ["deep_json", "huge_integer", "a_list"])
def test_a_tuning_trials_damaged_summary_is_one_line(tmp_path, monkeypatch, capsys, damage):
    """A finished tuning trial's summary.json that JSON cannot hold (nesting past
    the parser's stack, an integer past the int-parsing limit) or that is not an
    object: the sweep ends with one line naming the file, no traceback."""
    _in_process(monkeypatch)
    path = _write_suite(tmp_path, tune_seed=0,
                        methods={"FedAvg": ["client.lr=$TUNE"]},
                        tune={"FedAvg": {"key": "client.lr", "grid": [0.1]}})
    assert cli.main(["sweep", str(path), "--workers", "1"]) == 0
    (summary,) = (tmp_path / "a" / "out").rglob("*tune=0.1/seed0/summary.json")
    summary.write_text({"deep_json": "[" * 100_000 + "]" * 100_000,
                        "huge_integer": '{"test_acc": ' + "9" * 5000 + "}",
                        "a_list": "[1]"}[damage])
    capsys.readouterr()
    assert cli.main(["sweep", str(path), "--workers", "1"]) != 0
    _one_line(capsys, str(summary))


@pytest.mark.parametrize("setting", ["t.sweep.json", "sweep.json", "t.tuning.json",
                                     ".fedloom-sweep.lock", "t.md", "t-digits-curves.png"])
def test_a_setting_named_like_the_sweeps_own_file_is_refused(tmp_path, capsys, setting):
    """A setting's folder ``OUT/SETTING`` named as a file the sweep writes there (its
    state file, its tuning record, its lock, the page and its figures when ``doc:``
    is in ``out:``): one line naming the field, exit 2, nothing written. It was an
    ``IsADirectoryError`` traceback that left a ``.tmp``, on every rerun."""
    cfg = tmp_path / "tiny.yaml"
    path = _write_suite(tmp_path, doc=str(tmp_path / "a" / "out" / "t.md"),
                        settings={setting: {"config": str(cfg)}})
    before = _files(tmp_path)
    assert cli.main(["sweep", str(path), "--workers", "1"]) == 2
    _one_line(capsys, str(path), "settings", repr(setting), "reserved")
    assert _files(tmp_path) == before


def test_a_folder_where_the_state_file_goes_is_one_line(tmp_path, monkeypatch, capsys):
    """``OUT/NAME.sweep.json`` a folder (made by hand): one line naming it, exit 2,
    before any run; no temporary file left behind."""
    _in_process(monkeypatch)
    path = _write_suite(tmp_path)
    out = tmp_path / "a" / "out"
    (out / "t.sweep.json").mkdir(parents=True)
    assert cli.main(["sweep", str(path), "--workers", "1"]) == 2
    _one_line(capsys, str(out / "t.sweep.json"), "is a directory")
    assert sorted(p.name for p in out.iterdir()) == [".fedloom-sweep.lock", "t.sweep.json"]


def test_a_run_that_resumed_from_prev_is_printed_and_recorded(tmp_path, monkeypatch, capsys):
    """A stopped run whose ``last.pt`` is damaged resumes from ``prev.pt``: the sweep
    prints the run's line naming it (the run's stderr is otherwise dropped when it
    succeeds) and keeps it in ``OUT/NAME.sweep.json`` (``checkpoint_fallbacks``)."""
    import json

    _in_process(monkeypatch)
    cfg = {**CONFIG, "rounds": 3, "checkpoint": {"every": 1}, "logging": {"plots": False}}
    path = _write_suite(tmp_path)
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    assert cli.main(["sweep", str(path), "--workers", "1"]) == 0
    run = tmp_path / "a" / "out" / "digits" / "FedAvg" / "seed1"
    (run / "summary.json").unlink()  # stopped before its end
    last = run / "checkpoints" / "last.pt"
    data = bytearray(last.read_bytes())
    data[-5] ^= 0xFF
    last.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.main(["sweep", str(path), "--workers", "1"]) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if "resumed from" in x]
    assert len(said) == 1, said
    line = said[0]
    assert "digits/FedAvg/seed1: " in line and str(last) in line
    assert f"resumed from {run / 'checkpoints' / 'prev.pt'} (round 2)" in line
    state = json.loads((tmp_path / "a" / "out" / "t.sweep.json").read_text())
    assert [line.endswith(x) for x in state["checkpoint_fallbacks"]] == [True]
    assert (run / "summary.json").exists()
