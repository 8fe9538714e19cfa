"""A run's pictures: `fedloom run` writes curves.png and partition.png and names
them (with metrics.csv) under its summary; without matplotlib one line says how
to get them. `make run` installs what draws them."""

from __future__ import annotations

import logging
import re
import sys
import tomllib
from pathlib import Path

import yaml

from conftest import TINY
from fedloom import cli

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, capsys, monkeypatch) -> tuple[int, str, Path]:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "rounds": 2, "checkpoint": {"every": 0}}))
    monkeypatch.chdir(tmp_path)  # paths in the summary are relative to here
    capsys.readouterr()
    rc = cli.main(["run", str(cfg), "--out", "runs/pic", "--quiet"])
    return rc, capsys.readouterr().out, tmp_path / "runs" / "pic"


def test_a_run_draws_its_pictures_and_names_them(tmp_path, capsys, monkeypatch):
    rc, out, run = _run(tmp_path, capsys, monkeypatch)
    assert rc == 0
    for name in ("curves.png", "partition.png"):
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tail = out.rstrip().splitlines()[-3:]
    assert [s.strip() for s in tail] == [
        "runs/pic/curves.png", "runs/pic/partition.png", "runs/pic/metrics.csv"]


def test_without_matplotlib_one_line_says_how_to_get_the_pictures(
        tmp_path, capsys, monkeypatch, caplog):
    # None in sys.modules: `import matplotlib` raises ImportError, as when it is absent.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    caplog.set_level(logging.WARNING, logger="fedloom")
    rc, out, run = _run(tmp_path, capsys, monkeypatch)
    assert rc == 0
    assert not (run / "curves.png").exists() and not (run / "partition.png").exists()
    lines = [r.getMessage() for r in caplog.records if "matplotlib" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "pip install 'fedloom[report]'" in lines[0]
    assert out.rstrip().splitlines()[-1].strip() == "runs/pic/metrics.csv"


def test_make_run_installs_the_extra_that_draws():
    """`make run`'s install step names extras of pyproject.toml, one of which
    brings matplotlib."""
    make = (ROOT / "Makefile").read_text()
    block = make.split("$(VENV)/.run:", 1)[1].split("\n\n", 1)[0]
    extras = re.search(r"-e '\.\[([^\]]*)\]'", block)
    assert extras, block
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pulled = [d for e in extras.group(1).split(",")
              for d in deps["optional-dependencies"][e.strip()]]
    assert any(re.match(r"matplotlib\b", d) for d in pulled), pulled
