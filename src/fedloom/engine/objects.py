"""Component objects given in Python instead of by name in the config.

A user who holds an aggregator, server optimizer, compressor, feedback policy,
local method, local-step transforms or client selector as objects (``CRAFT(step="rprop")``, a
class of their own) passes them to :func:`fedloom.run` or
:meth:`~fedloom.engine.experiment.Experiment.from_config`; the engine uses each where it would have
built one from the config's name. :meth:`Components.into` records each given
object in the config as ``object MODULE.CLASS`` (its options are the object's
own), so ``config.yaml``, the summary and every message name what ran, and a
resume with another kind of object is refused as a config change. Options of
an object's config section are not read (they belong to the object), nor is
``server.lr: auto``, which picks a registered rule's default step: with an
aggregator object, give ``server.lr``; nor a method's buffer policy (FedBN keeps
each client's buffers): with such a method object, set ``model.buffers`` yourself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fedloom.config import Config, ConfigError

__all__ = ["OBJECT_PREFIX", "Components", "moved_objects", "object_name"]

# A space, so that the name can never be a registry name or a `module:attr` reference.
OBJECT_PREFIX = "object "

# Classes of fedloom that moved since a run directory may have recorded them: the
# server optimizer's old name → its new one (ServerOptimizer left fedloom.aggregate
# for fedloom.server_opt; the chain of server transforms became the one chain of
# fedloom.transforms).
_MOVED = {
    "object fedloom.aggregate.server_opt.ServerOptimizer":
        "object fedloom.server_opt.optimizers.ServerOptimizer",
    "object fedloom.server_opt.transforms.Chain": "object fedloom.transforms.Chain",
}


def object_name(obj: object) -> str:
    """``object MODULE.CLASS``: how the config records a component given as an object."""
    return f"{OBJECT_PREFIX}{type(obj).__module__}.{type(obj).__qualname__}"


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
        """``cfg`` naming each given object (see the module docstring)."""
        r = dataclasses.replace
        if self.aggregator is not None:
            if cfg.server.lr == "auto":
                raise ConfigError("server.lr: auto picks a registered aggregator's default "
                                  "step; with an aggregator object, give server.lr")
            cfg = r(cfg, aggregator=r(cfg.aggregator, name=object_name(self.aggregator),
                                      options={}))
        if self.server is not None:
            cfg = r(cfg, server=r(cfg.server, optimizer=r(cfg.server.optimizer,
                                                          name=object_name(self.server),
                                                          options={})))
        if self.compressor is not None:
            cfg = r(cfg, compression=r(cfg.compression, name=object_name(self.compressor),
                                       options={}))
        if self.feedback is not None:
            cfg = r(cfg, compression=r(cfg.compression, feedback=r(
                cfg.compression.feedback, name=object_name(self.feedback), options={})))
        if self.method is not None:
            cfg = r(cfg, client=r(cfg.client, method=r(cfg.client.method,
                                                       name=object_name(self.method),
                                                       options={})))
        if self.transforms:
            cfg = r(cfg, client=r(cfg.client, transforms=[
                {"name": object_name(t), "options": {}} for t in self.transforms]))
        if self.selector is not None:
            cfg = r(cfg, cohort=r(cfg.cohort, selection=r(cfg.cohort.selection,
                                                          name=object_name(self.selector),
                                                          options={})))
        return cfg
