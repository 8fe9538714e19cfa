"""CRAFT's default: the rprop step with τ ≤ 100 at server.lr auto = 1.0 (issue 54).

What `aggregator.name=craft` alone means, that the paper's configuration is one option
away (``step: fixed`` gives the old default bit for bit), that the record of a run names
the step it ran, and that a record written before the default moved (no step) is read
as what it ran: step fixed, so a suite that pins ``step: fixed`` reuses its runs and a
resume with the new default is refused rather than switching the step mid-run.
"""

from __future__ import annotations

import copy

import pytest
import yaml

import fedloom
from fedloom.aggregate.base import default_server_lr, recorded_config, resolve_options
from fedloom.aggregate.craft import CRAFT
from fedloom.config import ConfigError, config_to_dict, load_config
from fedloom.engine.build import resolve_auto

# Every CRAFT option at its value before the default moved (step fixed, τ ≤ 10).
OLD_DEFAULTS = {"groups": "layer", "rtol": 1e-6, "sv_floor": 1e-3, "atol": 1e-6,
                "precision": "mixed", "chunk": 1 << 15, "match_reference": False,
                "step": "fixed", "step_up": 1.2, "step_down": 0.5, "step_min": 0.1,
                "step_max": 10.0, "targets": "data", "targets_q": 1.0}


def _tiny(tiny, **aggregator):
    cfg = copy.deepcopy(tiny)
    cfg["aggregator"] = {"name": "craft", **aggregator}
    cfg["checkpoint"] = {"every": 0}
    return cfg


def test_the_default_is_rprop_with_trust_cap_100_at_server_lr_1():
    agg = CRAFT()
    assert (agg.step, agg.step_max) == ("rprop", 100.0)
    assert (agg.step_up, agg.step_down, agg.step_min) == (1.2, 0.5, 0.1)
    assert default_server_lr("craft") == 1.0
    # the public code's configuration is one option away, and match_reference alone is it
    assert default_server_lr("craft", {"step": "fixed"}) == 0.1
    assert CRAFT(match_reference=True).step == "fixed"
    assert CRAFT(match_reference=True, step="rprop").step == "rprop"
    assert CRAFT(step="rprop").step_max == 100.0


def test_a_run_records_the_step_it_ran():
    assert resolve_options("craft") == {"step": "rprop", "step_max": 100.0}
    assert resolve_options("craft", {"step": "fixed"}) == {"step": "fixed"}
    assert resolve_options("craft", {"step": "rprop", "step_max": 10}) == {
        "step": "rprop", "step_max": 10}
    assert resolve_options("craft", {"match_reference": True}) == {
        "match_reference": True, "step": "fixed"}
    assert resolve_options("fedavg", {}) == {}
    assert resolve_options("no-such-rule", {"x": 1}) == {"x": 1}
    cfg = resolve_auto(load_config({"aggregator": {"name": "craft"}}))
    assert cfg.aggregator.options == {"step": "rprop", "step_max": 100.0}
    assert cfg.server.lr == 1.0


def test_a_record_without_a_step_ran_the_old_default():
    """Records written before the default moved name no step: they ran step fixed (and
    rprop without step_max ran τ ≤ 10); a record that names them is read as it is."""
    old = {"aggregator": {"name": "craft", "options": {"precision": "float64"}}}
    assert recorded_config(old)["aggregator"]["options"] == {"precision": "float64",
                                                            "step": "fixed"}
    rprop = {"aggregator": {"name": "craft", "options": {"step": "rprop"}}}
    assert recorded_config(rprop)["aggregator"]["options"] == {"step": "rprop",
                                                              "step_max": 10.0}
    new = config_to_dict(resolve_auto(load_config({"aggregator": {"name": "craft"}})))
    assert recorded_config(new)["aggregator"] == new["aggregator"]
    other = {"aggregator": {"name": "krum", "options": {"f": 1}}}
    assert recorded_config(other) == other


