"""A run recorded before the accountant could be chosen is read as the accounting it
ran with (RDP, replace-one), so a resume under today's default is refused by name."""

from __future__ import annotations

import copy

import pytest
import yaml

import fedloom
from conftest import TINY
from fedloom.accounting import RECORDED_BEFORE, as_it_ran
from fedloom.config import ConfigError, config_to_dict, load_config
from fedloom.engine.build import resolve_auto
from fedloom.engine.runs.directory import check_run_dir

CENTRAL = ["privacy.mode=central", "rounds=2"]


def test_only_a_private_record_naming_no_accounting_is_pinned():
    old = {"privacy": {"mode": "central", "clip": 1.0}}
    assert as_it_ran(old)["privacy"] == {"mode": "central", "clip": 1.0, **RECORDED_BEFORE}
    assert old == {"privacy": {"mode": "central", "clip": 1.0}}  # the record is not changed
    for record in ({"privacy": {"mode": "none"}}, {"seed": 1},
                   {"privacy": {"mode": "local", "accountant": "pld"}},
                   {"privacy": {"mode": "central", "neighbours": "add_remove"}}):
        assert as_it_ran(record) == record


def _old_record(run_dir):
    # a config.yaml as an earlier version wrote it: no accountant, no neighbours
    path = run_dir / "config.yaml"
    saved = yaml.safe_load(path.read_text())
    for key in RECORDED_BEFORE:
        del saved["privacy"][key]
    path.write_text(yaml.safe_dump(saved))


def test_resuming_an_old_private_run_under_the_new_default_is_refused_by_name(tmp_path):
    out = tmp_path / "run"
    fedloom.run(copy.deepcopy(TINY), CENTRAL, out=out)
    _old_record(out)
    with pytest.raises(ConfigError, match=r"privacy\.accountant: 'rdp' → 'pld'"):
        fedloom.run(copy.deepcopy(TINY), [*CENTRAL[:1], "rounds=3"], out=out, resume=True)
    # the accounting it ran with, named: the record's check passes
    pinned = load_config(copy.deepcopy(TINY), [*CENTRAL, "privacy.accountant=rdp",
                                               "privacy.neighbours=replace_one"])
    check_run_dir(out, config_to_dict(resolve_auto(pinned)), resume=True)
