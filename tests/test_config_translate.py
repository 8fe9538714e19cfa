"""Configs written the old way (flat option keys, ``*_options`` mappings) load as the
same config written ``{name, options}`` (fedloom.config.translate): every old key, the
shipped configs and suites, overrides in either shape and order, one warning line,
an option given both ways refused, an old run folder recognised by the sweep and an
old checkpoint resumed."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from fedloom import registry
from fedloom.config import (
    ConfigError,
    LoRAConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    yaml_load,
)
from fedloom.config import translate as tr
from fedloom.params import Layout

ROOT = Path(__file__).resolve().parents[1]


@registry.register("planner", "translate_probe")
class _ProbePlanner:
    """A round planner with an option and a key of the old compression section."""

    def __init__(self, horizon: int = 3, alpha: float = 0.85) -> None:
        self.horizon, self.alpha = horizon, alpha

    def plan(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover (never run)
        raise NotImplementedError


@pytest.fixture(autouse=True)
def _fresh_warnings():
    tr._WARNED.clear()  # each test sees its own warning line
    yield
    tr._WARNED.clear()


# (old mapping, new mapping, where the option lands, the value): one row per key of
# the translation table, each with a component that takes it and a value off its default.
ROWS: list[tuple[str, dict[str, Any], dict[str, Any], str, Any]] = [
    *[(f"compression.{k}", {"compression": {"feedback": fb, k: v}},
       {"compression": {"feedback": {"name": fb, "options": {k: v}}}},
       f"compression.feedback.options.{k}", v)
      for k, fb, v in [("alpha", "sapef", 0.5), ("alpha_schedule", "sapef", "residual"),
                       ("alpha_kappa", "sapef", 3.0), ("period", "cser", 2),
                       ("reset_ratio", "cser", 0.3), ("beta", "scafcom", 0.5),
                       ("ef21_mean", "ef21", "sampled"), ("tau", "flare", 0.3),
                       ("tau_decay", "flare", 1.2), ("penalty_steps", "flare", 2),
                       ("penalty", "flare", "l2")]],
    ("compression.feedback_options.OPTION",
     {"compression": {"feedback": "sapef", "feedback_options": {"alpha": 0.4}}},
     {"compression": {"feedback": {"name": "sapef", "options": {"alpha": 0.4}}}},
     "compression.feedback.options.alpha", 0.4),
    ("compression.adaptive_options.OPTION",
     {"compression": {"adaptive": "translate_probe", "adaptive_options": {"horizon": 7}}},
     {"compression": {"adaptive": {"name": "translate_probe", "options": {"horizon": 7}}}},
     "compression.adaptive.options.horizon", 7),
    *[(f"server.{k}", {"server": {"optimizer": opt, k: v}},
       {"server": {"optimizer": {"name": opt, "options": {k: v}}}},
       f"server.optimizer.options.{k}", v)
      for k, opt, v in [("momentum", "momentum", 0.5), ("beta1", "adam", 0.8),
                        ("beta2", "yogi", 0.9), ("eps", "adagrad", 0.01)]],
    *[(f"data.partition.{k}", {"data": {"partition": {"name": part, k: v}}},
       {"data": {"partition": {"name": part, "options": {k: v}}}},
       f"data.partition.options.{k}", v)
      for k, part, v in [("alpha", "dirichlet", 0.3), ("min_samples", "dirichlet", 5),
                         ("shards_per_client", "shards", 3), ("max_tries", "dirichlet", 50),
                         ("min_policy", "dirichlet", "move"), ("balance", "dirichlet", True),
                         ("k", "classes", 3), ("assign", "classes", "round_robin"),
                         ("split", "classes", "dirichlet"),
                         ("distribution", "sizes", "lognormal"), ("exponent", "sizes", 2.0),
                         ("sigma", "sizes", 0.5), ("counts", "sizes", [1.0, 2.0]),
                         ("then", "sizes", "dirichlet"), ("iid_fraction", "mixed", 0.3)]],
    ("client.method_options.OPTION",
     {"client": {"method": "ditto", "method_options": {"lam": 0.5}}},
     {"client": {"method": {"name": "ditto", "options": {"lam": 0.5}}}},
     "client.method.options.lam", 0.5),
    *[(f"model.{k}", {"model": {"name": m, k: v}}, {"model": {"name": m, "options": {k: v}}},
       f"model.options.{k}", LoRAConfig(r=4) if k == "lora" else v)
      for k, m, v in [("hidden", "mlp", [8]), ("activation", "mlp", "none"),
                      ("channels", "cnn", [4, 8]), ("depth", "resnet", 8),
                      ("width", "resnet", 8), ("embed", "char_rnn", 4),
                      ("cell", "char_rnn", "lstm"), ("norm", "resnet9", "batch"),
                      ("path", "hf_causal_lm", "m"), ("gguf_file", "hf_causal_lm", "m.gguf"),
                      ("config", "hf_causal_lm", {"hidden_size": 8}),
                      ("lora", "hf_causal_lm", {"r": 4}),
                      ("gradient_checkpointing", "hf_causal_lm", True),
                      ("base_dtype", "hf_causal_lm", "bfloat16")]],
    *[(f"data.{k}", {"data": {"name": d, k: v}}, {"data": {"name": d, "options": {k: v}}},
       f"data.options.{k}", v)
      for k, d, v in [("path", "csv", "x.csv"), ("label", "csv", "y"), ("client", "csv", "who"),
                      ("features", "csv", ["a", "b"]), ("root", "cifar10", "/d"),
                      ("verify", "cifar10", False), ("labels", "cifar100", "coarse"),
                      ("writer_fraction", "femnist", 0.5), ("image_column", "hf", "img"),
                      ("image_size", "image-folder", 32), ("max_client_samples", "hf", 10)]],
    *[(f"data.{d}.{k}", {"data": {"name": d, d: {k: v}}},
       {"data": {"name": d, "options": {k: v}}}, f"data.options.{k}", v)
      for d, k, v in [("synthetic", "alpha", 0.5), ("synthetic", "beta", 0.5),
                      ("synthetic", "dim", 10), ("synthetic", "classes", 3),
                      ("shakespeare", "window", 20), ("shakespeare", "stride", 2),
                      ("shakespeare", "min_chars", 100), ("shakespeare", "max_clients", 3),
                      ("shakespeare", "max_windows", 5), ("text", "seq_len", 16),
                      ("text", "stride", 4), ("text", "tokenizer", "tok"),
                      ("text", "min_chars", 100), ("text", "max_clients", 3),
                      ("text", "max_windows", 5), ("text", "clients", "play")]],
    *[(f"backend.{k}", {"backend": {"name": b, k: v}},
       {"backend": {"name": b, "options": {k: v}}}, f"backend.options.{k}", v)
      for k, b, v in [("workers", "process", 2), ("inner", "process", "lockstep"),
                      ("chunk", "vmap", 4), ("address", "ray", "auto"),
                      ("on_failure", "ray", "drop"), ("max_retries", "process", 1),
                      ("gpus_per_worker", "ray", 0.5)]],
]


def test_the_rows_cover_the_table():
    assert sorted(r[0] for r in ROWS) == sorted(tr.TABLE)
    assert {r[0]: tr.TABLE[r[0]].replace("OPTION", r[3].split(".")[-1]) for r in ROWS} == {
        r[0]: r[3] for r in ROWS}


def _get(cfg: Any, dotted: str) -> Any:
    *path, key = dotted.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part)
    return node[key]


def _state(obj: Any) -> dict[str, Any]:
    """An object's plain settings (what its factory was given, as it keeps them)."""
    return {k: v for k, v in vars(obj).items()
            if isinstance(v, int | float | str | bool | tuple) and not k.startswith("_")}


