"""Components given as objects are recorded by import path and options
(fedloom.recorded): the run directory's config.yaml reruns them, a record that
cannot be rebuilt says why in one line, and a server step object never leaves
server.lr claiming a step it did not take."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest
import torch
import yaml

import fedloom
from conftest import TINY
from fedloom import cli
from fedloom.config import ConfigError, config_from_dict, load_config
from fedloom.recorded import UNRECORDED, describe, object_name, rebuild, record, unrecorded
from fedloom.registry import get
from fedloom.server_opt.transforms import chain, heavy_ball, scale

LR = ["server.lr=1.0"]


def _cfg():
    return copy.deepcopy(TINY)


class ScaledMean:
    """A user's own rule, a plain class: the weighted mean of the updates times ``factor``."""

    def __init__(self, factor=1.0, *, clip=None):
        self.factor, self.clip = factor, clip

    def init(self, layout):
        return None

    def __call__(self, updates, weights, state, *, info=None):
        if self.clip is not None:
            updates = updates * (self.clip / updates.norm(dim=1).clamp_min(self.clip))[:, None]
        p = weights.to(updates.dtype) / weights.sum()
        return self.factor * (p[:, None] * updates).sum(0), state, {}


@dataclass(frozen=True)
class Pull:
    """A local-step term of one's own, a dataclass: ``D + mu·(W − W0)``."""

    mu: float = 0.1

    def init(self, W):
        return None

    def update(self, D, state, ctx):
        return D + self.mu * (ctx.W - ctx.W0), state


class Squared(ScaledMean):
    """Keeps its argument changed: ``factor`` is not what the constructor was given."""

    def __init__(self, factor=1.0):
        super().__init__(factor * factor)


class Hidden(ScaledMean):
    """Keeps its argument under another name."""

    def __init__(self, amount=1.0):
        super().__init__()
        self._amount = amount


class Holding(ScaledMean):
    """Holds a tensor: not YAML-safe data."""

    def __init__(self, weights=None):
        super().__init__()
        self.weights = weights


def _run_dir(tmp_path, name="run", overrides=(), **objects):
    out = tmp_path / name
    res = fedloom.run(_cfg(), [*LR, *overrides], out=out, **objects)
    return out, res


def _rerun(tmp_path, run, capsys, name="again"):
    """``fedloom run RUN/config.yaml --out OTHER``: its exit code, its error lines and
    the summary it wrote."""
    capsys.readouterr()
    rc = cli.main(["run", str(run / "config.yaml"), "--out", str(tmp_path / name), "--quiet"])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    summary = tmp_path / name / "summary.json"
    return rc, err, json.loads(summary.read_text()) if summary.exists() else None


def test_a_chain_is_recorded_with_its_options_and_rebuilds_equal():
    c = chain(heavy_ball(0.9), scale(0.5))
    rec = record(c)
    assert rec == {"transforms": [
        {"name": "object fedloom.server_opt.transforms.HeavyBall", "options": {"beta": 0.9}},
        {"name": "object fedloom.transforms.Scale", "options": {"factor": 0.5}}]}
    assert yaml.safe_load(yaml.safe_dump(rec)) == rec and json.loads(json.dumps(rec)) == rec
    assert rebuild(object_name(c), rec, "server.optimizer") == c  # a tuple again, as given
    assert describe(object_name(c), rec) == (
        "Chain(transforms=[HeavyBall(beta=0.9), Scale(factor=0.5)])")


def test_a_plain_class_is_recorded_by_its_constructors_arguments():
    agg = ScaledMean(0.5, clip=2.0)
    rec = record(agg)
    assert rec == {"factor": 0.5, "clip": 2.0}
    again = rebuild(object_name(agg), rec, "aggregator")
    assert type(again) is ScaledMean and (again.factor, again.clip) == (0.5, 2.0)


@pytest.mark.parametrize("obj, why", [
    (Squared(3.0), "rebuilt from the recorded options it holds another factor"),
    (Hidden(2.0), "amount: the object keeps no attribute of that name"),
    (Holding(torch.ones(3)), "weights: a torch.Tensor is not YAML-safe data"),
    (chain(Holding(torch.ones(3))), r"transforms\[0\]: weights: a torch.Tensor"),
], ids=["changed", "hidden", "tensor", "nested"])
def test_what_cannot_be_recorded_is_said_in_the_record(obj, why):
    rec = record(obj)
    assert yaml.safe_load(yaml.safe_dump(rec)) == rec  # still safe data, with the reason
    import re

    assert re.search(why, unrecorded(rec)), unrecorded(rec)
    with pytest.raises(ValueError, match=r"^server\.optimizer: .* cannot be rebuilt from "
                                         r"the record \(.*\); give the object again$"):
        rebuild(object_name(obj), rec, "server.optimizer")


def test_a_class_defined_in_a_function_is_not_rebuildable():
    class Local(ScaledMean):
        pass

    assert "defined inside a function" in record(Local())[UNRECORDED]


