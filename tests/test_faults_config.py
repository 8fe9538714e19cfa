"""Config-loading faults: YAML alias bombs, recursive aliases, deep nesting, empty
files, and CSV cells that are not finite float32 numbers. Each is refused with one
line on stderr and exit 2, within a deadline the test sets itself."""

import csv
import re
import subprocess
import sys
import time
import warnings

import pytest
import yaml

import fedloom.engine.runs.loop  # noqa: F401  (imported before the deadlines start: its import is slow)
from conftest import cli_in_process, deadline
from fedloom import config as fconfig
from fedloom.config import ConfigError, load_config, yaml_load
from fedloom.engine.runs.checkpoint import MARKER_FILE
from fedloom.engine.runs.directory import check_run_dir

CFG = {"name": "faults", "seed": 1, "rounds": 1, "data": {"num_clients": 6, "partition":
       {"name": "dirichlet", "options": {"alpha": 1.0, "min_samples": 5}}},
       "model": {"name": "mlp", "options": {"hidden": [8]}}, "cohort": {"size": 3},
       "client": {"lr": 0.1, "batch_size": 8}, "checkpoint": {"every": 0}}


def bomb(levels: int, width: int = 9, indent: str = "    ") -> str:
    """``levels`` anchors, each a list of ``width`` aliases of the one before:
    ``width ** levels`` leaves once expanded, a few hundred bytes as written."""
    lines = [f"a0: &a0 [{', '.join(['x'] * width)}]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels)]
    return "".join(f"{indent}{line}\n" for line in lines)


def with_attack_options(body: str) -> str:
    return yaml.safe_dump(CFG, sort_keys=False) + "attack:\n  options:\n" + body


def err_lines(p) -> list[str]:
    return [line for line in p.stderr.splitlines()
            if line.strip() and not line.startswith("fedloom: device")]


def test_the_issues_alias_bomb_is_refused_while_loading(tmp_path):
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(with_attack_options(bomb(9)))  # 9 ** 9 = 387,420,489 leaves
    with deadline(5.0), pytest.raises(ConfigError) as e:
        load_config(cfg)
    msg = str(e.value)
    assert msg.startswith(f"{cfg}: ") and "aliases expand to more than" in msg, msg
    assert "(line " in msg and "\n" not in msg
    # the run directory's loader (YAML 1.1 resolvers, as yaml.safe_dump writes) too
    with deadline(5.0), pytest.raises(ConfigError, match="aliases expand to more than"):
        fconfig.safe_load_bounded(cfg.read_text(), str(cfg))


@pytest.mark.parametrize("text,what", [
    ("a: &a [1, *a]\n", "recursive alias"),                 # a list that holds itself
    ("a: &a {b: *a}\n", "recursive alias"),
    # 600 levels: a RecursionError before (PyYAML's composer recurses per level);
    # flow style costs PyYAML's scanner ~n² steps before any node (0.3 s at 600)
    ("a: " + "[" * 600 + "]" * 600 + "\n", "nested more than 100 levels deep"),
    ("o: " + "{k: " * 600 + "1" + "}" * 600 + "\n", "nested more than 100 levels deep"),
    ("".join("  " * i + "k:\n" for i in range(600)) + "  " * 600 + "1\n", "(line 100)"),
])
def test_recursive_aliases_and_deep_nesting_are_one_line(text, what):
    for load in (yaml_load, lambda t: fconfig.safe_load_bounded(t, "given")):
        with deadline(15.0), pytest.raises(ConfigError, match=re.escape(what)) as e:
            load(text)
        assert "\n" not in str(e.value)


def test_aliases_below_the_bound_still_load_and_merge_keys_count():
    # width 9, 4 levels: a0 is 10 nodes (the list, 9 leaves), a1 91, a2 820; the
    # aliases add 9·10 + 9·91 + 9·820 = 8289 nodes, under the bound of 10,000 (one
    # level more adds 9·7381 = 66,429). The values are what yaml.safe_load gives.
    text = "o:\n" + bomb(4, indent="  ")
    assert yaml_load(text) == yaml.safe_load(text)
    assert fconfig.safe_load_bounded(text, "given") == yaml.safe_load(text)
    # the bound exactly: a0 is a list of 99 leaves (100 nodes), aliased 100 times
    # adds 10,000 nodes (kept); one leaf more adds 10,100 (refused)
    def aliased(leaves):
        return f"a0: &a0 [{', '.join(['1'] * leaves)}]\na1: [{', '.join(['*a0'] * 100)}]\n"
    assert len(yaml_load(aliased(99))["a1"]) == 100
    with pytest.raises(ConfigError, match="aliases expand to more than 10000 nodes"):
        yaml_load(aliased(100))
    # a merge key copies the anchored mapping's entries: counted like any alias.
    # base: 60 keys, each an alias of a0 (100 nodes): 6,000 added, 6,061 nodes in all;
    # merging it into x adds 6,061 more, 12,061 in all
    base = aliased(99).split("\n")[0] + "\nbase: &b {" + ", ".join(
        f"k{i}: *a0" for i in range(60)) + "}\n"
    assert len(yaml_load(base)["base"]) == 60
    with pytest.raises(ConfigError, match="aliases expand"):
        yaml_load(base + "x: {<<: *b}\n")
    # shared anchors in the same document as plain, big alias-free content: the
    # bound is on what aliases add, not on the file's own size
    plain = "features:\n" + "".join(f"- c{i}\n" for i in range(12000))
    assert len(yaml_load(plain)["features"]) == 12000


def test_an_override_value_cannot_carry_a_bomb():
    value = "{" + bomb(7, indent="").replace("\n", ", ").rstrip(", ") + "}"
    with deadline(5.0), pytest.raises(ConfigError) as e:
        load_config(CFG, [f"attack.options={value}"])
    assert str(e.value).startswith("override attack.options: ") and "aliases expand" in str(e.value)


def test_bomb_through_the_cli_is_one_line_exit_2(tmp_path):
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(with_attack_options(bomb(9)))
    t0 = time.perf_counter()
    with deadline(10.0):
        p = cli_in_process([sys.executable, "-m", "fedloom.cli", "run", str(cfg),
                            "--out", str(tmp_path / "run"), "--quiet"])
    # a hang guard with room for a busy machine (refused in ~30 ms; the issue: over 60 s)
    assert time.perf_counter() - t0 < 5.0
    assert p.returncode == 2
    err = err_lines(p)
    assert len(err) == 1 and str(cfg) in err[0] and "aliases expand" in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_saved_config_bomb_is_refused_on_resume(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # a run directory (its marker): one that is not is refused before its config is read
    (run_dir / MARKER_FILE).write_text("fedloom run directory\n")
    saved = run_dir / "config.yaml"
    saved.write_text(with_attack_options(bomb(9)))
    with deadline(5.0), pytest.raises(ConfigError) as e:
        check_run_dir(run_dir, yaml.safe_load(cfg.read_text()), resume=True)
    assert str(e.value).startswith(f"{saved}: ") and "aliases expand" in str(e.value)
    # and through the CLI: one line, exit 2 (a smaller bomb: 9 ** 5 leaves, over the
    # bound, so that the code before the fix finished too rather than ran out of memory)
    saved.write_text(with_attack_options(bomb(5)))
    with deadline(15.0):
        p = cli_in_process([sys.executable, "-m", "fedloom.cli", "run", str(cfg),
                            "--out", str(run_dir), "--resume", "--quiet"])
    err = err_lines(p)
    assert p.returncode == 2 and len(err) == 1 and str(saved) in err[0], err
    assert "aliases expand" in err[0]


@pytest.mark.parametrize("text", ["", "\n\n", "# nothing here\n# still nothing\n", "---\n",
                                  "\ufeff# a byte-order mark, then a comment\n", "null\n"])
def test_a_config_file_without_settings_is_refused(tmp_path, text):
    cfg = tmp_path / "empty.yaml"
    cfg.write_bytes(text.encode("utf-8"))
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert str(e.value) == f"{cfg}: the file has no settings (it is empty or holds only comments)"


def test_an_empty_config_file_through_the_cli_does_not_run(tmp_path):
    cfg = tmp_path / "empty.yaml"
    cfg.write_text("# rounds: 3\n")
    with deadline(15.0):
        p = cli_in_process([sys.executable, "-m", "fedloom.cli", "run", str(cfg), "rounds=1",
                            "--out", str(tmp_path / "run"), "--quiet"])
    err = err_lines(p)
    assert p.returncode == 2 and len(err) == 1 and "has no settings" in err[0], err
    assert not (tmp_path / "run").exists()


def _table(path, col, cell):
    rows = [[f"{i / 10}", f"{i / 7}", str(i % 2)] for i in range(30)]
    rows[4][col] = cell  # line 6 of the file: the header, then rows 0 … 4
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["f0", "f1", "label"])
        w.writerows(rows)


@pytest.mark.parametrize("cell,reason", [
    ("inf", "'inf' is not a finite number"),
    ("-Infinity", "'-Infinity' is not a finite number"),
    ("nan", "'nan' is not a finite number"),
    ("1e39", "'1e39' is beyond float32's range"),    # float32 overflows to inf: a cast warning
    ("-1e300", "'-1e300' is beyond float32's range"),  # the std overflowed: an IndexError before
])
def test_csv_cells_that_are_no_float32_number_are_one_line_and_no_warning(tmp_path, cell,
                                                                           reason):
    path = tmp_path / "t.csv"
    _table(path, 0, cell)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    with warnings.catch_warnings(record=True) as seen, deadline(20.0):
        warnings.simplefilter("always")
        p = cli_in_process([sys.executable, "-m", "fedloom.cli", "run", str(cfg),
                            "data.name=csv", f"data.options.path={path}",
                            "data.options.label=label",
                            "--out", str(tmp_path / "run"), "--quiet"])
    assert [str(w.message) for w in seen] == []
    err = err_lines(p)
    assert p.returncode == 2 and len(err) == 1, err
    assert f"{path}: line 6, column 'f0': {reason}" in err[0], err


def test_csv_inf_as_a_process_prints_only_the_error(tmp_path):
    """The issue's case in a real process, where numpy's warnings reach stderr."""
    path = tmp_path / "t.csv"
    _table(path, 1, "inf")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(CFG))
    p = subprocess.run([sys.executable, "-m", "fedloom.cli", "run", str(cfg), "data.name=csv",
                        f"data.options.path={path}", "data.options.label=label", "--out",
                        str(tmp_path / "run"), "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert err_lines(p) == [f"fedloom: error: {path}: line 6, column 'f1': 'inf' is not a "
                            "finite number"], p.stderr


def test_from_arrays_refuses_values_beyond_float32_without_a_warning():
    import numpy as np

    from fedloom.data import from_arrays
    from fedloom.data.user import DataError

    X = np.linspace(-1, 1, 60, dtype=np.float64).reshape(30, 2)
    y = np.arange(30) % 2
    X[3, 1] = 1e39
    with warnings.catch_warnings(record=True) as seen, pytest.raises(DataError) as e:
        warnings.simplefilter("always")
        from_arrays(X, y)
    assert [str(w.message) for w in seen] == []
    assert "beyond float32's range (|x| > 3.403e+38) in sample 3" in str(e.value)
    X[3, 1] = np.finfo(np.float32).max  # the largest float32 is kept, exactly
    assert from_arrays(X, y).x[3, 1].item() == float(np.finfo(np.float32).max)