def _built(cfg: Any, where: str) -> Any:
    from fedloom.compress.feedback import feedback_from_config
    from fedloom.hooks import planner_from_config

    if where.startswith("compression.feedback"):
        return feedback_from_config(cfg.compression.feedback, Layout.flat(8))
    if where.startswith("compression.adaptive"):
        return planner_from_config(cfg.compression.adaptive)
    if where.startswith(("data.", "model.", "backend.")):
        return None  # a function: its options are the config's
    if where.startswith("server.optimizer"):
        s = cfg.server.optimizer
        return registry.build("server_optimizer", s.name, {**s.options, "lr": 1.0}, "x")
    m = cfg.client.method
    return registry.build("method", m.name, dict(m.options), "x")


@pytest.mark.parametrize(("old_key", "old", "new", "where", "value"), ROWS,
                         ids=[r[0] for r in ROWS])
def test_every_old_key_lands_at_its_new_place(old_key, old, new, where, value, caplog):
    with caplog.at_level(logging.WARNING, logger="fedloom"):
        a = config_from_dict(old)
    b = config_from_dict(new)
    assert a == b
    assert _get(a, where) == value
    assert f"{old_key.replace('.OPTION', '')}" in caplog.text and where in caplog.text
    # the component built from either gets the same options
    ca, cb = _built(a, where), _built(b, where)
    if ca is None:
        return
    assert type(ca) is type(cb) and _state(ca) == _state(cb)
    key = where.split(".")[-1]
    settings = _state(ca)
    if key in settings:
        assert settings[key] == value


