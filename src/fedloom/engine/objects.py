"""Component objects given in Python instead of by name in the config.

A user who holds an aggregator, server optimizer, compressor, feedback policy,
local method, local-step transforms or client selector as objects (``CRAFT(step="rprop")``, a
class of their own) passes them to :func:`fedloom.run` or
:meth:`~fedloom.engine.experiment.Experiment.from_config`; the engine uses each where it would have
built one from the config's name. :meth:`Components.into` records each given
object in the config by import path and options, ``{name: object MODULE.CLASS,
options}`` (:mod:`fedloom.recorded`), so ``config.yaml``, the summary and every
message name what ran, a resume with another object is refused as a config change,
and :meth:`Components.with_recorded` rebuilds a record (``fedloom run RUN/config.yaml``).
Options of an object's config section are not read (they are the object's), nor is
``server.lr`` with a server step object (the summary names that step instead),
nor ``server.lr: auto`` with an aggregator object (give ``server.lr``); nor a method's
buffer policy (FedBN keeps each client's buffers): with such a method object, set
``model.buffers`` yourself.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from fedloom.config import Config, ConfigError
from fedloom.recorded import (
    OBJECT_PREFIX,
    RUN_FILE,
    UNRECORDED,
    describe,
    is_object,
    object_name,
    rebuild,
    record,
)
from fedloom.registry import build as build_named

__all__ = ["OBJECT_PREFIX", "Components", "comparable_records", "moved_objects", "object_name",
           "server_step"]

# Classes of fedloom that moved since a run directory may have recorded them: the
# server optimizer's old name → its new one (ServerOptimizer left fedloom.aggregate
# for fedloom.server_opt; the chain of server transforms became the one chain of
# fedloom.transforms).
_MOVED = {
    "object fedloom.aggregate.server_opt.ServerOptimizer":
        "object fedloom.server_opt.optimizers.ServerOptimizer",
    "object fedloom.server_opt.transforms.Chain": "object fedloom.transforms.Chain",
}

# The config sections a component object stands in for, by the Components field.
_SECTIONS = {"aggregator": ("aggregator",), "server": ("server", "optimizer"),
             "compressor": ("compression",), "feedback": ("compression", "feedback"),
             "method": ("client", "method"), "selector": ("cohort", "selection")}


def moved_objects(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved config (a mapping) naming a moved class by its new name, so that the
    run resumes; ``saved`` itself when it names none."""
    srv = saved.get("server")
    opt = srv.get("optimizer") if isinstance(srv, dict) else None
    name = opt.get("name") if isinstance(opt, dict) else opt
    if not (isinstance(srv, dict) and isinstance(name, str) and name in _MOVED):
        return saved
    new = {**opt, "name": _MOVED[name]} if isinstance(opt, dict) else _MOVED[name]
    return {**saved, "server": {**srv, "optimizer": new}}


