"""Where a config becomes values: the one place a :class:`~fedloom.config.Config`
turns into ``(Algorithm, Federation, Runtime, model)``, and back.

:func:`build` loads the data, builds the model and every component of the config
(by registry name with its options, or the objects given in Python,
:class:`~fedloom.engine.objects.Components`), with ``server.lr: auto``
resolved (:func:`resolve_auto`); :meth:`fedloom.engine.experiment.Experiment.from_config`,
:func:`fedloom.run`, the sweep, the CLI and Flower reach the values through it.
:func:`describe` is the other way: the config that records an experiment built
of values (``config.yaml``, a checkpoint's config, the names in a refusal).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast

import torch

from fedloom.aggregate.base import default_server_lr, make_aggregator, resolve_options
from fedloom.aggregate.pre import build_chain
from fedloom.capabilities import method_caps
from fedloom.compress import make_compressor
from fedloom.compress.feedback import feedback_from_config
from fedloom.config import (
    ClientConfig,
    CohortConfig,
    Config,
    ConfigError,
    EvalConfig,
    ModelConfig,
    ServerConfig,
)
from fedloom.data.sources import Dataset, load_dataset
from fedloom.device import resolve
from fedloom.engine import refusals
from fedloom.engine.given import from_record
from fedloom.engine.inputs import ScreenRules
from fedloom.engine.objects import Components, object_name
from fedloom.engine.values import Algorithm, Federation, LocalUpdate, Runtime
from fedloom.hooks import ClientMetric, metric_hooks, planner_from_config
from fedloom.models import build_model
from fedloom.params import Layout
from fedloom.privacy import resolve_noise
from fedloom.recorded import is_object
from fedloom.registry import NotImported, accepted_options, get
from fedloom.registry import build as build_named
from fedloom.rng import Purpose, derive_seed, seeded_global_rng
from fedloom.selection import Selector

__all__ = ["Built", "build", "describe", "resolve_auto"]

Model = torch.nn.Module | Callable[[], torch.nn.Module]


@dataclass(frozen=True)
class Built:
    """A config as values, with what an experiment takes beside them."""

    algorithm: Algorithm
    federation: Federation
    runtime: Runtime
    model: torch.nn.Module        # in the run's dtype, on its device
    evaluation: EvalConfig
    rounds: int
    hooks: tuple[ClientMetric, ...]
    record: Config                # the config as resolved (server.lr a number)
    model_from_config: bool       # model.pt: rebuilt from the config (load_model)


def resolve_auto(cfg: Config) -> Config:
    """``cfg`` with ``server.lr: auto`` replaced by the aggregator's public default
    step (:func:`~fedloom.aggregate.base.default_server_lr`) and the aggregator options
    its defaults decide written out (:func:`~fedloom.aggregate.base.resolve_options`);
    other configs as given.
    The run directory's ``config.yaml`` holds the number, so a rerun from it needs
    no default of this version."""
    cfg = _resolve_method_buffers(cfg)
    cfg = resolve_noise(cfg)  # privacy.noise_multiplier: auto -> the noise solved
    # the options this version's defaults decide, written out (CRAFT's step: issue 54)
    options = resolve_options(cfg.aggregator.name, cfg.aggregator.options)
    if options != dict(cfg.aggregator.options):
        cfg = dataclasses.replace(cfg, aggregator=dataclasses.replace(cfg.aggregator,
                                                                      options=options))
    if cfg.server.lr != "auto":
        return cfg
    if is_object(cfg.aggregator.name):  # no registered rule to take the default of
        if is_object(cfg.server.optimizer.name):
            return cfg  # nor a step to take it: a server step object holds its own
        raise ConfigError("server.lr: auto picks a registered aggregator's default step; "
                          "with an aggregator object, give server.lr")
    try:
        lr = default_server_lr(cfg.aggregator.name, cfg.aggregator.options)
    except NotImported:
        return cfg  # read as data (registry.no_imports): a plug-in's step stays auto
    except (KeyError, ValueError) as e:
        raise ConfigError(f"server.lr: auto: {e.args[0] if e.args else e}") from None
    return dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, lr=lr))


def _resolve_method_buffers(cfg: Config) -> Config:
    """A local method that *is* a buffer policy (FedBN: ``model_buffers = "local"``
    in the capabilities of its factory) sets ``model.buffers`` to it; a config asking
    for another policy than the default is refused, one line."""
    try:
        want = method_caps(get("method", cfg.client.method.name)).model_buffers
    except KeyError:
        return cfg  # an unknown method is reported where it is built
    if want is None or cfg.model.buffers == want:
        return cfg
    if cfg.model.buffers != "average":
        raise ConfigError(f"model.buffers: client.method {cfg.client.method.name!r} keeps "
                          f"buffers {want!r}, not {cfg.model.buffers!r}")
    # model_buffers is a plain str in MethodCaps: one of ModelConfig.buffers' values
    # (the check above leaves only "local" and "keep_global" from the built-ins)
    buffers = cast('Literal["average", "local", "keep_global"]', want)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, buffers=buffers))


def build(cfg: Config, *, data: Dataset | None = None, model: Model | None = None,
          components: Components | None = None,
          data_check: Callable[[Dataset], None] | None = None) -> Built:
    """The values of ``cfg``: ``data``/``model`` replace the configured source and
    model (a module is copied: the run trains its own; a factory is called with the
    global RNGs seeded from ``(seed, "init")``), ``components`` the named
    components; ``data_check`` sees the data as loaded, before anything else."""
    # objects recorded in cfg (a rerun of a run directory's config.yaml) rebuilt
    given = (components or Components()).with_recorded(cfg)
    cfg = resolve_auto(given.into(cfg))  # server.lr: auto → the rule's default step
    runtime = Runtime(cfg.backend.name, cfg.device, cfg.backend.threads, cfg.dtype, cfg.seed,
                      dict(cfg.backend.options), cfg.state, cfg.backend.keep_heap)
    # The device first: device=cuda without CUDA fails before any data is loaded.
    device = resolve(cfg.device)
    refusals.check_amp_dtype(cfg)
    # a model or data given in Python to the run that recorded cfg, rebuilt (a rerun)
    model, data = from_record(cfg, model, data)
    ds = data if data is not None else load_dataset(cfg.data, cfg.seed)
    if data_check is not None:
        # the run directory's check of the data as loaded (a resume on other data is
        # refused), before anything is built that writes into the directory
        data_check(ds)
    module = _module(cfg, ds, model, runtime.torch_dtype, device)
    federation = Federation(ds, cfg.data, cfg.cohort.size, _selector(cfg, given),
                            cfg.system, cfg.attack)
    algorithm = _algorithm(cfg, given, Layout.from_module(module))
    return Built(algorithm, federation, runtime, module, cfg.eval, cfg.rounds,
                 tuple(_hooks(cfg)), cfg, model is None)


def _module(cfg: Config, ds: Dataset, model: Model | None, dtype: torch.dtype,
            device: torch.device) -> torch.nn.Module:
    try:
        if model is None:
            return build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.seed,
                               dtype).to(device)
        if isinstance(model, torch.nn.Module):
            user = copy.deepcopy(model)
        else:  # what the factory draws from global RNGs comes from (seed, "init")
            with seeded_global_rng(derive_seed(cfg.seed, -1, -1, Purpose.INIT)):
                user = model()
        if not isinstance(user, torch.nn.Module):
            raise ValueError("model: the factory must return a torch.nn.Module")
        return user.to(dtype).to(device)
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _algorithm(cfg: Config, given: Components, layout: Layout) -> Algorithm:
    """Every component of the algorithm, given or built by name on ``layout``."""
    c, comp, s = cfg.client, cfg.compression, cfg.server
    try:  # client.transforms: objects given, else built by name with their options
        transforms = given.transforms or tuple(
            build_named("transform", t["name"], dict(t.get("options") or {}),
                        f"client.transforms[{i}].options") for i, t in enumerate(c.transforms))
        # a rule that draws (FLAME's noise) takes the run's seed, as a step does
        seeded = ({} if given.aggregator is not None or is_object(cfg.aggregator.name) else
                  accepted_options(get("aggregator", cfg.aggregator.name), {"seed": cfg.seed}))
        aggregator = (given.aggregator if given.aggregator is not None
                      else make_aggregator(cfg.aggregator.name,
                                           **{**cfg.aggregator.options, **seeded}))
        # server.pre_aggregation: steps on the rows before the rule (NNM, bucketing)
        aggregator = build_chain(aggregator, s.pre_aggregation, cfg.seed)
        # A method that names layers (FedPer's personal head, MOON's representation)
        # takes the model's Layout.
        if given.method is not None:
            method = given.method
        else:
            extra = accepted_options(get("method", c.method.name), {"layout": layout})
            method = build_named("method", c.method.name, {**c.method.options, **extra},
                                 "client.method.options")
        # server.optimizer: a registered name, plug-in or module:attr, with its
        # options; its factory takes server.lr too when it names it.
        if given.server is not None:
            server = given.server
        else:
            lr = accepted_options(get("server_optimizer", s.optimizer.name), {"lr": s.lr})
            server = build_named("server_optimizer", s.optimizer.name,
                                 {**s.optimizer.options, **lr}, "server.optimizer.options")
        compressor = (given.compressor if given.compressor is not None
                      else make_compressor(comp.name, layout=layout, **comp.options))
        feedback = (given.feedback if given.feedback is not None
                    else feedback_from_config(comp.feedback, layout))
        planner = planner_from_config(comp.adaptive)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    local = LocalUpdate(c.lr, c.momentum, c.weight_decay, c.batch_size, c.epochs, c.steps,
                        c.prox_mu, c.amp, c.schedule, tuple(transforms))
    return Algorithm(local, method, compressor, feedback, planner, aggregator, server,
                     ScreenRules(s.max_update_norm, s.max_norm_ratio, s.clip_norm),
                     cfg.privacy, s.secure_aggregation, cfg.model.buffers,
                     bool(comp.options.get("checksum", True)))


def _selector(cfg: Config, given: Components) -> Selector:
    # cohort.selection: a registered selector, plug-in or module:attr with its options
    if given.selector is not None:
        return given.selector
    sel = cfg.cohort.selection
    try:
        return build_named("selector", sel.name, dict(sel.options), "cohort.selection.options")
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _hooks(cfg: Config) -> list[ClientMetric]:
    try:
        return metric_hooks(cfg.metrics)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def describe(algorithm: Algorithm, federation: Federation, runtime: Runtime,
             model: torch.nn.Module, evaluation: EvalConfig, rounds: int) -> Config:
    """The config that records an experiment of values: their settings, and each
    component as ``object MODULE.CLASS`` (:mod:`fedloom.engine.objects`);
    a component left ``None`` keeps the schema's default name."""
    a, loc = algorithm, algorithm.local
    client = ClientConfig(lr=loc.lr, momentum=loc.momentum, weight_decay=loc.weight_decay,
                          batch_size=loc.batch_size, epochs=loc.epochs, steps=loc.steps,
                          prox_mu=loc.prox_mu, schedule=loc.schedule, amp=loc.amp)
    rules = a.screening
    server = ServerConfig(lr=1.0, max_update_norm=rules.max_update_norm,
                          max_norm_ratio=rules.max_norm_ratio, clip_norm=rules.clip_norm,
                          secure_aggregation=a.secure_aggregation)
    cfg = Config(seed=runtime.seed, rounds=rounds, device=runtime.device,
                 backend=runtime.backend_settings, dtype=runtime.dtype,
                 data=dataclasses.replace(federation.split, name=federation.data.name),
                 model=ModelConfig(name=object_name(model), buffers=a.buffers),
                 cohort=CohortConfig(size=federation.cohort), client=client, server=server,
                 eval=evaluation, state=runtime.state, attack=federation.attack,
                 system=federation.system_settings, privacy=a.privacy)
    if not a.checksum:
        cfg.compression.options["checksum"] = False
    return Components(aggregator=a.aggregator, server=a.server, compressor=a.compressor,
                      feedback=a.feedback, method=a.method, transforms=loc.transforms,
                      selector=federation.selector).into(cfg)