def test_a_flat_key_the_component_does_not_take_is_dropped_as_it_was_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger="fedloom"):
        cfg = config_from_dict({"compression": {"feedback": "cser", "alpha": 0.3},
                                "server": {"optimizer": "adam", "momentum": 0.5}})
    assert cfg.compression.feedback.options == {} and cfg.server.optimizer.options == {}
    assert "not options of feedback 'cser', ignored as before: compression.alpha" in caplog.text
    assert "server optimizer 'adam', ignored as before: server.momentum" in caplog.text


def test_a_planner_takes_the_flat_keys_its_signature_names():
    cfg = config_from_dict({"compression": {"feedback": "sapef", "adaptive": "translate_probe",
                                            "alpha": 0.4}})
    assert cfg.compression.feedback.options == {"alpha": 0.4}
    assert cfg.compression.adaptive.options == {"alpha": 0.4}


def test_one_warning_line_naming_every_old_key(caplog):
    old = {"compression": {"feedback": "sapef", "alpha": 0.5, "feedback_options": {}},
           "server": {"optimizer": "momentum", "momentum": 0.5},
           "client": {"method": "ditto", "method_options": {"lam": 0.5}}}
    with caplog.at_level(logging.WARNING, logger="fedloom"):
        load_config(old)
    lines = [r.getMessage() for r in caplog.records if "written the old way" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0]
    for text in ("compression.alpha → compression.feedback.options.alpha",
                 "server.momentum → server.optimizer.options.momentum",
                 "client.method_options.lam → client.method.options.lam",
                 "compression.feedback_options (empty)"):
        assert text in lines[0]


def test_a_new_config_warns_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger="fedloom"):
        load_config("quickstart", ["compression.feedback=sapef",
                                   "compression.feedback.options.alpha=0.5",
                                   "server.optimizer=momentum"])
    assert "old way" not in caplog.text


@pytest.mark.parametrize(("data", "old", "new"), [
    ({"compression": {"feedback": {"name": "sapef", "options": {"alpha": 0.3}}, "alpha": 0.5}},
     "compression.alpha", "compression.feedback.options.alpha"),
    ({"compression": {"feedback": {"name": "sapef", "options": {"alpha": 0.3}},
                      "feedback_options": {"alpha": 0.5}}},
     "compression.feedback_options.alpha", "compression.feedback.options.alpha"),
    ({"server": {"optimizer": {"name": "momentum", "options": {"momentum": 0.3}},
                 "momentum": 0.5}}, "server.momentum", "server.optimizer.options.momentum"),
    ({"client": {"method": {"name": "ditto", "options": {"lam": 0.3}},
                 "method_options": {"lam": 0.5}}},
     "client.method_options.lam", "client.method.options.lam"),
])
def test_an_option_given_both_ways_in_one_config_is_refused(data, old, new):
    with pytest.raises(ConfigError) as e:
        load_config(data)
    msg = str(e.value)
    assert "\n" not in msg and old in msg and new in msg


@pytest.mark.parametrize(("data", "overrides"), [
    # an override wins over the file, whichever way either is written
    ({"compression": {"feedback": "sapef", "alpha": 0.3}},
     ["compression.feedback.options.alpha=0.5"]),
    ({"compression": {"feedback": {"name": "sapef", "options": {"alpha": 0.3}}}},
     ["compression.alpha=0.5"]),
    ({"compression": {"feedback": {"name": "sapef", "options": {"alpha": 0.3}}}},
     ["compression.feedback_options.alpha=0.5"]),
    ({"compression": {"feedback": "sapef", "alpha": 0.3}},
     ["compression.feedback.options={alpha: 0.5}"]),
    # and the later of two overrides wins, as always
    ({}, ["compression.feedback=sapef", "compression.alpha=0.3",
          "compression.feedback.options.alpha=0.5"]),
    ({}, ["compression.feedback=sapef", "compression.feedback.options.alpha=0.3",
          "compression.alpha=0.5"]),
])
def test_an_override_wins_in_either_shape(data, overrides):
    assert load_config(data, overrides).compression.feedback.options == {"alpha": 0.5}
    srv = load_config({"server": {"optimizer": {"name": "momentum",
                                                "options": {"momentum": 0.3}}}},
                      ["server.momentum=0.5"]).server.optimizer.options
    assert srv == {"momentum": 0.5}
    m = load_config({"client": {"method": "ditto", "method_options": {"lam": 0.3}}},
                    ["client.method.options.lam=0.5"]).client.method.options
    assert m == {"lam": 0.5}


