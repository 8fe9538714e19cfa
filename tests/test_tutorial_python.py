"""docs/tutorials/python-experiment.md runs as written: its blocks in order, in
one folder that holds the repository's ``configs/``; a block that starts with
``# file: NAME`` is that file of the user's project (written, not executed).
Each part stays within 25 lines of user code (the issue's bound)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "tutorials" / "python-experiment.md"


def _blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(encoding="utf-8"),
                      flags=re.S | re.M)


def _code_lines(block: str) -> int:
    """Lines of code: no blank line, comment or docstring line."""
    n, in_doc = 0, False
    for line in block.splitlines():
        s = line.strip()
        if s.startswith('"""'):
            in_doc = not (s.endswith('"""') and len(s) > 3) and not in_doc
            continue
        if in_doc or not s or s.startswith("#"):
            continue
        n += 1
    return n


def test_each_part_is_at_most_25_lines_of_code():
    blocks = _blocks()
    assert len(blocks) == 6
    for b in blocks:
        assert _code_lines(b) <= 25, b


@pytest.mark.slow
def test_the_page_runs_in_order(tmp_path, monkeypatch, capsys):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # the process backend's and the sweep's workers import mymethods from here
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{ROOT / 'src'}")
    for block in _blocks():
        first = block.splitlines()[0]
        m = re.match(r"# file: (\S+)", first)
        if m:
            (tmp_path / m.group(1)).write_text(block)
            continue
        exec(compile(block, str(PAGE), "exec"), {"__name__": "__tutorial__"})
    out = capsys.readouterr().out
    assert "test accuracy" in out
    assert out.count("acc ") >= 8  # four backends, dense and top-k
    assert (tmp_path / "mine.md").is_file() and "Mine" in (tmp_path / "mine.md").read_text()
    assert re.search(r"^3 train loss", out, flags=re.M)
    sys.modules.pop("mymethods", None)
