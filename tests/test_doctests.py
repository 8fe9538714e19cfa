"""The examples in the docstrings run as written (``doctest``).

pytest does not collect doctests here (no ``--doctest-modules``: importing every
module would pull in optional extras), so the modules whose public functions carry
an example are listed and each is run with :func:`doctest.testmod`. A module that
gains an example joins the list.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "fedloom.aggregate.gram",
    "fedloom.compress.coding",
    "fedloom.data.disk.stackoverflow",
    "fedloom.rng",
    "fedloom.names",
    "fedloom.params",
    "fedloom.report.stats",
    "fedloom.report.sweep_tuning",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name}: no example found"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