def test_an_old_key_at_its_default_beside_the_new_one_is_no_conflict():
    # a run folder of an older version holds every flat key, at least at its default
    cfg = load_config({"compression": {"alpha": 0.85}},
                      ["compression.feedback=sapef", "compression.feedback.options.alpha=0.3"])
    assert cfg.compression.feedback.options == {"alpha": 0.3}


SAPEF = {"compression": {"feedback": {"name": "sapef", "options": {"alpha": 0.5}}},
         "server": {"optimizer": {"name": "momentum", "options": {"momentum": 0.5}}},
         "client": {"method": {"name": "ditto", "options": {"lam": 0.5}}}}


@pytest.mark.parametrize(("data", "overrides"), [
    # the old way in the file, in the overrides, in either order
    ({"compression": {"feedback": "sapef", "alpha": 0.5},
      "server": {"optimizer": "momentum", "momentum": 0.5},
      "client": {"method": "ditto", "method_options": {"lam": 0.5}}}, []),
    ({}, ["compression.feedback=sapef", "compression.alpha=0.5", "server.optimizer=momentum",
          "server.momentum=0.5", "client.method=ditto", "client.method_options.lam=0.5"]),
    ({}, ["compression.alpha=0.5", "compression.feedback=sapef", "server.momentum=0.5",
          "server.optimizer=momentum", "client.method_options.lam=0.5", "client.method=ditto"]),
    # an old file, new overrides; a new file, old overrides
    ({"compression": {"feedback": "none", "alpha": 0.85}, "server": {"momentum": 0.9}},
     ["compression.feedback=sapef", "compression.feedback.options.alpha=0.5",
      "server.optimizer.name=momentum", "server.optimizer.options.momentum=0.5",
      "client.method=ditto", "client.method.options.lam=0.5"]),
    ({"compression": {"feedback": "sapef"}, "server": {"optimizer": "momentum"},
      "client": {"method": {"name": "ditto"}}},
     ["compression.alpha=0.5", "server.momentum=0.5", "client.method_options.lam=0.5"]),
    # the new way, a string expanded by an override inside it, options first
    ({"compression": {"feedback": "sapef"}},
     ["compression.feedback.options.alpha=0.5", "server.optimizer.options.momentum=0.5",
      "server.optimizer.name=momentum", "client.method=ditto",
      "client.method.options.lam=0.5"]),
    (SAPEF, []),
    (SAPEF, ["compression.feedback=sapef", "server.optimizer=momentum"]),  # same names: kept
])
def test_override_forms_and_orders_build_the_same_config(data, overrides):
    assert load_config(data, overrides) == load_config(SAPEF)


def test_a_string_naming_another_component_drops_the_old_ones_options():
    cfg = load_config(SAPEF, ["compression.feedback=cser", "server.optimizer=adam"])
    assert cfg.compression.feedback.options == {} and cfg.server.optimizer.options == {}
    with pytest.raises(ConfigError, match=r"^compression\.feedback\.options\.alpha: unknown "
                                          r"option for feedback 'cser'"):
        load_config(SAPEF, ["compression.feedback.name=cser"])  # .name keeps them