def _at(cfg: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        cfg = cfg.get(key) if isinstance(cfg, dict) else None
    return cfg


def _named_alone(old: Any, new: Any) -> bool:
    """Whether ``old`` records by name alone (an earlier version's record) the object
    that ``new`` records with its options."""
    return (isinstance(old, dict) and isinstance(new, dict) and is_object(old.get("name"))
            and old.get("name") == new.get("name") and old.get("options") == {})


def _given_data(cfg: dict[str, Any]) -> bool:
    """Whether a config records data given in Python (kept in its run, or not)."""
    path = _at(cfg, ("data", "options", "path"))
    return isinstance(path, str) and path.startswith((RUN_FILE, UNRECORDED))


def comparable_records(saved: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """A run directory's saved config (or its checkpoint's) as ``given`` (the config
    of the resume) compares with it: moved classes by their new names, and an object
    an earlier version recorded by name alone (``options: {}``) read with ``given``'s
    options for the same class, so that such a run resumes as it did then."""
    out = copy.deepcopy(moved_objects(saved))
    for path in _SECTIONS.values():
        old, new = _at(out, path), _at(given, path)
        if _named_alone(old, new):
            old["options"] = copy.deepcopy(new["options"])
    # A run of a version that recorded a model or data given in Python as the configured
    # ones (fedloom.engine.given): read with the record given now, so that it resumes.
    if is_object(_at(given, ("model", "name"))) and not is_object(_at(out, ("model", "name"))):
        out["model"] = copy.deepcopy(given["model"])
    if _given_data(given) and not _given_data(out):
        out["data"] = copy.deepcopy(given["data"])
    old_t, new_t = _at(out, ("client", "transforms")), _at(given, ("client", "transforms"))
    if isinstance(old_t, list) and isinstance(new_t, list) and len(old_t) == len(new_t):
        for o, n in zip(old_t, new_t, strict=True):
            if _named_alone(o, n):
                o["options"] = copy.deepcopy(n.get("options", {}))
    return out


def server_step(cfg: Config) -> str | None:
    """The server step as a call (``Chain(transforms=[HeavyBall(beta=0.9), …])``) when
    it is an object, which holds its own step size (``server.lr`` is not applied);
    ``None`` when it is a named optimizer at ``server.lr``."""
    opt = cfg.server.optimizer
    return describe(opt.name, opt.options) if is_object(opt.name) else None


@dataclass(frozen=True)
class Components:
    """Objects that stand in for config sections; ``None``: built from the config."""

    aggregator: Any = None
    server: Any = None
    compressor: Any = None
    feedback: Any = None
    method: Any = None
    transforms: tuple[Any, ...] = ()  # more terms of the local step (client.transforms)
    selector: Any = None              # who trains in a round (cohort.selection)

    def into(self, cfg: Config) -> Config:
        """``cfg`` recording each given object (see the module docstring)."""
        r = dataclasses.replace
        if self.aggregator is not None:
            if cfg.server.lr == "auto" and self.server is None:
                raise ConfigError("server.lr: auto picks a registered aggregator's default "
                                  "step; with an aggregator object, give server.lr")
            cfg = r(cfg, aggregator=r(cfg.aggregator, name=object_name(self.aggregator),
                                      options=record(self.aggregator)))
        if self.server is not None:
            cfg = r(cfg, server=r(cfg.server, optimizer=r(cfg.server.optimizer,
                                                          name=object_name(self.server),
                                                          options=record(self.server))))
        if self.compressor is not None:
            cfg = r(cfg, compression=r(cfg.compression, name=object_name(self.compressor),
                                       options=record(self.compressor)))
        if self.feedback is not None:
            cfg = r(cfg, compression=r(cfg.compression, feedback=r(
                cfg.compression.feedback, name=object_name(self.feedback),
                options=record(self.feedback))))
        if self.method is not None:
            cfg = r(cfg, client=r(cfg.client, method=r(cfg.client.method,
                                                       name=object_name(self.method),
                                                       options=record(self.method))))
        if self.transforms:
            cfg = r(cfg, client=r(cfg.client, transforms=[
                {"name": object_name(t), "options": record(t)} for t in self.transforms]))
        if self.selector is not None:
            cfg = r(cfg, cohort=r(cfg.cohort, selection=r(cfg.cohort.selection,
                                                          name=object_name(self.selector),
                                                          options=record(self.selector))))
        return cfg

    def with_recorded(self, cfg: Config) -> Components:
        """These objects and, for each section of ``cfg`` that records an object and
        has none given here, that object rebuilt (:func:`fedloom.recorded.rebuild`; a
        record that cannot be rebuilt is one ConfigError line naming its field)."""
        # field -> (the object given, the section that may record one)
        sections: dict[str, tuple[Any, Any]] = {
            "aggregator": (self.aggregator, cfg.aggregator),
            "server": (self.server, cfg.server.optimizer),
            "compressor": (self.compressor, cfg.compression),
            "feedback": (self.feedback, cfg.compression.feedback),
            "method": (self.method, cfg.client.method),
            "selector": (self.selector, cfg.cohort.selection)}
        found: dict[str, Any] = {}
        try:
            for field, (obj, sec) in sections.items():
                if obj is None and is_object(sec.name):
                    found[field] = rebuild(sec.name, sec.options, ".".join(_SECTIONS[field]))
            ts = cfg.client.transforms
            if not self.transforms and any(is_object(t.get("name")) for t in ts):
                found["transforms"] = tuple(
                    rebuild(t["name"], t.get("options") or {}, f"client.transforms[{i}]")
                    if is_object(t["name"]) else
                    build_named("transform", t["name"], dict(t.get("options") or {}),
                                f"client.transforms[{i}].options")
                    for i, t in enumerate(ts))
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        return dataclasses.replace(self, **found) if found else self
