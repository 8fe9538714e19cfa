"""Components given as Python objects (fedloom.engine.objects): the same run
as by name, a user's own class in a few lines on every backend, recorded in the
run directory and resumed."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml

import fedloom
from conftest import TINY
from fedloom import cli
from fedloom.config import ConfigError
from fedloom.registry import get

LR = ["server.lr=1.0"]


def _cfg():
    return copy.deepcopy(TINY)


TOPK = ["compression.name=topk", "compression.options={ratio: 0.1}"]


# (kind, the config naming it, the config without it, the object)
@pytest.mark.parametrize("kind, by_name, rest, obj", [
    ("aggregator", ["aggregator.name=craft"], [], lambda: get("aggregator", "craft")()),
    ("server", ["server.optimizer=momentum", "server.optimizer.options.momentum=0.5"], [],
     lambda: get("server_optimizer", "momentum")(lr=1.0, momentum=0.5)),
    ("compressor", TOPK, [], lambda: get("compressor", "topk")(ratio=0.1)),
    ("feedback", [*TOPK, "compression.feedback=sapef"], TOPK,
     lambda: get("feedback", "sapef")()),
    ("method", ["client.method=ditto", "client.method.options={lam: 0.5}"], [],
     lambda: get("method", "ditto")(lam=0.5)),
    ("selector", ["cohort.selection=power_of_choice", "cohort.selection.options={d: 6}"], [],
     lambda: get("selector", "power_of_choice")(d=6)),
], ids=lambda v: v if isinstance(v, str) else "")
def test_an_object_runs_as_its_name_does(kind, by_name, rest, obj):
    """A component given as an object gives the run its name gives, bit for bit."""
    ref = fedloom.run(_cfg(), [*LR, *by_name])
    got = fedloom.run(_cfg(), [*LR, *rest], **{kind: obj()})
    assert got.summary["model_sha256"] == ref.summary["model_sha256"]


class ClippedMean:
    """A user's own rule: the weighted mean of the updates, each clipped to norm 1."""

    def init(self, layout):
        return None

    def __call__(self, updates, weights, state, *, info=None):
        scale = (1.0 / updates.norm(dim=1).clamp_min(1.0))[:, None]
        p = weights.to(updates.dtype) / weights.sum()
        return (p[:, None] * updates * scale).sum(0), state, {"clipped_mean": 1.0}


@pytest.mark.parametrize("backend", ["sequential", "lockstep", "vmap", "process"])
def test_a_users_own_aggregator_on_every_backend(backend):
    """The same object on every client backend: the same model (process workers
    train, the parent aggregates), every round's metric from the rule."""
    ov = [*LR, f"backend.name={backend}", "dtype=float64", "rounds=2"]
    if backend == "process":
        ov.append("backend.options.workers=2")
    res = fedloom.run(_cfg(), ov, aggregator=ClippedMean())
    seq = fedloom.run(_cfg(), [*LR, "dtype=float64", "rounds=2"], aggregator=ClippedMean())
    assert all(m["clipped_mean"] == 1.0 for m in res.metrics)
    if backend != "vmap":  # vmap's gradients round differently; the others are exact
        assert res.summary["model_sha256"] == seq.summary["model_sha256"]
    else:
        assert torch.allclose(res.w, seq.w, atol=1e-9)


def test_server_lr_auto_needs_a_registered_rule():
    with pytest.raises(ConfigError, match=r"server\.lr: auto .* give server\.lr"):
        fedloom.run(_cfg(), [], aggregator=ClippedMean())


def test_the_run_directory_records_the_object_and_resumes(tmp_path, capsys):
    """config.yaml names the object; a resume with an object of that class ends
    on the uninterrupted model; a resume that names another rule is refused."""
    ref = fedloom.run(_cfg(), LR, aggregator=ClippedMean())

    def stop(st, m):
        if st.next_round == 2:
            raise KeyboardInterrupt

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        fedloom.run(_cfg(), LR, out=out, callbacks=[stop], aggregator=ClippedMean())
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["aggregator"] == {"name": f"object {__name__}.ClippedMean", "options": {}}
    res = fedloom.run(_cfg(), LR, out=out, resume=True, aggregator=ClippedMean())
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    assert json.loads((out / "summary.json").read_text())["model_sha256"] == \
        ref.summary["model_sha256"]
    # the command line names a registered rule: another config, refused in one line
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    capsys.readouterr()
    rc = cli.main(["run", str(cfg), *LR, "--out", str(out), "--resume", "--quiet"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 2 and len(err) == 1 and "aggregator.name" in err[0], err


class LowestLoss:
    """A user's own selector in a few lines: the clients with the lowest last reported
    loss (never-seen clients first, by id), no state beyond those losses."""

    def init(self, num_clients):
        return {"loss": [float("-inf")] * num_clients}

    def select(self, r, candidates, size, state, gen):
        order = sorted(candidates.tolist(), key=lambda k: (state["loss"][k], k))
        import numpy as np

        return np.sort(np.array(order[:size], dtype=np.int64)), state

    def observe(self, state, feedback):
        loss = list(state["loss"])
        for k, v in zip(feedback.clients, feedback.losses, strict=True):
            loss[int(k)] = float(v)
        return {"loss": loss}


def test_a_users_own_selector_runs_and_is_recorded(tmp_path):
    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment

    m = TINY["cohort"]["size"]
    exp = Experiment.from_config(load_config(_cfg(), LR), components=fedloom.Components(
        selector=LowestLoss()))
    st = exp.init()
    # nobody has reported: the lowest ids; then the clients not seen yet come first
    assert exp.plan_round(st).cohort.tolist() == list(range(m))
    st, _ = exp.round(st)
    assert exp.plan_round(st).cohort.tolist() == list(range(m, 2 * m))
    exp.close()
    fedloom.run(_cfg(), LR, out=tmp_path / "run", selector=LowestLoss())
    rec = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert rec["cohort"]["selection"]["name"] == f"object {__name__}.LowestLoss"