@pytest.mark.parametrize(("overrides", "message"), [
    (["compression.feedback=sapef", "compression.feedback.options.alpha=2"],
     "compression.feedback.options.alpha: must be <= 1, got 2.0"),
    (["compression.feedback=sapef", "compression.alpha=2"],
     "compression.feedback.options.alpha: must be <= 1, got 2.0"),
    (["compression.feedback=cser", "compression.feedback.options.period=0"],
     "compression.feedback.options.period: must be >= 1, got 0"),
    (["compression.feedback=sapef", "compression.feedback.options.alpha_schedule=fast"],
     "compression.feedback.options.alpha_schedule: must be one of"),
    (["compression.feedback=ef", "compression.feedback.options.alpha=0.5"],
     "compression.feedback.options.alpha: unknown option for feedback 'ef'"),
    (["compression.feedback=flare", "compression.feedback.options.layout=1"],
     "compression.feedback.options.layout: not an option"),
    (["server.optimizer=momentum", "server.optimizer.options.lr=0.5"],
     "server.optimizer.options.lr: not an option (the step size is server.lr"),
    (["client.method=ditto", "client.method.options.nope=1"],
     "client.method.options.nope: unknown option for method 'ditto'"),
])
def test_options_are_checked_by_the_factory_signature(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("quickstart", overrides)
    assert str(e.value).startswith(message)


def test_an_option_at_its_default_is_the_config_without_it():
    a = load_config({"compression": {"feedback": {"name": "sapef", "options": {"alpha": 0.85}}}})
    assert a.compression.feedback.options == {}
    assert a == load_config({"compression": {"feedback": "sapef"}})
    # converted as the signature says: an integer for a float option is that float
    assert load_config({"compression": {"feedback": {"name": "sapef", "options": {
        "alpha": 1}}}}).compression.feedback.options == {"alpha": 1.0}


# ------------------------------------------------------------ shipped configs, suites
# The data sources and models registered when data and model took {name, options}
# (d55c20a, 5f775b6): only their options were ever written flat; one registered later
# has no old way to translate, and its section stays as written.
OLD_NAMES = {
    "data": frozenset({"cifar10", "cifar100", "csv", "digits", "fashion-mnist", "femnist", "hf",
                       "image-folder", "mnist", "npz", "shakespeare", "synthetic", "text",
                       "tiny-imagenet"}),
    "model": frozenset({"char_rnn", "cnn", "craft_cnn", "flare_cnn", "flare_fc", "hf_causal_lm",
                        "leaf_cnn", "mlp", "pfl_cnn", "resnet", "resnet18", "resnet9", "vgg11",
                        "vgg16", "vgg19"}),
}


def old_shape(data: dict[str, Any], saved: bool = False) -> dict[str, Any]:
    """A new-shape config mapping written the old way (the inverse of the translation);
    ``saved``: as an older version saved it (config.yaml, a checkpoint), every flat key
    there, at its old default where it was not set."""
    out = copy.deepcopy(data)
    if saved:
        out.setdefault("data", {}).setdefault("partition", {"name": "dirichlet"})
        out = old_shape(out)
        for sec, keys in ((out["compression"], tr.FEEDBACK_KEYS), (out["server"], tr.SERVER_KEYS),
                          (out["data"]["partition"], tr.PARTITION_KEYS),
                          *((out.setdefault(s, {}), keys) for s, keys in tr.FLAT_SECTIONS.items()),
                          *((out["data"].setdefault(s, {}), keys)
                            for s, keys in tr.DATA_SOURCES.items())):
            for k, v in keys.items():
                sec.setdefault(k, copy.deepcopy(v))
        return out
    comp, srv, client = (out.setdefault(k, {}) for k in ("compression", "server", "client"))
    for key in ("feedback", "adaptive"):
        sec = comp.get(key)
        if isinstance(sec, dict):
            comp[key] = sec.get("name", "none")
            opts = dict(sec.get("options") or {})
            if key == "feedback":
                comp.update({k: opts.pop(k) for k in list(opts) if k in tr.FEEDBACK_KEYS})
            comp[f"{key}_options"] = opts
    sec = srv.get("optimizer")
    if isinstance(sec, dict):
        srv["optimizer"] = sec.get("name", "sgd")
        srv.update(sec.get("options") or {})
    sec = client.get("method")
    if isinstance(sec, dict):
        client["method"] = sec.get("name", "sgd")
        client["method_options"] = dict(sec.get("options") or {})
    for name in tr.FLAT_SECTIONS:
        sec = out.get(name)
        if isinstance(sec, str):
            out[name] = {"name": sec}
        elif isinstance(sec, dict) and "options" in sec:
            if sec.get("name") not in OLD_NAMES.get(name, (sec.get("name"),)):
                continue  # a source or model added later was never written the old way
            opts = sec.pop("options") or {}
            if name == "data" and sec.get("name") in tr.DATA_SOURCES:  # data.synthetic, ...
                sec[sec["name"]] = {k: opts.pop(k) for k in list(opts) if k not in tr.DATA_KEYS}
            out[name] = {**sec, **{k: dict(vars(v)) if isinstance(v, LoRAConfig) else v
                                   for k, v in opts.items()}}
    part = out.setdefault("data", {}).get("partition")
    if isinstance(part, dict) and not str(part.get("name", "")).startswith("flwr:"):
        opts = dict(part.pop("options", None) or {})
        part.update({k: opts.pop(k) for k in list(opts) if k in tr.PARTITION_KEYS})
        part["options"] = opts  # what the old section held for flwr:NAME only
    return out


def old_override(text: str, source: str = "") -> str:
    """A new-shape override written the old way (``source``: the config's data.name)."""
    key, sep, value = text.partition("=")
    parts = key.split(".")
    if parts[:2] == ["data", "options"] and len(parts) > 2 and source in tr.DATA_SOURCES and (
            parts[2] not in tr.DATA_KEYS):
        key = ".".join(["data", source, *parts[2:]])
    elif key.startswith("compression.feedback.options.") and parts[-1] in tr.FEEDBACK_KEYS:
        key = f"compression.{parts[-1]}"
    elif key.startswith("server.optimizer.options."):
        key = f"server.{parts[-1]}"
    elif key.startswith("data.partition.options.") and parts[-1] in tr.PARTITION_KEYS:
        key = f"data.partition.{parts[-1]}"
    elif parts[0] in tr.FLAT_SECTIONS and parts[1:2] == ["options"] and len(parts) > 2:
        key = ".".join([parts[0], *parts[2:]])
    for new, old in (("compression.feedback.options", "compression.feedback_options"),
                     ("compression.adaptive.options", "compression.adaptive_options"),
                     ("client.method.options", "client.method_options")):
        key = key.replace(new, old)
    if parts[-1] == "name" and ".".join(parts[:-1]) in ("server.optimizer", "client.method",
                                                          "compression.feedback"):
        key = ".".join(parts[:-1])
    return f"{key}{sep}{value}"


SHIPPED = sorted(p for p in [*ROOT.glob("configs/**/*.yaml"),
                             *ROOT.glob("src/fedloom/configs/*.yaml")]
                 if "settings" not in yaml.safe_load(p.read_text()))
SUITES = sorted(p for p in ROOT.glob("configs/**/*.yaml")
                if "settings" in yaml.safe_load(p.read_text()))


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(ROOT)) for p in SHIPPED])
def test_a_shipped_config_written_the_old_way_is_the_same_config(path):
    data = yaml_load(path.read_text())
    data.setdefault("name", path.stem)
    new = load_config(data)
    assert load_config(old_shape(data)) == new
    # and so is its whole saved form (a run folder's config.yaml of an older version)
    assert load_config(old_shape(config_to_dict(new), saved=True)) == new


