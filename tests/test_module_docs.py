"""Module docstrings stay short, the rest on the pages they name (issue #53, item 7).

A module docstring holds what a reader of the code needs: the summary, the math in
brief, the paper, the public code it was checked against with the result, the
departures one line each, and a pointer to the docs page (``docs/...md``, section)
that holds the rest. Measured as :func:`ast.get_docstring` with ``clean=False``
gives it, its number of lines: at most 25.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fedloom"

MAX_DOCSTRING_LINES = 25

def docstring_lines(source: str) -> int:
    """Lines of the module docstring of ``source`` (0 without one)."""
    doc = ast.get_docstring(ast.parse(source), clean=False)
    return len(doc.splitlines()) if doc else 0


def _measure() -> dict[str, int]:
    """Every module whose docstring is over the threshold, with its length."""
    over = {}
    for p in sorted(SRC.rglob("*.py")):
        if (n := docstring_lines(p.read_text())) > MAX_DOCSTRING_LINES:
            over[p.relative_to(SRC).as_posix()] = n
    return over


def test_no_module_docstring_over_the_threshold() -> None:
    over = _measure()
    assert not over, ("module docstrings over 25 lines (move the rest to the page they "
                      "name): " + ", ".join(f"{k} ({v})" for k, v in over.items()))


def test_the_measure_sees_what_it_measures() -> None:
    """25 lines of text pass and 26 do not; the closing quotes on a line of their
    own and a docstring that is not the module's count nothing (a measure that saw
    nothing would pass every test above)."""
    def module(n: int) -> str:
        body = "\n".join(f"line {i}" for i in range(1, n))
        return f'"""Summary.\n{body}\n"""\n\ndef f():\n    """{body}"""\n'

    assert docstring_lines(module(25)) == 25 <= MAX_DOCSTRING_LINES
    assert docstring_lines(module(26)) == 26 > MAX_DOCSTRING_LINES
    assert docstring_lines('"""One line."""\n') == 1
    assert docstring_lines("x = 1\n") == 0
    assert docstring_lines('import os\n"""Not a docstring."""\n') == 0