def test_the_run_directory_reruns_every_kind_of_object(tmp_path, capsys):
    """Aggregator, server chain, compressor, method, selector and local-step terms,
    all objects: `fedloom run RUN/config.yaml` gives the run's model bit for bit, and
    load_config of that file holds the same records."""
    objects = dict(aggregator=ScaledMean(0.8), server=chain(heavy_ball(0.5), scale(1.0)),
                   compressor=get("compressor", "topk")(ratio=0.2),
                   method=get("method", "ditto")(lam=0.5),
                   selector=get("selector", "power_of_choice")(d=6),
                   transforms=[Pull(0.05)])
    run, res = _run_dir(tmp_path, **objects)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["aggregator"] == {"name": f"object {__name__}.ScaledMean",
                                   "options": {"factor": 0.8, "clip": None}}
    assert saved["client"]["transforms"] == [{"name": f"object {__name__}.Pull",
                                              "options": {"mu": 0.05}}]
    assert saved["compression"]["options"]["ratio"] == 0.2
    assert saved["cohort"]["selection"]["options"] == {"d": 6}
    loaded = load_config(run / "config.yaml")
    for key in ("aggregator", "compression", "client", "cohort"):
        assert fedloom.config.config_to_dict(loaded)[key] == saved[key]
    rc, err, again = _rerun(tmp_path, run, capsys)
    assert rc == 0, err
    assert again["model_sha256"] == res.summary["model_sha256"]


def test_an_edited_record_takes_the_constructors_defaults(tmp_path):
    """A record left with fewer options (edited by hand) rebuilds with the class's
    defaults for the rest, and load_config writes them out."""
    run, res = _run_dir(tmp_path, aggregator=ScaledMean(1.0))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["aggregator"]["options"] = {"factor": 1.0}
    cfg = load_config(saved)
    assert cfg.aggregator.options == {"factor": 1.0, "clip": None}
    assert fedloom.run(cfg).summary["model_sha256"] == res.summary["model_sha256"]


def test_a_record_that_cannot_be_rebuilt_is_one_line(tmp_path, capsys):
    run, _ = _run_dir(tmp_path, aggregator=Hidden(2.0))
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert "amount" in saved["aggregator"]["options"][UNRECORDED]
    rc, err, _ = _rerun(tmp_path, run, capsys)
    assert rc == 2 and len(err) == 1, err
    assert "aggregator: " in err[0] and "cannot be rebuilt" in err[0], err


def test_a_class_that_is_not_importable_is_one_line(tmp_path, capsys):
    run, _ = _run_dir(tmp_path, aggregator=ScaledMean(1.0))
    cfg = run / "config.yaml"
    cfg.write_text(cfg.read_text().replace(f"object {__name__}.ScaledMean",
                                           "object no_such_module_here.ScaledMean"))
    rc, err, _ = _rerun(tmp_path, run, capsys)
    assert rc == 2 and len(err) == 1, err
    assert "aggregator: cannot import no_such_module_here.ScaledMean" in err[0], err
    with pytest.raises(ConfigError, match=r"^aggregator: cannot import"):
        load_config(cfg)
    # read as data (fedloom compare, a sweep's report): nothing is imported, nothing refused
    data = config_from_dict(yaml.safe_load(cfg.read_text()), plugins=False)
    assert data.aggregator.name == "object no_such_module_here.ScaledMean"


def test_an_earlier_record_by_name_alone_is_refused_and_still_resumes(tmp_path, capsys):
    """A run directory of a version that recorded ``object MODULE.CLASS`` alone: a
    rerun from it is refused in one line (its options are unknown), a resume with
    the object given ends on the uninterrupted model, as before."""
    c = chain(heavy_ball(0.5), scale(0.8))
    ov = ["server.lr=0.8", "checkpoint.every=1"]
    ref = fedloom.run(_cfg(), ov, server=c)

    def stop(st, m):
        if st.next_round == 2:
            raise KeyboardInterrupt

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        fedloom.run(_cfg(), ov, server=c, out=out, callbacks=[stop])
    _as_named_alone(out)
    rc, err, _ = _rerun(tmp_path, out, capsys)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("fedloom: error: server.optimizer: fedloom.transforms.Chain: its "
                             "options were not recorded"), err
    res = fedloom.run(_cfg(), ov, server=c, out=out, resume=True)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]


def _as_named_alone(out):
    """``out``'s config.yaml and newest checkpoint as an earlier version wrote them:
    the server chain recorded by name alone."""
    from fedloom.engine.runs.checkpoint import load_checkpoint, save_checkpoint
    from fedloom.engine.runs.directory import CHECKPOINT_FILE

    cfg = yaml.safe_load((out / "config.yaml").read_text())
    cfg["server"]["optimizer"]["options"] = {}
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    ck = load_checkpoint(out / CHECKPOINT_FILE)
    ck["config"]["server"]["optimizer"]["options"] = {}
    save_checkpoint(out / CHECKPOINT_FILE, ck)