@pytest.mark.parametrize("path", SUITES, ids=[str(p.relative_to(ROOT)) for p in SUITES])
def test_a_suites_overrides_written_the_old_way_are_the_same_configs(path):
    suite = yaml.safe_load(path.read_text())
    space = (suite.get("tuning") or {}).get("space") or {}
    checked = 0
    for setting in suite["settings"].values():
        cfg = ROOT / setting["config"]
        if not cfg.is_file():
            cfg = path.parent / setting["config"]
        for method in suite["methods"].values():
            ov = method if isinstance(method, list) else list(method.get("overrides") or [])
            points = {**space, **(setting.get("space") or {}),
                      **({} if isinstance(method, list) else method.get("space") or {})}
            extra = [f"{k}={v[0]}" for k, v in points.items()]
            ov = [o for o in [*(setting.get("overrides") or []), *ov, *extra] if "$" not in o]
            new = load_config(cfg, ov)
            assert load_config(cfg, [old_override(o, new.data.name) for o in ov]) == new
            checked += 1
    assert checked


# ------------------------------------------------------- run folders of an older version
def test_the_sweep_recognises_a_run_folder_saved_the_old_way(tmp_path):
    from fedloom.engine.build import resolve_auto
    from fedloom.sweep.running import _stale
    from fedloom.sweep.suite import RunSpec

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"name": "digits", "num_clients": 10},
                                   "cohort": {"size": 4}, "compression": {"name": "topk"}}))
    ov = ("compression.feedback=sapef", "compression.feedback.options.alpha=0.5",
          "server.optimizer=momentum", "client.method=ditto")
    spec = RunSpec("s", "m", 1, str(cfg), ov, tmp_path / "run")
    spec.out.mkdir()
    saved = config_to_dict(resolve_auto(load_config(str(cfg), [*ov, "seed=1"])))
    (spec.out / "config.yaml").write_text(yaml.safe_dump(old_shape(saved, saved=True)))
    text = (spec.out / "config.yaml").read_text()
    assert "alpha: 0.5" in text and "period: 5" in text and "beta1: 0.9" in text  # the old shape
    assert _stale(spec) is None
    # and a run folder that holds another value is still told apart
    (spec.out / "config.yaml").write_text(yaml.safe_dump(old_shape(
        {**saved, "compression": {**saved["compression"],
                                  "feedback": {"name": "sapef", "options": {"alpha": 0.6}}}},
        saved=True)))
    assert "compression.feedback.options.alpha: 0.6 → 0.5" in (_stale(spec) or "")


