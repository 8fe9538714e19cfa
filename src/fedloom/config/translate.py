"""Configs written the old way, rewritten into today's shape before they are checked.

Every pluggable section is ``{name, options}`` (a string is short for ``{name:
STRING}``), its factory's signature the schema of its options. Before that, options
reached components three ways; a config written so still loads, through
:func:`translate` (called by :func:`fedloom.config.config_from_dict`, so YAML files,
``a.b=value`` overrides, a run directory's saved ``config.yaml`` and a checkpoint's
config all pass through it), with one warning line that names each old key and
its new place:

- the compression section's flat keys (:data:`FEEDBACK_KEYS`: ``alpha``,
  ``alpha_schedule``, ``period``, …) → ``compression.feedback.options.KEY`` (and
  ``compression.adaptive.options.KEY`` where the round planner's factory takes it);
- ``compression.feedback_options``, ``compression.adaptive_options``,
  ``client.method_options`` → ``….feedback.options``, ``….adaptive.options``, ``….method.options``;
- the server section's ``momentum``, ``beta1``, ``beta2``, ``eps`` → ``server.optimizer.options``;
- the partition section's flat keys (:data:`PARTITION_KEYS`: ``alpha``,
  ``min_samples``, ``k``, …) → ``data.partition.options.KEY``.
- ``server.optimizer: fedloom.aggregate.server_opt:NAME`` (the server optimizers'
  old module, :data:`MOVED_MODULES`) → ``fedloom.server_opt.optimizers:NAME``.

A flat key is moved only into the options of a factory that takes it, else dropped;
overrides are applied to the mapping as written, then the whole is translated; an
option given both ways in one place is refused. Why, and the exceptions:
docs/reference/config.md (Components and their options).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any

from fedloom import registry
from fedloom.config.sections import ConfigError

__all__ = ["BACKEND_KEYS", "DATA_KEYS", "DATA_SOURCES", "FEEDBACK_KEYS", "FLAT_SECTIONS",
           "MODEL_KEYS", "MOVED_MODULES", "OPTION_DICTS", "PARTITION_KEYS", "SERVER_KEYS",
           "TABLE", "old_spelling", "respell", "translate", "twins"]

log = logging.getLogger("fedloom")

# The compression section's flat feedback keys and their old defaults (each the
# default of the built-in factory that takes it, so an option left out means the same
# in both shapes).
FEEDBACK_KEYS: dict[str, Any] = {
    "alpha": 0.85, "alpha_schedule": "constant", "alpha_kappa": 10.0,
    "period": 5, "reset_ratio": 0.1, "beta": 0.2, "ef21_mean": "all",
    "tau": 0.05, "tau_decay": 1.1, "penalty_steps": 1, "penalty": "l1",
}
# The server section's flat optimizer keys and their old defaults.
SERVER_KEYS: dict[str, Any] = {"momentum": 0.9, "beta1": 0.9, "beta2": 0.99, "eps": 1e-3}
# The partition section's flat keys and their old defaults (each the default of the
# built-in partitioners that take it; "then": "" meant the partitioner's own).
PARTITION_KEYS: dict[str, Any] = {
    "alpha": 0.5, "min_samples": 10, "shards_per_client": 2, "max_tries": 1000,
    "min_policy": "resample", "balance": False, "k": 2, "assign": "random", "split": "even",
    "distribution": "powerlaw", "exponent": 1.5, "sigma": 1.0, "counts": [], "then": "",
    "iid_fraction": 0.5,
}
# The model section's flat keys and their old defaults (ModelConfig's, each the default
# of the built-in factories that take it; craft_cnn read channels [32, 64] as its own
# 64/64, which its factory's default is).
MODEL_KEYS: dict[str, Any] = {
    "hidden": [200, 200], "activation": "relu", "channels": [32, 64], "depth": 20,
    "width": 16, "embed": 8, "cell": "gru", "norm": "group", "path": "", "gguf_file": "",
    "config": {}, "lora": {"r": 0, "alpha": 16, "dropout": 0.0,
                           "target_modules": ["q_proj", "v_proj"], "train": "both"},
    "gradient_checkpointing": False, "base_dtype": "run",
}
# The backend section's flat keys and their old defaults (BackendConfig's).
BACKEND_KEYS: dict[str, Any] = {
    "workers": 0, "inner": "sequential", "chunk": 0, "address": "", "on_failure": "retry",
    "max_retries": 2, "gpus_per_worker": 0.0,
}
# Top-level sections whose flat keys became their component's options.
# The data section's flat keys of the sources that took them and their old defaults
# (DataConfig's, each the default of the loaders that take it).
DATA_KEYS: dict[str, Any] = {
    "path": "", "label": "label", "client": "", "features": [], "root": "", "verify": True,
    "labels": "fine", "writer_fraction": 1.0, "image_column": "image", "image_size": 0,
    "max_client_samples": 0,
}
# The data section's per-source mappings (data.synthetic, data.shakespeare, data.text),
# each read by the one source of that name, and their old defaults.
DATA_SOURCES: dict[str, dict[str, Any]] = {
    "synthetic": {"alpha": 1.0, "beta": 1.0, "dim": 60, "classes": 10},
    "shakespeare": {"window": 80, "stride": 1, "min_chars": 4000, "max_clients": 0,
                    "max_windows": 0},
    "text": {"seq_len": 64, "stride": 0, "tokenizer": "char", "min_chars": 4000,
             "max_clients": 0, "max_windows": 0, "clients": "role"},
}
FLAT_SECTIONS: dict[str, dict[str, Any]] = {"model": MODEL_KEYS, "backend": BACKEND_KEYS,
                                            "data": DATA_KEYS}
# (section, old key of an options mapping) → the section that now holds those options.
OPTION_DICTS: dict[tuple[str, str], str] = {
    ("compression", "feedback_options"): "feedback",
    ("compression", "adaptive_options"): "adaptive",
    ("client", "method_options"): "method",
}
# Old dotted key → new dotted key, one row a key (OPTION stands for any option name).
TABLE: dict[str, str] = {
    **{f"compression.{k}": f"compression.feedback.options.{k}" for k in FEEDBACK_KEYS},
    **{f"server.{k}": f"server.optimizer.options.{k}" for k in SERVER_KEYS},
    **{f"data.partition.{k}": f"data.partition.options.{k}" for k in PARTITION_KEYS},
    **{f"{s}.{old}.OPTION": f"{s}.{new}.options.OPTION" for (s, old), new in OPTION_DICTS.items()},
    **{f"{s}.{k}": f"{s}.options.{k}" for s, keys in FLAT_SECTIONS.items() for k in keys},
    **{f"data.{src}.{k}": f"data.options.{k}" for src, keys in DATA_SOURCES.items()
       for k in keys},
}
# Modules of fedloom's components that moved, for a ``module:attr`` name written with
# the old one: the server optimizers (fedloom.aggregate.server_opt until the server
# step became a chain of transforms, then a re-export of fedloom.server_opt.optimizers).
MOVED_MODULES: dict[str, str] = {"fedloom.aggregate.server_opt": "fedloom.server_opt.optimizers"}
# The default name of each named section (the dataclasses' defaults).
_DEFAULT_NAME = {"feedback": "none", "adaptive": "none", "optimizer": "sgd", "method": "sgd",
                 "partition": "dirichlet", "model": "mlp", "backend": "sequential",
                 "data": "mnist"}
_KIND = {"feedback": "feedback", "adaptive": "planner", "optimizer": "server_optimizer",
         "method": "method", "partition": "partitioner", "model": "model",
         "backend": "backend", "data": "dataset"}

# Each warning once per process: a sweep reads the saved config of every run folder.
_WARNED: set[str] = set()


def _takes(kind: str, name: Any) -> frozenset[str] | None:
    """The options ``name``'s factory takes by name; None when it takes any
    (``**kwargs``) or cannot be found (the name's own check reports that)."""
    if not isinstance(name, str):
        return None
    try:
        params = inspect.signature(registry.get(kind, name)).parameters
    except (KeyError, TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(k for k, p in params.items()
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


class _Notes:
    """What the translation did, for its one warning line."""

    def __init__(self) -> None:
        self.moved: list[str] = []                # "old → new"
        self.ignored: dict[str, list[str]] = {}   # component → old keys it does not take
        self.dropped: list[str] = []              # empty option mappings, shadowed defaults
        self.defaults: list[str] = []             # flat keys at their old defaults

    def __bool__(self) -> bool:
        return bool(self.moved or self.ignored or self.dropped or self.defaults)

    def line(self) -> str:
        parts = [", ".join(self.moved)] if self.moved else []
        parts += [f"not options of {who}, ignored as before: {', '.join(keys)}"
                  for who, keys in self.ignored.items()]
        if self.dropped:
            parts.append(f"dropped: {', '.join(self.dropped)}")
        if self.defaults:
            parts.append(f"at their old defaults, dropped: {', '.join(self.defaults)}")
        return ("config: options written the old way, translated (write them the new way; "
                "this translation will be removed): " + "; ".join(parts))


class _Named:
    """A ``{name, options}`` section being translated: what it held, what moves in."""

    def __init__(self, section: dict[str, Any], key: str, path: str) -> None:
        value = section.get(key, _DEFAULT_NAME[key])
        self.path = path
        if isinstance(value, str):
            value = {"name": value}
        # Anything else (a number, a list) is left for the section's checks to name.
        self.ok = isinstance(value, Mapping) and isinstance(value.get("options", {}), Mapping)
        self.value: dict[str, Any] = dict(value) if self.ok else {}
        self.given = set(self.value.get("options") or {}) if self.ok else set()
        self.moved: dict[str, Any] = {}
        self.name = self.value.get("name", _DEFAULT_NAME[key])
        self.takes = _takes(_KIND[key], self.name)

    def put(self, key: str, value: Any, old: str, notes: _Notes, default: Any = None,
            has_default: bool = False) -> None:
        new = f"{self.path}.options.{key}"
        if key in self.given:
            if has_default and value == default:
                notes.dropped.append(f"{old} (its old default; {new} is given)")
                return
            raise ConfigError(f"{old} and {new}: the same option written the old and the new "
                              f"way; keep {new}")
        self.moved[key] = value
        notes.moved.append(f"{old} → {new}")

    def store(self, section: dict[str, Any], key: str) -> None:
        if self.ok and self.moved:
            self.value["options"] = {**(self.value.get("options") or {}), **self.moved}
            section[key] = self.value


def _compression(comp: dict[str, Any], notes: _Notes) -> None:
    flat = {k: comp.pop(k) for k in FEEDBACK_KEYS if k in comp}
    extra = {new: comp.pop(old) for (s, old), new in OPTION_DICTS.items()
             if s == "compression" and old in comp}
    if not flat and not extra:
        return
    fb = _Named(comp, "feedback", "compression.feedback")
    ad = _Named(comp, "adaptive", "compression.adaptive")
    for k, v in flat.items():
        old = f"compression.{k}"
        # The planner took the section's keys its signature names, as the policy did.
        into = [s for s in (fb, ad) if s.ok and s.takes is not None and k in s.takes]
        if not into and fb.ok and fb.takes is None:  # any option, or a name not found
            into = [fb]
        if not into:
            notes.ignored.setdefault(f"feedback {fb.name!r}", []).append(old)
        for s in into:
            s.put(k, v, old, notes, FEEDBACK_KEYS[k], has_default=True)
    for key, sec in (("feedback", fb), ("adaptive", ad)):
        opts = extra.get(key)
        if opts is None:
            continue
        old = f"compression.{key}_options"
        if not isinstance(opts, Mapping):
            raise ConfigError(f"{old}: must be a mapping, got {opts!r} (write it as "
                              f"{sec.path}.options)")
        for k, v in opts.items():  # over the flat keys, as before
            sec.put(str(k), v, f"{old}.{k}", notes)
        if not opts:
            notes.dropped.append(f"{old} (empty)")
    fb.store(comp, "feedback")
    ad.store(comp, "adaptive")


def _server(srv: dict[str, Any], notes: _Notes) -> None:
    _server_module(srv, notes)
    flat = {k: srv.pop(k) for k in SERVER_KEYS if k in srv}
    if not flat:
        return
    opt = _Named(srv, "optimizer", "server.optimizer")
    for k, v in flat.items():
        old = f"server.{k}"
        if opt.ok and (opt.takes is None or k in opt.takes):
            opt.put(k, v, old, notes, SERVER_KEYS[k], has_default=True)
        else:
            notes.ignored.setdefault(f"server optimizer {opt.name!r}", []).append(old)
    opt.store(srv, "optimizer")


def _server_module(srv: dict[str, Any], notes: _Notes) -> None:
    """``server.optimizer`` named ``module:attr`` in the server optimizers' old
    module (:data:`MOVED_MODULES`) → the same factory in today's."""
    opt = srv.get("optimizer")
    name = opt.get("name") if isinstance(opt, Mapping) else opt
    if not isinstance(name, str):
        return
    module, sep, attr = name.partition(":")
    if sep and module in MOVED_MODULES:
        new = f"{MOVED_MODULES[module]}:{attr}"
        srv["optimizer"] = {**opt, "name": new} if isinstance(opt, Mapping) else new
        notes.moved.append(f"server.optimizer {name} → {new}")


def _client(client: dict[str, Any], notes: _Notes) -> None:
    if "method_options" not in client:
        return
    opts = client.pop("method_options")
    if not isinstance(opts, Mapping):
        raise ConfigError(f"client.method_options: must be a mapping, got {opts!r} (write it "
                          "as client.method.options)")
    method = _Named(client, "method", "client.method")
    for k, v in opts.items():
        method.put(str(k), v, f"client.method_options.{k}", notes)
    if not opts:
        notes.dropped.append("client.method_options (empty)")
    method.store(client, "method")


def twins(key: str) -> list[str]:
    """The other spellings, old and new, of the option (or options mapping) that the
    dotted key ``key`` sets: an override clears them before it sets its own, so an
    override wins over the file in either shape (``compression.tau=0.05`` on a config
    whose FLARE has ``options: {tau: 0.5}``, and the reverse). Empty for other keys."""
    parts = key.split(".")
    n = len(parts)
    if parts[0] == "compression" and n >= 2:
        opt = parts[-1]
        if n == 2 and opt in FEEDBACK_KEYS:
            return [f"compression.feedback.options.{opt}", f"compression.feedback_options.{opt}"]
        for new, old in (("feedback", "feedback_options"), ("adaptive", "adaptive_options")):
            if parts[1:3] == [new, "options"] and n <= 4:
                flat = [f"compression.{opt}"] if n == 4 and new == "feedback" and (
                    opt in FEEDBACK_KEYS) else []
                if n == 3 and new == "feedback":  # the whole mapping: every flat key too
                    flat = [f"compression.{k}" for k in FEEDBACK_KEYS]
                return [".".join(["compression", old, *parts[3:]]), *flat]
            if parts[1] == old and n <= 3:
                flat = [f"compression.{opt}"] if n == 3 and new == "feedback" and (
                    opt in FEEDBACK_KEYS) else []
                return [".".join(["compression", new, "options", *parts[2:]]), *flat]
    if parts[0] == "server":
        if n == 2 and parts[1] in SERVER_KEYS:
            return [f"server.optimizer.options.{parts[1]}"]
        if n == 4 and parts[1:3] == ["optimizer", "options"] and parts[3] in SERVER_KEYS:
            return [f"server.{parts[3]}"]
        if n == 3 and parts[1:3] == ["optimizer", "options"]:
            return [f"server.{k}" for k in SERVER_KEYS]
    if parts[:2] == ["data", "partition"]:
        if n == 3 and parts[2] in PARTITION_KEYS:
            return [f"data.partition.options.{parts[2]}"]
        if n == 4 and parts[2] == "options" and parts[3] in PARTITION_KEYS:
            return [f"data.partition.{parts[3]}"]
        if n == 3 and parts[2] == "options":
            return [f"data.partition.{k}" for k in PARTITION_KEYS]
    if parts[0] == "data" and n >= 3 and parts[1] in DATA_SOURCES:
        return [".".join(["data", "options", *parts[2:]])]
    if parts[:2] == ["data", "options"] and n == 3:  # also a per-source mapping's key
        found = [f"data.{src}.{parts[2]}" for src, keys in DATA_SOURCES.items()
                 if parts[2] in keys]
        return found + ([f"data.{parts[2]}"] if parts[2] in DATA_KEYS else [])
    table = FLAT_SECTIONS.get(parts[0])
    if table is not None and n >= 2:
        if parts[1] in table:
            return [".".join([parts[0], "options", *parts[1:]])]
        if parts[1] == "options" and n >= 3 and parts[2] in table:
            return [".".join([parts[0], *parts[2:]])]
        if parts[1] == "options" and n == 2:
            return [f"{parts[0]}.{k}" for k in table] + (
                [f"data.{src}" for src in DATA_SOURCES] if parts[0] == "data" else [])
    if parts[0] == "client":
        if parts[1:3] == ["method", "options"] and n <= 4:
            return [".".join(["client", "method_options", *parts[3:]])]
        if n >= 2 and parts[1] == "method_options" and n <= 3:
            return [".".join(["client", "method", "options", *parts[2:]])]
    return []


def old_spelling(key: str) -> str:
    """The dotted ``key`` as the old way wrote it (``compression.feedback.options.alpha``
    → ``compression.alpha``), else ``key``: a name that must not change with the shape,
    such as the folder of a tuning point (fedloom.tuning.point_slug), so that a sweep
    finds the trials an older version ran."""
    parts = key.split(".")
    if len(parts) == 4 and parts[2] == "options":
        sec, name, opt = parts[0], parts[1], parts[3]
        if (sec, name) == ("compression", "feedback"):
            return f"compression.{opt}" if opt in FEEDBACK_KEYS else (
                f"compression.feedback_options.{opt}")
        if (sec, name) == ("compression", "adaptive"):
            return f"compression.adaptive_options.{opt}"
        if (sec, name) == ("server", "optimizer") and opt in SERVER_KEYS:
            return f"server.{opt}"
        if (sec, name) == ("client", "method"):
            return f"client.method_options.{opt}"
        if (sec, name) == ("data", "partition") and opt in PARTITION_KEYS:
            return f"data.partition.{opt}"
    if len(parts) >= 3 and parts[1] == "options" and parts[2] in FLAT_SECTIONS.get(parts[0], {}):
        return ".".join([parts[0], *parts[2:]])
    if len(parts) >= 3 and parts[:2] == ["data", "options"]:
        # a key of one source's mapping (data.synthetic.alpha); one that two sources
        # share (stride: shakespeare's and text's) stays as it is, its source unknown here
        srcs = [src for src, keys in DATA_SOURCES.items() if parts[2] in keys]
        if len(srcs) == 1:
            return ".".join(["data", srcs[0], *parts[2:]])
    return key


def _partition(data: dict[str, Any], notes: _Notes) -> None:
    """``data.partition``'s flat keys into its options. A partitioner took the keys its
    signature names; one that takes any (``mixed``, which hands them to ``then``; a
    plug-in with ``**kwargs``) took them all, so each key not at its old default (the
    default of every built-in that takes it) moves. A ``flwr:NAME`` partitioner took
    only ``options``, which already are its options."""
    part = data.get("partition")
    if not isinstance(part, Mapping):
        return  # a name alone (the shorthand), or what the section's checks will name
    part = dict(part)
    flat = {k: part.pop(k) for k in PARTITION_KEYS if k in part}
    if not flat:
        return
    data["partition"] = part
    sec = _Named(data, "partition", "data.partition")
    family = isinstance(sec.name, str) and registry.family("partitioner", sec.name)
    for k, v in flat.items():
        old = f"data.partition.{k}"
        named = sec.takes is not None and k in sec.takes
        if sec.ok and not family and (named or (sec.takes is None and v != PARTITION_KEYS[k])):
            sec.put(k, v, old, notes, PARTITION_KEYS[k], has_default=True)
        elif v == PARTITION_KEYS[k]:
            notes.dropped.append(f"{old} (its old default)")
        else:
            notes.ignored.setdefault(f"partitioner {sec.name!r}", []).append(old)
    sec.store(data, "partition")


def _flat(out: dict[str, Any], key: str, notes: _Notes) -> None:
    """A top-level section's flat keys (:data:`FLAT_SECTIONS`) into its component's
    options: a key at its old default is dropped (the factory's default is the same), any
    other moves into the options of a factory that takes it (or takes any: ``**kwargs``)
    and is ignored, as before, by one that does not."""
    table = FLAT_SECTIONS[key]
    section = out.get(key)
    if not isinstance(section, Mapping):
        return
    section = dict(section)
    flat = {k: section.pop(k) for k in table if k in section}
    nested = ({src: section.pop(src) for src in DATA_SOURCES if src in section}
              if key == "data" else {})
    if not flat and not nested:
        return
    out[key] = section
    sec = _Named(out, key, key)
    for k, v in flat.items():
        old = f"{key}.{k}"
        if v == table[k]:
            notes.defaults.append(old)
        elif sec.ok and (sec.takes is None or k in sec.takes):
            sec.put(k, v, old, notes)
        else:
            notes.ignored.setdefault(f"{key} {sec.name!r}", []).append(old)
    for src, given in nested.items():
        _source_keys(src, given, sec, notes)
    sec.store(out, key)


def _source_keys(src: str, given: Any, sec: _Named, notes: _Notes) -> None:
    """``data.SRC`` (:data:`DATA_SOURCES`: synthetic, shakespeare, text), read before by
    the source ``SRC`` alone: its keys into that source's options when it is the one
    named, else ignored as before; a key at its old default is dropped."""
    if not isinstance(given, Mapping):
        raise ConfigError(f"data.{src}: must be a mapping, got {given!r} (write its keys "
                          "as data.options)")
    defaults = DATA_SOURCES[src]
    for k, v in given.items():
        old = f"data.{src}.{k}"
        if k in defaults and v == defaults[k]:
            notes.defaults.append(old)
        elif sec.ok and sec.name == src:
            sec.put(str(k), v, old, notes)
        else:
            notes.ignored.setdefault(f"data {sec.name!r}", []).append(old)


def respell(key: str, data: Mapping[str, Any]) -> str:
    """An override's dotted ``key`` written the old way for a section that ``data``
    writes the new way (``model.hidden`` on a ``model`` with ``options``) → the new
    spelling (``model.options.hidden``), with the one warning line; else ``key``. A key
    into a section still written the old way stays: :func:`translate` moves it with the
    section's other flat keys."""
    parts = key.split(".")
    table = FLAT_SECTIONS.get(parts[0])
    nested = DATA_SOURCES if parts[0] == "data" else {}
    if table is None or len(parts) < 2 or not (
            parts[1] in table or (parts[1] in nested and len(parts) >= 3)):
        return key
    section = data.get(parts[0])
    if isinstance(section, Mapping) and any(k in section for k in (*table, *nested)):
        return key
    rest = parts[2:] if parts[1] in nested else parts[1:]
    new = ".".join([parts[0], "options", *rest])
    _warn(f"config: an override written the old way, translated (write it the new way; "
          f"this translation will be removed): {key} → {new}")
    return new


def _warn(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        log.warning("%s", msg)


def translate(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` in today's shape (see the module docstring); ``data`` itself when it holds
    no old key. Logs one warning line naming each old key and where it went (once per
    process for the same text); :class:`ConfigError` for an option given both ways."""
    notes = _Notes()
    out = dict(data)
    for name, fix in (("compression", _compression), ("server", _server),
                      ("client", _client), ("data", _partition)):
        section = out.get(name)
        if isinstance(section, Mapping):
            section = dict(section)
            fix(section, notes)
            out[name] = section
    for name in FLAT_SECTIONS:
        _flat(out, name, notes)
    if not notes:
        return data
    _warn(notes.line())
    return out