def test_a_resume_with_other_options_is_refused(tmp_path):
    """The record holds the options, so another object of the same class is another
    config (it was taken for the same one while only the class was recorded)."""
    def stop(st, m):
        if st.next_round == 2:
            raise KeyboardInterrupt

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        fedloom.run(_cfg(), LR, out=out, callbacks=[stop], aggregator=ScaledMean(0.5))
    with pytest.raises(ConfigError, match=r"aggregator\.options\.factor: 0\.5 → 0\.7"):
        fedloom.run(_cfg(), LR, out=out, resume=True, aggregator=ScaledMean(0.7))


def test_a_server_step_object_is_named_where_server_lr_was(tmp_path, capsys):
    """server.lr does not scale a server step object: the summary has no server_lr
    (it claimed 1.0 where Scale(0.5) stepped) but the step as recorded, and so does
    the closing table."""
    step = chain(heavy_ball(0.9), scale(0.5))
    res = fedloom.run(_cfg(), ["server.lr=0.1"], server=step)
    assert "server_lr" not in res.summary
    assert res.summary["server_step"] == (
        "Chain(transforms=[HeavyBall(beta=0.9), Scale(factor=0.5)])")
    # server.lr's value changes nothing: the step is the chain's
    other = fedloom.run(_cfg(), ["server.lr=0.7"], server=step)
    assert other.summary["model_sha256"] == res.summary["model_sha256"]
    named = fedloom.run(_cfg(), ["server.lr=0.1"])
    assert named.summary["server_lr"] == 0.1 and "server_step" not in named.summary
    from fedloom.runtable import summary_rows as _summary_rows

    rows = dict(_summary_rows(res.summary, load_config(_cfg())))
    assert "server.lr" not in rows
    assert rows["server step"].endswith("Scale(factor=0.5)]) (server.lr not applied)")


def test_the_divergence_warning_does_not_blame_an_unapplied_server_lr():
    from fedloom.engine.objects import Components
    from fedloom.engine.runs.summary import DivergenceWatch

    cfg = Components(server=chain(scale(5.0))).into(load_config(_cfg(), ["server.lr=9.0"]))
    watch = DivergenceWatch(cfg, num_classes=10)
    msg = watch.see({"round": 1, "train_loss": float("nan")})
    assert "server.lr" not in msg.replace("server step", "")
    assert "Chain(transforms=[Scale(factor=5.0)])" in msg


def test_an_aggregator_and_a_server_step_object_need_no_server_lr(tmp_path, capsys):
    """With both given, server.lr is read by nothing: auto is accepted (and stays in
    the record), and the record reruns."""
    run, res = _run_dir(tmp_path, overrides=["server.lr=auto"], aggregator=ScaledMean(1.0),
                        server=chain(scale(1.0)))
    assert yaml.safe_load((run / "config.yaml").read_text())["server"]["lr"] == "auto"
    rc, err, again = _rerun(tmp_path, run, capsys)
    assert rc == 0, err
    assert again["model_sha256"] == res.summary["model_sha256"]
    with pytest.raises(ConfigError, match=r"server\.lr: auto .* give server\.lr"):
        fedloom.run(_cfg(), ["server.lr=auto"], aggregator=ScaledMean(1.0))


class KeptElsewhere:
    """Keeps its argument under another name, and says so in constructor_arguments()."""

    def __init__(self, amount: float = 1.0) -> None:
        self.scaled = amount

    def constructor_arguments(self):
        return {"amount": self.scaled}


@pytest.mark.parametrize("make", [
    lambda: get("feedback", "sapef")(alpha=0.3), lambda: get("feedback", "ef")(),
    lambda: get("feedback", "cser")(period=3, reset_ratio=0.2),
    lambda: get("selector", "oort")(exploration_decay=0.9, round_penalty=3.0),
    lambda: get("aggregator", "hetlora")(), lambda: get("aggregator", "hetlora")(ranks=[2, 4]),
    lambda: get("aggregator", "craft")(step="fixed"),
    lambda: KeptElsewhere(2.5)], ids=["sapef", "ef", "cser", "oort", "hetlora", "hetlora-ranks",
                                      "craft", "own"])
def test_a_class_that_keeps_arguments_otherwise_says_them(make):
    """fedloom's EF/SA-PEF (alpha kept as base_alpha), CSER (the reset's ratio), Oort
    (three shorter names), HetLoRA (no ranks kept as ()) and a class of one's own give
    constructor_arguments(): the record
    is complete and rebuilds an object with the same record."""
    obj = make()
    rec = record(obj)
    assert unrecorded(rec) is None, unrecorded(rec)
    again = rebuild(object_name(obj), rec, "x")
    assert type(again) is type(obj) and record(again) == rec


def test_a_run_given_a_feedback_object_reruns_from_its_record(tmp_path, capsys):
    run, res = _run_dir(tmp_path, "fb", ["compression.name=topk", "compression.options.ratio=0.1"],
                        feedback=get("feedback", "sapef")(alpha=0.3))
    rc, err, again = _rerun(tmp_path, run, capsys)
    assert rc == 0, err
    assert again["model_sha256"] == res.summary["model_sha256"]