def test_resume_of_a_run_saved_the_old_way(tmp_path, tiny):
    import fedloom
    from fedloom.engine.runs.checkpoint import load_checkpoint, save_checkpoint

    ov = ["compression.name=topk", "compression.options={ratio: 0.1}", "compression.feedback=cser",
          "compression.period=2"]
    ref = fedloom.run(tiny, ov)

    def stop(state, metrics):
        if state.next_round == 2:
            raise KeyboardInterrupt

    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        fedloom.run(tiny, ov, out=out, callbacks=[stop])
    # as an older version wrote them: config.yaml and each checkpoint's config
    saved = yaml.safe_load((out / "config.yaml").read_text())
    (out / "config.yaml").write_text(yaml.safe_dump(old_shape(saved, saved=True)))
    ckpts = [p for p in out.rglob("*") if p.is_file() and p.suffix in (".pt", ".ckpt")]
    assert ckpts
    for p in ckpts:
        ck = load_checkpoint(p)
        ck["config"] = old_shape(ck["config"], saved=True)
        save_checkpoint(p, ck)
    res = fedloom.run(tiny, ov, out=out, resume=True)
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]


def test_a_tuning_points_folder_keeps_its_name_in_the_new_shape():
    """Trial folders are named by the point: the same trial, its key written either way,
    is the folder an older version ran (so the sweep reuses it)."""
    from fedloom.tuning import point_slug

    new = {"server.lr": 1.0, "compression.feedback.options.alpha": 0.6,
           "client.method.options.lam": 0.1, "server.optimizer.options.momentum": 0.9}
    assert point_slug(new) == ("server.lr=1.0,compression.alpha=0.6,client.method_options.lam=0.1,"
                               "server.momentum=0.9")
    assert point_slug({"compression.feedback.options.decay": 0.5}) == (
        "compression.feedback_options.decay=0.5")
    # and every row of the table is spelt back (the folder of an option of each kind)
    shared = set(tr.DATA_SOURCES["shakespeare"]) & set(tr.DATA_SOURCES["text"])
    for old, new_key in tr.TABLE.items():
        if new_key.startswith("data.options.") and new_key.split(".")[-1] in shared:
            continue  # two sources' key (stride): its old spelling needs the source
        assert tr.old_spelling(new_key.replace("OPTION", "x")) == old.replace("OPTION", "x")


def test_partition_keys_of_an_older_run_folder():
    """A saved config of an older version holds every flat partition key: a partitioner
    that takes any (mixed) gets the ones off their defaults, flwr:NAME none (it took
    only `options`, its own)."""
    old = {"name": "mixed", "alpha": 0.1, "min_samples": 10, "shards_per_client": 2,
           "k": 2, "then": "", "counts": [], "iid_fraction": 0.3, "options": {}}
    cfg = load_config({"data": {"name": "digits", "num_clients": 10, "partition": old}})
    assert cfg.data.partition.options == {"alpha": 0.1, "iid_fraction": 0.3}
    pytest.importorskip("flwr_datasets")
    flwr = {**old, "name": "flwr:DirichletPartitioner", "options": {"alpha": 0.3}}
    cfg = load_config({"data": {"name": "digits", "num_clients": 10, "partition": flwr}})
    assert cfg.data.partition.options == {"alpha": 0.3}


def test_a_run_folders_config_of_an_older_version_loads():
    """tests/fixtures/run_config_before_options.yaml is what a run directory's
    config.yaml held before the model's, the backend's and the data's keys became
    options (every flat key, most at their defaults): it loads as the same config
    written the new way."""
    from fedloom.engine.build import resolve_auto

    old = load_config(ROOT / "tests/fixtures/run_config_before_options.yaml")
    new = resolve_auto(load_config({
        "name": "old-shape", "seed": 1, "rounds": 2,
        "data": {"name": "digits", "num_clients": 6, "max_samples": 300,
                 "partition": {"name": "iid"}},
        "cohort": {"size": 3}, "model": {"name": "mlp", "options": {"hidden": [16]}},
        "backend": {"name": "sequential", "threads": 1},
        "client": {"lr": 0.1, "prox_mu": 0.01}, "checkpoint": {"every": 0}}))
    assert old == new
    # and the backend's keys: into the options of the backend that takes them
    data = yaml_load((ROOT / "tests/fixtures/run_config_before_options.yaml").read_text())
    data["backend"].update(name="process", workers=2, chunk=3, address="x")
    cfg = load_config(data)
    assert (cfg.backend.name, cfg.backend.options) == ("process", {"workers": 2, "chunk": 3})


