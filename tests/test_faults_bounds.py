"""Inputs without bounds (issue #36, item 9): each is refused with one line on stderr
that names the file or field, exit 2 and no traceback, or stays within a stated bound.

- counts in a config (``rounds``, ``data.num_clients``, ``client.batch_size``,
  ``client.steps``, ``eval.every``, …) are at most ``fedloom.config.MAX_COUNT``;
- an integer literal longer than Python's int-parsing limit
  (``sys.get_int_max_str_digits()``) in a config, an override, or a run's
  ``config.yaml``, ``summary.json``, ``metrics.jsonl``;
- CSV tables larger than ``fedloom.data.user.MAX_CSV_BYTES``, wider than
  ``MAX_CSV_COLUMNS``, of more than ``MAX_CSV_CELLS`` cells or whose parse would
  take more memory than is left (checked before parsing), and a parser out of memory;
- ``fedloom compare`` on metrics that are null, a mapping, a string, missing, NaN
  where a count must be finite, JSON nested 100,000 levels deep, or a line longer
  than ``fedloom.bounded.MAX_JSONL_LINE``.

Each case goes through the command line: ``fedloom.cli.main`` in this process (an
exception would fail the test; one case also as a ``python -m fedloom.cli`` process).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import TINY, deadline
from fedloom.cli import main

ROUND = ["rounds=1", "checkpoint.every=0"]
USER = ["data.num_clients=4", "cohort.size=2",
        "data.partition.options.min_samples=5"]  # 200 samples
DIGITS = sys.get_int_max_str_digits() + 700  # past Python's int-parsing limit (4300)


def _one_line(capsys, rc: int) -> str:
    """The one stderr line of a command that must have exited 2."""
    err = [line for line in capsys.readouterr().err.splitlines()
           if line.strip() and not line.startswith("fedloom: device")]
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("fedloom: error: "), err
    assert "Traceback" not in err[0]
    return err[0]


def _run(tmp_path, capsys, *overrides: str, cfg: Path | None = None) -> str:
    if cfg is None:
        cfg = tmp_path / "tiny.yaml"
        cfg.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "new" / "run"
    capsys.readouterr()
    with deadline(30.0):
        rc = main(["run", str(cfg), *overrides, "--out", str(out), "--quiet"])
    line = _one_line(capsys, rc)
    assert not (tmp_path / "new").exists()  # nothing left behind
    return line


# ------------------------------------------------------------------ config counts
@pytest.mark.parametrize("override", [
    "rounds=1000000000000", f"rounds={2**63}", f"data.num_clients={2**63}",
    "client.batch_size=1000000000000", "client.steps=1000000000000",
    f"client.epochs={2**63}", f"eval.every={2**63}", "eval.batch_size=1000000000000",
    f"checkpoint.every={2**63}", "eval.finetune_steps=1000000000000",
])
def test_a_count_above_the_bound_is_one_line_naming_the_field(tmp_path, capsys, override):
    from fedloom.config import MAX_COUNT

    key, value = override.split("=")
    line = _run(tmp_path, capsys, override, *(o for o in ROUND if not o.startswith(key)))
    assert line.startswith(f"fedloom: error: {key}: must be <= {MAX_COUNT} "), line
    assert value in line


def test_the_bound_itself_is_accepted():
    from fedloom.config import MAX_COUNT, load_config

    cfg = load_config(TINY, [f"rounds={MAX_COUNT}", f"client.steps={MAX_COUNT}",
                             f"eval.every={MAX_COUNT}"])
    assert cfg.rounds == cfg.client.steps == cfg.eval.every == MAX_COUNT


def test_every_integer_field_but_the_seed_has_the_bound_in_the_schema(capsys):
    """``fedloom schema`` states the bound: ``maximum`` of every integer key (but
    ``seed``, an identifier that is hashed) is MAX_COUNT, or a tighter one."""
    from fedloom.config import MAX_COUNT

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    found: list[str] = []

    def walk(node, path):
        if node.get("type") == "integer":
            found.append(path)
            if path != "seed":
                assert node.get("maximum", MAX_COUNT + 1) <= MAX_COUNT, path
            else:
                assert "maximum" not in node
        for key, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{key}" if path else key)
        for sub in node.get("anyOf", []):
            walk(sub, path)
        if isinstance(node.get("items"), dict):
            walk(node["items"], path)

    walk(schema, "")
    assert {"rounds", "data.num_clients", "cohort.size", "client.batch_size", "client.steps",
            "client.epochs", "eval.every", "eval.batch_size"} <= set(found)


# ---------------------------------------------------------- integers past the limit
def test_a_huge_integer_in_the_config_file_names_the_file_and_line(tmp_path, capsys):
    cfg = tmp_path / "big.yaml"
    cfg.write_text(yaml.safe_dump(TINY) + f"# a comment\nseed: {'1' * DIGITS}\n")
    line = _run(tmp_path, capsys, *ROUND, cfg=cfg)
    n = len(yaml.safe_dump(TINY).splitlines()) + 2
    assert line.startswith(f"fedloom: error: {cfg}: an integer of more than "
                           f"{sys.get_int_max_str_digits()} digits (line {n})"), line


def test_a_huge_integer_in_an_override_names_the_override(tmp_path, capsys):
    line = _run(tmp_path, capsys, *ROUND, f"client.epochs={'7' * DIGITS}")
    assert line.startswith("fedloom: error: override client.epochs: an integer of more "
                           "than"), line


def test_an_integer_too_large_for_a_float_field_names_the_field(tmp_path, capsys):
    line = _run(tmp_path, capsys, *ROUND, "client.lr=1" + "0" * 400)  # float(): OverflowError
    assert line.startswith("fedloom: error: client.lr: must be finite, got an integer of "
                           "401 digits"), line


# ------------------------------------------------------------------------- CSV
def _csv(path: Path, n: int = 200) -> Path:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(n, 2))
    y = rng.integers(0, 3, n)
    path.write_text("label,f1,f2\n" + "".join(f"{c},{a:.4f},{b:.4f}\n"
                                               for (a, b), c in zip(X, y, strict=True)))
    return path


def test_a_csv_above_the_size_bound_is_refused_before_parsing(tmp_path, capsys, monkeypatch):
    from fedloom.data import user

    path = _csv(tmp_path / "d.csv")
    size = path.stat().st_size
    monkeypatch.setattr(user, "MAX_CSV_BYTES", size - 1)

    def never(*a, **k):
        raise AssertionError("parsed a file above the bound")

    monkeypatch.setattr("pandas.read_csv", never)
    line = _run(tmp_path, capsys, *ROUND, *USER, "data.name=csv", f"data.options.path={path}")
    assert line.startswith(f"fedloom: error: {path}: {size} bytes, above the bound of "
                           f"{size - 1} bytes for a CSV table"), line


def test_a_csv_header_wider_than_the_bound_is_refused_from_the_header(tmp_path, capsys,
                                                                     monkeypatch):
    """The real bound: a header of MAX_CSV_COLUMNS + 1 names (under a megabyte) is
    enough, and nothing but the header is read (the parser is never called)."""
    from fedloom.data.user import MAX_CSV_COLUMNS

    path = tmp_path / "wide.csv"
    path.write_text("label," + ",".join(f"c{i}" for i in range(MAX_CSV_COLUMNS)) + "\n"
                    + "0," * MAX_CSV_COLUMNS + "1\n")

    def never(*a, **k):
        raise AssertionError("parsed a file above the bound")

    monkeypatch.setattr("pandas.read_csv", never)
    line = _run(tmp_path, capsys, *ROUND, *USER, "data.name=csv", f"data.options.path={path}")
    assert line.startswith(f"fedloom: error: {path}: more than {MAX_CSV_COLUMNS} columns in "
                           "the header"), line


def test_a_quoted_comma_in_the_header_is_not_a_column(monkeypatch):
    from fedloom.data import user

    assert user._header_columns(b'a,"b,c",d\n1,2,3\n', 3) == 3
    assert user._header_columns(b'a,"b,c",d,e\n1,2,3,4\n', 3) == 4
    assert user._header_columns(b'a,b\r\n1,2\r\n', 2) == 2
    assert user._header_columns(b'a,b,c', 2) == 3  # no newline at all
    assert user._header_columns(b'a,b,c,d,e\n', 2) == 3  # counted no further than needed


def test_the_rows_of_a_csv_are_counted_from_its_line_breaks():
    """An upper bound, read in chunks: ``\\n``, ``\\r\\n`` or ``\\r`` alone, a last
    line without one, blank lines (the parser's rows of empty cells)."""
    import io

    from fedloom.data import user

    for text, rows in ((b"a,b\n1,2\n3,4\n", 2), (b"a,b\r\n1,2\r\n3,4", 2),
                       (b"a,b\r1,2\r", 1), (b"a,b\n\n\n", 2), (b"a,b", 0), (b"", 0)):
        assert user._data_rows(io.BytesIO(text)) == rows, text


def _never(*a, **k):
    raise AssertionError("parsed a file above the bound")


def test_a_csv_of_more_cells_than_the_bound_is_refused_before_parsing(tmp_path, capsys,
                                                                     monkeypatch):
    """The issue's shape under both other bounds, 99,999 columns × 1,000 rows (there
    200 MB that took 3.8 GB to parse and aborted in pyarrow under a 3 GiB limit; here
    blank rows, which the parser reads as rows of empty cells): refused from its
    header and line breaks, with the cells, the bound and the memory it would take."""
    from fedloom.data.user import MAX_CSV_CELLS

    path = tmp_path / "d.csv"
    path.write_text("label," + ",".join(f"c{i}" for i in range(99_998)) + "\n" + "\n" * 1000)
    monkeypatch.setattr("pandas.read_csv", _never)
    line = _run(tmp_path, capsys, *ROUND, *USER, "data.name=csv", f"data.options.path={path}")
    assert line.startswith(
        f"fedloom: error: {path}: 99,999 columns × 1,000 rows = 99,999,000 cells, above the "
        f"bound of {MAX_CSV_CELLS:,} cells for a CSV table (fedloom.data.user.MAX_CSV_CELLS: "
        "about 3.6 GB to parse); save the arrays as .npz"), line


def test_a_csv_whose_parse_would_not_fit_in_the_memory_left_is_refused_before_parsing(
        tmp_path, capsys, monkeypatch):
    """Under every bound, but more to parse than the memory left (said here to be
    10 kB): refused before parsing, naming what it takes (not a MemoryError after
    the parse has taken what there was, or an abort inside pyarrow)."""
    from fedloom.data import user

    path = _csv(tmp_path / "d.csv")
    size = path.stat().st_size
    monkeypatch.setattr(user, "available_memory", lambda: 10_000)
    monkeypatch.setattr("pandas.read_csv", _never)
    line = _run(tmp_path, capsys, *ROUND, *USER, "data.name=csv", f"data.options.path={path}")
    assert line.startswith(f"fedloom: error: {path}: not enough memory to read the table: 3 "
                           f"columns × 200 rows ({size} bytes) take about "), line
    assert "to parse and 10000 bytes is available" in line, line


def test_a_csv_parse_out_of_memory_is_one_line(tmp_path, capsys, monkeypatch):
    path = _csv(tmp_path / "d.csv")

    def oom(*a, **k):
        raise MemoryError

    monkeypatch.setattr("pandas.read_csv", oom)
    line = _run(tmp_path, capsys, *ROUND, *USER, "data.name=csv", f"data.options.path={path}")
    assert line.startswith(f"fedloom: error: {path}: not enough memory to read the table"), line


def test_a_wide_header_is_not_listed_whole_in_a_message(tmp_path, capsys):
    path = tmp_path / "wide.csv"
    path.write_text(",".join(f"column_{i}" for i in range(5000)) + "\n"
                    + ",".join("1" for _ in range(5000)) + "\n")
    line = _run(tmp_path, capsys, *ROUND, *USER, "data.name=csv", f"data.options.path={path}")
    assert f"{path}: no label column 'label'" in line
    assert "column_0, column_1" in line and "(5000 in all)" in line
    assert len(line) < 1000, len(line)


# ----------------------------------------------------------------------- compare
def _fake_run(path: Path, *, rows_text: str | None = None, summary_text: str | None = None,
              acc_text: str | None = None, config_text: str | None = None,
              row3: dict | None = None, summary: dict | None = None) -> Path:
    """A finished run's directory (no training); the ``*_text`` arguments replace a
    file's text, ``row3``/``summary`` update its last metrics row / summary."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(config_text if config_text is not None else
                                      yaml.safe_dump({**TINY, "seed": 1}))
    rows = [{"round": r, "test_acc": 0.3 * r, "client_acc_mean": 0.2 * r,
             "client_acc_worst10": 0.1 * r, "uplink_bytes": 10**6,
             "uplink_bytes_total": r * 10**6} for r in range(1, 4)]
    rows[-1].update(row3 or {})
    (path / "metrics.jsonl").write_text(rows_text if rows_text is not None else
                                        "".join(json.dumps(m) + "\n" for m in rows))
    s = {**rows[-1], "seed": 1, "backend": "sequential", **(summary or {})}
    (path / "summary.json").write_text(summary_text if summary_text is not None else
                                       json.dumps(s))
    (path / "client_acc.json").write_text(acc_text if acc_text is not None else
                                          json.dumps({"client_acc": [0.5, None, 0.9]}))
    return path


def _drop(key: str) -> str:
    rows = [{"round": r, "test_acc": 0.3, "uplink_bytes": 10**6, "uplink_bytes_total": r * 10**6}
            for r in range(1, 4)]
    del rows[1][key]
    return "".join(json.dumps(m) + "\n" for m in rows)


DEEP = "[" * 100_000 + "]" * 100_000
LIMIT = sys.get_int_max_str_digits()

# (what the run holds, extra compare arguments, the file, what the line must then say)
COMPARE_CASES = {
    "row_null": (dict(row3={"test_acc": None}), [], "metrics.jsonl",
                 "line 3, field 'test_acc': must be a number, got null"),
    "row_dict": (dict(row3={"test_acc": {"a": 1}}), [], "metrics.jsonl",
                 "line 3, field 'test_acc': must be a number, got a mapping"),
    "row_string": (dict(row3={"test_acc": "0.9"}), [], "metrics.jsonl",
                   "line 3, field 'test_acc': must be a number, got the string '0.9'"),
    "row_bool": (dict(row3={"density": True}), [], "metrics.jsonl",
                 "line 3, field 'density': must be a number, got true"),
    "row_missing_uplink": (dict(rows_text=_drop("uplink_bytes_total")), [], "metrics.jsonl",
                           "line 2, field 'uplink_bytes_total': missing"),
    "row_missing_round": (dict(rows_text=_drop("round")), [], "metrics.jsonl",
                          "line 2, field 'round': missing"),
    "row_nan_round": (dict(row3={"round": float("nan")}), [], "metrics.jsonl",
                      "line 3, field 'round': must be an integer >= 1, got NaN"),
    "row_nan_uplink": (dict(row3={"uplink_bytes": float("nan")}), [], "metrics.jsonl",
                       "line 3, field 'uplink_bytes': must be a finite number >= 0, got NaN"),
    "row_huge_uplink": (dict(row3={"uplink_bytes_total": 10**400}), [], "metrics.jsonl",
                        "line 3, field 'uplink_bytes_total': must be a finite number >= 0, "
                        "got an integer of 401 digits"),
    "row_metric_string": (dict(row3={"train_loss": "low"}, summary={"train_loss": 0.5}),
                          ["--metric", "train_loss"],
                          "metrics.jsonl", "line 3, field 'train_loss': must be a number, "
                                           "got the string 'low'"),
    "summary_null": (dict(summary={"test_acc": None}), [], "summary.json",
                     "field 'test_acc': must be a number, got null"),
    "summary_dict": (dict(summary={"client_acc_mean": {"x": 1}}), [], "summary.json",
                     "field 'client_acc_mean': must be a number, got a mapping"),
    "summary_string_target": (dict(summary={"test_acc": "high"}),
                              ["--metric", "client_acc_mean", "--target", "0.5"],
                              "summary.json", "field 'test_acc': must be a number, got the "
                                              "string 'high'"),
    "summary_not_object": (dict(summary_text="[1, 2]"), [], "summary.json",
                           "must hold a JSON object, got a list"),
    "acc_string": (dict(acc_text='{"client_acc": [0.5, "x"]}'), [], "client_acc.json",
                   "field 'client_acc[1]': must be a number or null, got the string 'x'"),
    "acc_not_list": (dict(acc_text='{"client_acc": 0.5}'), [], "client_acc.json",
                     "field 'client_acc': must be a list of numbers, got 0.5"),
    "summary_deep": (dict(summary_text=DEEP), [], "summary.json",
                     "not valid JSON (nested too deeply)"),
    "acc_deep": (dict(acc_text='{"client_acc": ' + DEEP + "}"), [], "client_acc.json",
                 "not valid JSON (nested too deeply)"),
    "row_deep": (dict(rows_text='{"round": 1, "x": ' + DEEP + "}\n"
                      + '{"round": 2, "uplink_bytes": 1, "uplink_bytes_total": 1}\n'), [],
                 "metrics.jsonl", "line 1 is not valid JSON (nested too deeply)"),
    "summary_digits": (dict(summary_text='{"test_acc": ' + "1" * DIGITS + "}"), [],
                       "summary.json", f"not valid JSON (an integer of more than {LIMIT} "
                                       "digits)"),
    "row_digits": (dict(rows_text='{"round": ' + "2" * DIGITS + "}\n{}\n"), [],
                   "metrics.jsonl", f"line 1 is not valid JSON (an integer of more than "
                                    f"{LIMIT} digits)"),
    "config_digits": (dict(config_text=f"seed: {'3' * DIGITS}\n"), [], "config.yaml",
                      f"an integer of more than {LIMIT} digits (line 1)"),
}


@pytest.mark.parametrize("case", list(COMPARE_CASES))
def test_compare_refuses_malformed_metrics_naming_the_file_and_field(tmp_path, capsys, case):
    spec, args, file, says = COMPARE_CASES[case]
    run = _fake_run(tmp_path / "runs" / "a", **spec)
    capsys.readouterr()
    with deadline(30.0):
        rc = main(["compare", str(run), *args])
    line = _one_line(capsys, rc)
    assert line.startswith(f"fedloom: error: {run / file}: {says}"), line
    assert len(line) < 300, len(line)


def test_compare_keeps_nan_and_infinite_metrics_as_values(tmp_path, capsys):
    """NaN is what fedloom itself logs for a metric without a value (no client keeps a
    test split; a residual norm without clients) and a diverged loss is infinite:
    both stay readable, NaN shown as "–"."""
    run = _fake_run(tmp_path / "runs" / "a", row3={"test_acc": float("nan"),
                                                   "train_loss": float("inf")},
                    summary={"test_acc": float("nan"), "train_loss": float("inf")})
    assert main(["compare", str(run), "--metric", "test_acc", "train_loss"]) == 0
    out = capsys.readouterr().out
    assert "–" in out and "inf" in out


def _long_line_run(path: Path, size: int) -> Path:
    """A finished run whose metrics.jsonl's line 2 is ``size`` bytes, most of them a
    hole (a sparse file: no disk)."""
    run = _fake_run(path)
    p = run / "metrics.jsonl"
    lines = p.read_bytes().splitlines(keepends=True)
    with open(p, "wb") as f:
        f.write(lines[0] + b'{"round": 2, "x": "')
        f.seek(size, os.SEEK_CUR)
        f.write(b'"}\n' + lines[2])
    return run


def test_compare_a_metrics_line_over_the_bound_is_one_line_read_no_further(tmp_path, capsys):
    """A line of 64 MiB, four times fedloom.bounded.MAX_JSONL_LINE: one line naming the
    file and line, exit 2, and no more than the bound's worth of it read (the peak of
    Python's allocations; the whole file was read and split before)."""
    import tracemalloc

    from fedloom.bounded import MAX_JSONL_LINE

    run = _long_line_run(tmp_path / "runs" / "a", 4 * MAX_JSONL_LINE)
    capsys.readouterr()
    tracemalloc.start()
    try:
        rc = main(["compare", str(run)])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    line = _one_line(capsys, rc)
    assert line == (f"fedloom: error: {run / 'metrics.jsonl'}: line 2 is longer than "
                    f"{MAX_JSONL_LINE:,} bytes, the bound on a metrics line (fedloom.bounded."
                    "MAX_JSONL_LINE): the file is damaged"), line
    assert peak < 3 * MAX_JSONL_LINE, peak


def test_compare_a_1_gib_metrics_line_under_a_3_gib_limit(tmp_path):
    """The issue's 1 GiB line in a process limited to 3 GiB of address space
    (``prlimit --as``): one line, exit 2, no more read than the bound (the file was read
    whole and split: 2 GiB, and a line that parses as JSON was a MemoryError traceback)."""
    run = _long_line_run(tmp_path / "runs" / "a", 2**30)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))

    p = subprocess.run([sys.executable, "-m", "fedloom.cli", "compare", str(run)],
                       capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.splitlines() == [f"fedloom: error: {run / 'metrics.jsonl'}: line 2 is "
                                     "longer than 16,777,216 bytes, the bound on a metrics "
                                     "line (fedloom.bounded.MAX_JSONL_LINE): the file is "
                                     "damaged"], p.stderr[-3000:]


def test_compare_deep_json_as_a_process_prints_only_the_error(tmp_path):
    """The issue's 100,000-deep JSON in a real process: one line, exit 2."""
    run = _fake_run(tmp_path / "runs" / "a", summary_text=DEEP)
    p = subprocess.run([sys.executable, "-m", "fedloom.cli", "compare", str(run)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr
    assert p.stderr.splitlines() == [f"fedloom: error: {run / 'summary.json'}: not valid JSON "
                                     "(nested too deeply)"], p.stderr
