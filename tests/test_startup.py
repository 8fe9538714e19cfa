"""Start-up of the command line: as a process of its own, ``fedloom`` imports with
the cyclic collector off and freezes what the imports made; called in a process
(tests, a sweep's worker), it leaves the caller's collector alone."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

PROBE = """
import gc, json, sys
from fedloom.cli import main
sys.argv = ["fedloom", *sys.argv[1:]]
seen = {}
import fedloom.engine.experiment as experiment
build = experiment.Experiment.__init__
def spy(self, *a, **k):  # the collector's state once the run is under way
    seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count())
    build(self, *a, **k)
experiment.Experiment.__init__ = spy
try:
    rc = main()
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count(),
                  "during_run": seen}))
"""


def _probe(*args: str) -> dict:
    res = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                         timeout=300, check=False)
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [("datasets",), ("no-such-command",)])
def test_own_process_freezes_the_imports_and_collects_again(args):
    got = _probe(*args)
    assert got["rc"] == (0 if args == ("datasets",) else 2)
    # collection is back on after start-up, even when argparse exits
    assert got["enabled"] is True and got["frozen"] > 10_000


def test_a_run_trains_with_collection_on_and_torch_frozen(tmp_path):
    got = _probe("run", "configs/quickstart.yaml", "data.name=digits", "data.num_clients=5",
                 "data.partition=iid", "cohort.size=2", "rounds=1", "--quiet",
                 "--out", str(tmp_path / "r"))
    assert got["rc"] == 0
    # the experiment is built after start-up: collection on, torch's objects frozen
    assert got["during_run"]["enabled"] is True and got["during_run"]["frozen"] > 100_000


def test_in_process_call_leaves_the_callers_collector_alone(capsys):
    from fedloom.cli import main

    before = gc.get_freeze_count()
    assert gc.isenabled()
    assert main(["datasets"]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == before