@registry.register("model", "translate_old_signature")
def _old_model(cfg: Any, in_shape: tuple[int, ...], num_classes: int) -> Any:
    raise NotImplementedError  # pragma: no cover (refused before it is called)


def test_model_options_are_checked_and_an_old_factory_refused():
    with pytest.raises(ConfigError) as e:
        load_config({"model": {"name": "mlp", "options": {"hiden": [8]}}})
    assert str(e.value).startswith("model.options.hiden: unknown option for model 'mlp' "
                                   "(did you mean hidden?")
    with pytest.raises(ConfigError, match=r"^model\.options\.lora\.rr: unknown key"):
        load_config({"model": {"name": "hf_causal_lm", "options": {"lora": {"rr": 4}}}})
    with pytest.raises(ConfigError, match=r"^model\.name: 'translate_old_signature' is a "
                                          r"factory of the old signature \(cfg, in_shape"):
        load_config({"model": "translate_old_signature"})
    # the model's keys the old way, as a dotted override on a config in the new shape
    cfg = load_config({"model": {"name": "mlp", "options": {"hidden": [8]}}},
                      ["model.hidden=[4]", "model.activation=none"])
    assert cfg.model.options == {"hidden": [4], "activation": "none"}
    # another model by name: the old one's options go, model.buffers stays
    cfg = load_config({"model": {"name": "mlp", "options": {"hidden": [8]}, "buffers": "local"}},
                      ["model=cnn"])
    assert (cfg.model.name, cfg.model.options, cfg.model.buffers) == ("cnn", {}, "local")


@registry.register("dataset", "translate_old_loader")
def _old_loader(cfg: Any, seed: int) -> Any:
    raise NotImplementedError  # pragma: no cover (refused before it is called)


def test_data_options_are_checked_and_an_old_loader_refused():
    with pytest.raises(ConfigError) as e:
        load_config({"data": {"name": "csv", "options": {"pth": "t.csv"}}})
    assert str(e.value).startswith("data.options.pth: unknown option for dataset 'csv' "
                                   "(did you mean path?")
    with pytest.raises(ConfigError, match=r"^data\.options\.writer_fraction: must be <= 1"):
        load_config({"data": {"name": "femnist", "options": {"writer_fraction": 2}}})
    with pytest.raises(ConfigError, match=r"^data\.options\.seed: not an option"):
        load_config({"data": {"name": "digits", "options": {"seed": 3}}})
    with pytest.raises(ConfigError, match=r"^data\.name: 'translate_old_loader' is a loader "
                                          r"of the old signature \(cfg, seed\)"):
        load_config({"data": {"name": "translate_old_loader"}})
    # the data's keys the old way, as dotted overrides on a config in the new shape
    cfg = load_config({"data": {"name": "csv", "options": {"path": "a.csv"}}},
                      ["data.path=b.csv", "data.label=y"])
    assert cfg.data.options == {"path": "b.csv", "label": "y"}
    cfg = load_config({"data": {"name": "synthetic", "num_clients": 20,
                                "options": {"alpha": 0.5}}}, ["data.synthetic.beta=0.25"])
    assert cfg.data.options == {"alpha": 0.5, "beta": 0.25}
    # the same option both ways in one section is refused
    with pytest.raises(ConfigError, match=r"data\.path and data\.options\.path"):
        load_config({"data": {"name": "csv", "path": "a.csv", "options": {"path": "b.csv"}}})


def test_a_run_folders_data_keys_of_an_older_version():
    """The fixture's data section with its source's keys off their defaults: each moves
    into the options of the source that read it; another source's key was ignored."""
    data = yaml_load((ROOT / "tests/fixtures/run_config_before_options.yaml").read_text())
    data["data"].update(name="csv", path="t.csv", label="y", verify=False)
    data["data"]["synthetic"]["alpha"] = 0.5
    assert load_config(data).data.options == {"path": "t.csv", "label": "y"}
    data["data"]["name"] = "synthetic"
    data["data"].update(path="", label="label")
    assert load_config(data).data.options == {"alpha": 0.5}
    data["data"].update(name="text", text={"seq_len": 16, "clients": "play"})
    assert load_config(data).data.options == {"seq_len": 16, "clients": "play"}
