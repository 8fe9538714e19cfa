"""The one reader of checkpoints of an earlier layout (fedloom.engine.runs.legacy): the
entries later versions added are filled with the behaviour from before them, a
flat server-optimizer state becomes the chain's tuple, and such a checkpoint
resumes on the uninterrupted model."""

from __future__ import annotations

import copy

import pytest
import torch

import fedloom
from conftest import TINY
from fedloom.engine.runs.checkpoint import load_checkpoint, save_checkpoint
from fedloom.engine.runs.directory import CHECKPOINT_FILE
from fedloom.engine.runs.legacy import Fresh, current_layout

# the entries of a checkpoint that earlier versions did not write
ADDED = ("buffers", "sim_time_s", "privacy_state", "events", "selection_state")


def _fresh(has_buffers: bool = False) -> Fresh:
    return Fresh(has_buffers=has_buffers, opt_state=lambda w: ({"v": torch.zeros_like(w)}, None),
                 privacy_state=lambda: {"clip": 1.0}, selection_state=lambda: {"seen": 0})


def test_the_reader_fills_what_an_earlier_version_lacked():
    old = {"w": torch.zeros(3), "opt_state": {"v": torch.ones(3)}}
    got = current_layout(old, _fresh())
    assert set(old) == {"w", "opt_state"}  # the dict read is left as it was
    assert got["buffers"] == {} and got["sim_time_s"] == 0.0 and got["events"] == {}
    assert got["privacy_state"] == {"clip": 1.0} and got["selection_state"] == {"seen": 0}
    assert torch.equal(got["opt_state"][0]["v"], torch.ones(3)) and got["opt_state"][1] is None
    # a model with buffers has none to start from: None, which the restore refuses
    assert current_layout(old, _fresh(has_buffers=True))["buffers"] is None
    # today's layout passes as it is
    today = {**got, "sim_time_s": 2.5, "selection_state": {"seen": 4}}
    again = current_layout(today, _fresh())
    assert again["sim_time_s"] == 2.5 and again["selection_state"] == {"seen": 4}
    assert again["opt_state"] is today["opt_state"]


def test_a_checkpoint_without_the_later_entries_resumes(tmp_path):
    ov = ["rounds=3", "checkpoint.every=1", "server.optimizer=momentum", "server.lr=0.5"]
    ref = fedloom.run(copy.deepcopy(TINY), ov)
    out = tmp_path / "r"

    def stop(state, metrics):
        if state.next_round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fedloom.run(copy.deepcopy(TINY), ov, out=out, callbacks=[stop])
    ck = load_checkpoint(out / CHECKPOINT_FILE)
    assert ck["buffers"] == {} and not ck["events"] and not ck["privacy_state"]
    for key in ADDED:
        del ck[key]
    v, none = ck["opt_state"]
    assert none is None
    ck["opt_state"] = dict(v)  # one flat mapping, as before the chain's tuple
    save_checkpoint(out / CHECKPOINT_FILE, ck)
    ran: list[int] = []
    res = fedloom.run(copy.deepcopy(TINY), ov, out=out, resume=True,
                      callbacks=[lambda state, metrics: ran.append(metrics["round"])])
    assert ran == [3]  # from round 2's checkpoint, not prev.pt's
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