def test_step_fixed_gives_the_old_default_bit_for_bit(tiny):
    """``step: fixed`` at server.lr auto (0.1) equals every old default written out at
    server.lr 0.1; the new default equals rprop τ ≤ 100 written out at server.lr 1.0,
    and is another model."""
    fixed = fedloom.run(_tiny(tiny, options={"step": "fixed"}))
    old = fedloom.run(_tiny(tiny, options=OLD_DEFAULTS), ["server.lr=0.1"])
    assert fixed.summary["server_lr"] == 0.1
    assert fixed.summary["model_sha256"] == old.summary["model_sha256"]
    default = fedloom.run(_tiny(tiny))
    written = fedloom.run(_tiny(tiny, options={**OLD_DEFAULTS, "step": "rprop",
                                               "step_max": 100}), ["server.lr=1.0"])
    assert default.summary["server_lr"] == 1.0
    assert default.summary["model_sha256"] == written.summary["model_sha256"]
    assert default.summary["model_sha256"] != fixed.summary["model_sha256"]


def _old_record(folder, cfg):
    """``folder/config.yaml`` as a run made before the default moved wrote it: the
    resolved config with no step option, server.lr 0.1."""
    saved = config_to_dict(resolve_auto(load_config(cfg)))
    saved["aggregator"]["options"] = {}
    saved["server"]["lr"] = 0.1
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(saved))


def test_the_sweep_reuses_old_runs_where_step_fixed_is_pinned(tmp_path, tiny):
    from fedloom.sweep.running import _stale
    from fedloom.sweep.suite import RunSpec

    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(_tiny(tiny)))
    spec = RunSpec("s", "CRAFT", 3, str(path), ("aggregator.options.step=fixed",),
                   tmp_path / "run")
    _old_record(spec.out, load_config(str(path), ["seed=3"]))
    assert _stale(spec) is None
    # the same old run asked at the new default: another config, never reused
    now = RunSpec("s", "CRAFT", 3, str(path), (), spec.out)
    assert _stale(now) == "aggregator.options.step: fixed → rprop"


def test_resume_of_an_old_run_needs_step_fixed(tmp_path, tiny):
    """A run stopped before the default moved resumes with ``step: fixed`` (what it ran);
    with the new default it is refused, naming the step, never continued at rprop."""
    cfg = _tiny(tiny)
    cfg["checkpoint"] = {"every": 1}
    out = tmp_path / "run"

    def stop(state, metrics):
        if state.next_round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fedloom.run(cfg, ["aggregator.options.step=fixed"], out=out, callbacks=[stop])
    _old_record(out, load_config(cfg, ["aggregator.options.step=fixed"]))
    with pytest.raises(ConfigError, match=r"aggregator\.options\.step: 'fixed' → 'rprop'"):
        fedloom.run(cfg, out=out, resume=True)
    resumed = fedloom.run(cfg, ["aggregator.options.step=fixed"], out=out, resume=True)
    whole = fedloom.run(cfg, ["aggregator.options.step=fixed"])
    assert resumed.summary["model_sha256"] == whole.summary["model_sha256"]


def test_the_flower_benchmark_runs_the_two_defaults():
    """benchmarks/craft_default_flower.py: Flower's FedAvg, CRAFT at the old default
    (step fixed at server_lr 0.1) and at the new one (rprop τ ≤ 100 at 1.0)."""
    import sys
    from pathlib import Path

    pytest.importorskip("flwr")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import craft_default_flower as bench
    finally:
        sys.path.pop(0)
    made = {name: make() for name, make in bench.strategies().items()}
    old, new = made["CRAFT old default (step fixed)"], made["CRAFT new default"]
    assert (old.aggregator.step, old.server.lr) == ("fixed", 0.1)
    assert (new.aggregator.step, new.aggregator.step_max, new.server.lr) == ("rprop", 100.0, 1.0)
    assert type(made["FedAvg (Flower)"]).__module__.startswith("flwr.")
