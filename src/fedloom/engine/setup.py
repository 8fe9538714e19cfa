"""The components of a run, built from its config.

:class:`Setup` builds every component of a run from its config section
(options passed by name, through the registry), refuses the combinations
that cannot work (:mod:`fedloom.engine.refusals`) and holds them for the
round's stages; it names no algorithm. The stages take it as their first
argument; :class:`fedloom.engine.experiment.Experiment` adds them as methods.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch

from fedloom.aggregate.base import default_server_lr, make_aggregator
from fedloom.attack import make_attack
from fedloom.buffers import check_buffers, module_buffers, random_in_train
from fedloom.capabilities import aggregator_caps, backend_close, method_caps
from fedloom.client.sgd import LocalSGD
from fedloom.compress import make_compressor
from fedloom.compress.feedback import feedback_from_config
from fedloom.compress.identity import Identity
from fedloom.config import Config, ConfigError, config_to_dict
from fedloom.data.feature import apply_feature_skew
from fedloom.data.federated import FederatedData, build_federated
from fedloom.data.heterogeneity import class_counts
from fedloom.data.sources import Dataset, load_dataset
from fedloom.device import (
    apply_threads,
    configure,
    describe,
    keep_freed_heap,
    reset_peak,
    resolve,
    to_device,
    to_host,
)
from fedloom.engine import refusals
from fedloom.engine.algorithm import Algorithm
from fedloom.engine.clientfields import BUFFERS, FEEDBACK, METHOD, ClientFields
from fedloom.engine.components import Components
from fedloom.engine.events import EventDriver
from fedloom.engine.parts import ClientData, HookView, ModelSpace, Schedule, ScreenRules
from fedloom.engine.runs.legacy import Fresh
from fedloom.engine.runstate import RunState
from fedloom.engine.stages.evaluation import Evaluator
from fedloom.engine.stages.screen import first_line
from fedloom.hooks import metric_hooks, planner_from_config
from fedloom.metrics import evaluate
from fedloom.models import build_model
from fedloom.params import Layout, training_mode
from fedloom.privacy import make_privacy
from fedloom.registry import NotImported, accepted_options, build, get
from fedloom.rng import Purpose, derive_seed, seeded_global_rng
from fedloom.state import ClientStateStore, FieldSpec
from fedloom.system import make_system

__all__ = ["Setup", "resolve_auto"]

log = logging.getLogger("fedloom")

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def resolve_auto(cfg: Config) -> Config:
    """``cfg`` with ``server.lr: auto`` replaced by the aggregator's public default
    step (:func:`~fedloom.aggregate.base.default_server_lr`); other configs as given.
    The run directory's ``config.yaml`` holds the number, so a rerun from it needs
    no default of this version."""
    cfg = _resolve_method_buffers(cfg)
    if cfg.server.lr != "auto":
        return cfg
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


def _check_output(module: torch.nn.Module, x: torch.Tensor, num_classes: int) -> None:
    try:
        # eval mode: no dropout draw, no BatchNorm statistic moved by the check
        with torch.no_grad(), training_mode(module, False):
            out = module(x)
    except Exception as e:  # the user's forward failed on one sample of the data
        raise ValueError(f"model: forward on one sample of shape {tuple(x.shape[1:])} failed: "
                         f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                         ) from None
    if out.ndim != 2 or out.shape[1] != num_classes:
        raise ValueError(f"model: outputs shape {tuple(out.shape[1:])} per sample, the data has "
                         f"{num_classes} classes")


def _to_run(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Index inputs (characters) stay integers; features take the run's dtype.
    return (t.to(dtype) if t.is_floating_point() else t).to(device)


class Setup:
    """A config turned into typed objects: data, model, trainer, aggregator, server.

    Building it validates everything that needs the data or the model (e.g. an
    aggregator option), so a bad run fails before any file is written.
    """

    def __init__(
        self,
        cfg: Config,
        *,
        state_dir: Path | None = None,
        data: Dataset | None = None,
        model: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
        components: Components | None = None,
        data_check: Callable[[Dataset], None] | None = None,
    ) -> None:
        # Component objects stand in for their config sections (recorded as
        # `object MODULE.CLASS`, fedloom.engine.components); the rest is built from cfg.
        # what close() puts back of the process-wide settings (_apply_process_settings)
        self._restore: list[Callable[[], None]] = []
        self.given = components or Components()
        cfg = resolve_auto(self.given.into(cfg))  # server.lr: auto → the rule's default step
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        # The device first: device=cuda without CUDA fails before any data is loaded.
        self.device = resolve(cfg.device)
        refusals.check_amp_dtype(cfg)
        self._build_data(data, data_check)
        self._build_model(model)
        self._build_training()
        self._build_server()
        self._build_uplink()
        self._build_state(state_dir)
        self._build_privacy()
        self._build_parts()
        self._apply_process_settings()

    # ------------------------------------------------------------------ building
    def _build_data(self, data: Dataset | None,
                    data_check: Callable[[Dataset], None] | None) -> None:
        cfg = self.cfg
        ds = data if data is not None else load_dataset(cfg.data, cfg.seed)
        if data_check is not None:
            # the run directory's check of the data as loaded (a resume on other data is
            # refused), before anything is built that writes into the directory
            data_check(ds)
        self.fed: FederatedData = build_federated(ds, cfg.data, cfg.seed)
        refusals.check_cohort_size(cfg, self.fed.num_clients)
        ds = self.fed.dataset
        self.x = _to_run(ds.x, self.dtype, self.device)
        self.y = ds.y.to(self.device)
        # Each client's whole part (train and its own test split): the heterogeneity
        # measures of summary.json and partition.png, and the rows its feature skew
        # (data.feature) transforms, once, on the run's device.
        parts = [np.concatenate([tr, te]) for tr, te in zip(self.fed.train, self.fed.test,
                                                             strict=True)]
        self.partition_counts = class_counts(ds.y.numpy(), parts, ds.num_classes)
        f = cfg.data.feature
        try:
            self.x = apply_feature_skew(self.x, parts, f.name, f.scale, cfg.seed)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.n_train = torch.from_numpy(self.fed.num_train())

    def _build_model(self, model: torch.nn.Module | Callable[[], torch.nn.Module] | None
                     ) -> None:
        cfg, ds = self.cfg, self.fed.dataset
        # model.pt: a module built from the config is rebuilt from it (load_model)
        self.model_from_config = model is None
        try:
            if model is None:
                self.module = build_model(cfg.model, ds.input_shape, ds.num_classes, cfg.seed,
                                          self.dtype).to(self.device)
            else:
                if isinstance(model, torch.nn.Module):
                    user = copy.deepcopy(model)
                else:  # what the factory draws from global RNGs comes from (seed, "init")
                    with seeded_global_rng(derive_seed(cfg.seed, -1, -1, Purpose.INIT)):
                        user = model()
                if not isinstance(user, torch.nn.Module):
                    raise ValueError("model: the factory must return a torch.nn.Module")
                self.module = user.to(self.dtype).to(self.device)
                _check_output(self.module, self.x[:1], ds.num_classes)
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        # Eval mode for evaluation; local training runs a train-mode copy (dropout,
        # batch statistics), its buffers under model.buffers (fedloom.buffers).
        self.module.eval()
        self.layout = Layout.from_module(self.module)
        self.buffer_template = module_buffers(self.module)
        try:
            self.random_forward = random_in_train(self.module, self.x[:8])
        except Exception as e:  # the user's forward, in train mode
            raise ConfigError(f"model: forward in train mode on {len(self.x[:8])} samples "
                              f"failed: {first_line(e)}") from None
        refusals.check_vmap_random(cfg.backend, self.random_forward)
        refusals.check_one_sample_batches(self.module, self.x, self.fed.num_train(),
                                        cfg.client.batch_size)

    def _build_training(self) -> None:
        cfg, c = self.cfg, self.cfg.client
        try:  # client.transforms: objects given, else built by name with their options
            transforms = self.given.transforms or tuple(
                build("transform", t["name"], dict(t.get("options") or {}),
                      f"client.transforms[{i}].options") for i, t in enumerate(c.transforms))
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        self.trainer = LocalSGD(
            self.module, self.layout, batch_size=c.batch_size, epochs=c.epochs, steps=c.steps,
            momentum=c.momentum, weight_decay=c.weight_decay, prox_mu=c.prox_mu, amp=c.amp,
            random_forward=self.random_forward, augment=self._augment(self.fed.dataset, cfg),
            transforms=tuple(transforms),
        )
        try:
            self.aggregator = (self.given.aggregator if self.given.aggregator is not None
                               else make_aggregator(cfg.aggregator.name,
                                                    **cfg.aggregator.options))
            # A method that names layers (FedPer's personal head, MOON's representation)
            # takes the model's Layout; one that needs the trainer's settings checks them.
            if self.given.method is not None:
                self.method = self.given.method
            else:
                extra = accepted_options(get("method", c.method.name), {"layout": self.layout})
                self.method = build("method", c.method.name, {**c.method.options, **extra},
                                    "client.method.options")
            self.method.check_trainer(self.trainer)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        refusals.check_full_participation(cfg, self.aggregator, self.fed.num_clients)
        # Simulated devices, deadlines and availability (system.*); None when off.
        self.system = make_system(cfg.system, cfg.seed, self.fed.num_clients, c.batch_size,
                                  cfg.cohort.size, full_participation=aggregator_caps(
                                      self.aggregator).full_participation)
        self.backend = get("backend", cfg.backend.name)(self.trainer, self.method, cfg.backend,
                                                        self.x, self.y)

    def _build_server(self) -> None:
        s = self.cfg.server
        # server.optimizer: a registered name, plug-in or module:attr, with its options;
        # its factory takes server.lr too when it names it.
        if self.given.server is not None:
            self.server = self.given.server
        else:
            lr = accepted_options(get("server_optimizer", s.optimizer.name), {"lr": s.lr})
            try:
                self.server = build("server_optimizer", s.optimizer.name,
                                    {**s.optimizer.options, **lr}, "server.optimizer.options")
            except ValueError as e:
                raise ConfigError(str(e).splitlines()[0]) from None
        self.requires = aggregator_caps(self.aggregator).requires

    def _build_uplink(self) -> None:
        cfg, comp = self.cfg, self.cfg.compression
        try:
            self.uplink = (self.given.compressor if self.given.compressor is not None
                           else make_compressor(comp.name, layout=self.layout, **comp.options))
            # Plug-ins behind protocols (fedloom.hooks): the engine calls them by role.
            self.feedback = (self.given.feedback if self.given.feedback is not None
                             else feedback_from_config(comp.feedback, self.layout))
            self.planner = planner_from_config(comp.adaptive)
            self.client_metrics = metric_hooks(cfg.metrics)
            # Byzantine clients (attack.*), for robustness experiments; None when off.
            self.attack = make_attack(cfg.attack, cfg.seed, self.fed.num_clients)
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        # The broadcast carries the same integrity trailer as the uplink (or none,
        # with compression.options.checksum=false, for byte-exact paper comparisons).
        self.downlink = Identity(checksum=bool(comp.options.get("checksum", True)))
        # The dense broadcast's size depends on d only: measure it once, not every round.
        self.downlink_size = len(self.downlink.encode(torch.zeros(self.layout.size)))

    def _build_state(self, state_dir: Path | None) -> None:
        cfg, d = self.cfg, self.layout.size
        # model.buffers=local (FedBN): each client's buffers, and whether it has any yet.
        own_buffers = cfg.model.buffers == "local" and bool(self.buffer_template)
        buffer_fields = ({"buffers": FieldSpec(sum(v.numel() for v in
                                                   self.buffer_template.values())),
                          "buffers_set": FieldSpec(1)} if own_buffers else {})
        try:
            self.fields = ClientFields({METHOD: self.method.fields(d),
                                        FEEDBACK: self.feedback.fields(d),
                                        BUFFERS: buffer_fields})
        except ValueError as e:
            raise ConfigError(f"client.method: {e}") from None
        self.store = ClientStateStore(
            self.fed.num_clients, self.fields.specs,
            storage=cfg.state.storage, dtype=cfg.state.dtype, directory=state_dir,
            memmap_above_mb=cfg.state.memmap_above_mb,
            compute_dtype=self.dtype,
        )

    def _build_privacy(self) -> None:
        # Differential privacy and secure aggregation refuse, with one line, what they
        # cannot cover (fedloom.privacy: the components' declared properties).
        cfg = self.cfg
        self.privacy = make_privacy(cfg, self.fed.num_clients)
        refusals.check_privacy_sampling(self.privacy, self.system)
        refusals.check_privacy_scope(cfg, self.privacy, aggregator=self.aggregator,
                                   feedback=self.feedback, method=self.method,
                                   compressor=self.uplink, w=self.layout.flatten(self.module))
        refusals.check_buffers_privacy(cfg, self.privacy, bool(self.buffer_template))
        refusals.check_event_mode(cfg, aggregator=self.aggregator, feedback=self.feedback,
                                privacy=self.privacy, num_clients=self.fed.num_clients)
        # The event-driven round modes (system.mode async, buffered); None: synchronous.
        self.events = (EventDriver(cfg.system, cfg.seed) if cfg.system.mode != "sync"
                       else None)

    def _build_parts(self) -> None:
        # The values the round's stages read (fedloom.engine.parts): each stage
        # takes the ones it needs, never this object.
        cfg, s = self.cfg, self.cfg.server
        self.space = ModelSpace(self.module, self.layout, self.buffer_template,
                                cfg.model.buffers, self.dtype, self.device)
        self.clients = ClientData(self.fed, self.x, self.y, self.store, self.fields)
        # cohort.selection: a registered selector, plug-in or module:attr with its options
        sel = cfg.cohort.selection
        try:
            selector = (self.given.selector if self.given.selector is not None
                        else build("selector", sel.name, dict(sel.options),
                                   "cohort.selection.options"))
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        refusals.check_selection_scope(cfg, selector, self.privacy)
        self.schedule = Schedule(cfg.seed, cfg.rounds, cfg.cohort.size, self.fed.num_clients,
                                 cfg.client, self.system, selector)
        self.rules = ScreenRules(s.max_update_norm, s.max_norm_ratio, s.clip_norm,
                                 private=self.privacy.enabled)
        self.x_test = _to_run(self.fed.x_test, self.dtype, self.device)
        self.y_test = self.fed.y_test.to(self.device)
        self.evaluator = Evaluator(self.space, self.clients, self.x_test, self.y_test, cfg.eval,
                                   seed=cfg.seed, local=self.trainer, method=self.method,
                                   client_lr=cfg.client.lr)

    @property
    def algorithm(self) -> Algorithm:
        """The run's algorithm as a value (:class:`~fedloom.engine.algorithm.Algorithm`),
        of the components held now (a test may swap one in)."""
        return Algorithm(self.trainer, self.method, self.uplink, self.feedback, self.planner,
                         self.aggregator, self.server)

    @property
    def hook_view(self) -> HookView:
        """What a round planner or client-metric plug-in reads (:mod:`fedloom.hooks`)."""
        return HookView(self.cfg, self.layout, self.fed, self.x, self.y, self.trainer,
                        self.global_eval, self.make_uplink)

    @property
    def last_client_acc(self) -> np.ndarray | None:
        """Per-client accuracies of the last evaluation (``client_acc.json``)."""
        return self.evaluator.last.client_acc

    @property
    def last_personal_acc(self) -> np.ndarray | None:
        """Per-client accuracies of the personal models at the last evaluation."""
        return self.evaluator.last.personal_acc

    def _apply_process_settings(self) -> None:
        # Process-wide settings, last (nothing before can fail after them); close()
        # puts the previous ones back. Determinism and TF32 off on CUDA
        # (fedloom.device.configure); backend.threads for the process that trains
        # (process and ray workers set their own).
        self._restore.append(configure(self.device))
        in_process = self.cfg.backend.name not in ("process", "ray")
        self.threads, undo = apply_threads(self.cfg.backend.threads if in_process else 0)
        if in_process and self.cfg.backend.keep_heap:
            # not put back by close(): glibc cannot return to its moving thresholds
            keep_freed_heap()
        self._restore.append(undo)
        reset_peak(self.device)
        info = describe(self.device)
        log.info("device %s (%s, %.1f GB), %d threads", info["device"], info["device_name"],
                 info["device_memory_gb"], self.threads)

    @staticmethod
    def _augment(ds: Dataset, cfg: Config) -> Any:
        """The training augmentation of ``data.augment`` for this source (None: none)."""
        from fedloom.data.augment import make_augment

        try:
            return make_augment(ds.augment, cfg.data.augment)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    # ------------------------------------------------------------------ rounds
    def initial_state(self) -> RunState:
        w = self.layout.flatten(self.module).to(self.dtype)
        s = self.algorithm.init(w, self.layout)
        # Every server state on the run's device (an aggregator's init knows no device).
        return to_device(RunState(0, w, s.opt, s.agg, method_state=s.method,
                                  feedback_state=s.feedback,
                                  w_avg=w.clone() if self.cfg.eval.average_iterates else None,
                                  privacy_state=self.privacy.init(),
                                  # the initial buffers, not the module's: evaluation
                                  # loads each round's buffers into the module
                                  buffers={n: v.clone()
                                           for n, v in self.buffer_template.items()},
                                  selection_state=self.schedule.initial_selection()),
                         self.device)

    def sample_cohort(self, r: int) -> torch.Tensor:
        """``cohort.size`` distinct clients, uniformly, from the round's own generator
        (:meth:`~fedloom.engine.parts.Schedule.sample_cohort`)."""
        return self.schedule.sample_cohort(r)

    def lr(self, r: int) -> float:
        """Round ``r``'s local step size (``client.lr`` under ``client.schedule``)."""
        return self.schedule.lr(r)

    # ------------------------------------------------------------- for hooks
    def global_eval(self, w: torch.Tensor) -> tuple[float, float]:
        """``(accuracy, loss)`` of ``w`` on the global test set only (for hooks)."""
        return evaluate(self.module, self.layout, w, self.x_test, self.y_test,
                        self.cfg.eval.batch_size)

    def make_uplink(self, **options: Any) -> Any:
        """The configured compressor with ``options`` replacing the section's (for hooks)."""
        if self.given.compressor is not None:
            raise ConfigError("compression: a round planner rebuilds the compressor with other "
                              "options; give it by name (compression.name), not as an object")
        opts = {**self.cfg.compression.options, **options}
        return make_compressor(self.cfg.compression.name, layout=self.layout, **opts)

    def close(self) -> None:
        """Stop the backend's workers, if it has any; put back the process-wide
        settings the run changed (threads, CUDA determinism flags)."""
        backend_close(self.backend)()
        while self._restore:
            self._restore.pop()()

    # ------------------------------------------------------------- checkpoints
    def checkpoint_state(self, st: RunState, snapshot_dir: Path | None = None
                         ) -> dict[str, Any]:
        """The checkpoint of ``st``; memmap state fields are copied to files in
        ``snapshot_dir`` (tagged with the round) instead of into the dict. Tensors
        are saved as CPU tensors, whatever the run's device."""
        return {
            "format": 1,
            "next_round": st.next_round,
            "w": to_host(st.w),
            "opt_state": to_host(st.opt_state),
            "agg_state": to_host(st.agg_state),
            "method_state": to_host(st.method_state),
            "feedback_state": to_host(st.feedback_state),
            "w_avg": to_host(st.w_avg),
            "totals": st.totals,
            "sim_time_s": st.sim_time_s,
            "privacy_state": to_host(st.privacy_state),
            "buffers": to_host(st.buffers),  # the global module buffers (fedloom.buffers)
            "events": to_host(st.events),    # in flight (fedloom.engine.events)
            "selection_state": st.selection_state,  # the client selector's (host) state
            "store": self.store.state_dict(snapshot_dir, tag=f"r{st.next_round}"),
            "config": config_to_dict(self.cfg),
        }

    def fresh(self) -> Fresh:
        """What this run starts with, for the entries a checkpoint of an earlier
        version lacks (:func:`fedloom.engine.runs.legacy.current_layout`)."""
        return Fresh(has_buffers=bool(self.buffer_template), opt_state=self.server.init,
                     privacy_state=self.privacy.init,
                     selection_state=self.schedule.initial_selection)

    def restore(self, ckpt: dict[str, Any], snapshot_dir: Path | None = None) -> RunState:
        """The run state of checkpoint ``ckpt``, in this version's layout (one of an
        earlier version is read through :func:`fedloom.engine.runs.legacy.current_layout`
        first)."""
        bufs = ckpt["buffers"]
        why = check_buffers(bufs, self.buffer_template)
        if why is not None:
            raise ValueError(f"'buffers' is {why}")
        self.store.load_state_dict(ckpt["store"], snapshot_dir)
        state = ckpt["selection_state"]
        if not isinstance(state, dict):
            raise ValueError(f"'selection_state' is a {type(state).__name__}, not a mapping")
        # Loaded on the CPU (map_location), continued on the run's device.
        return to_device(RunState(ckpt["next_round"], ckpt["w"], ckpt["opt_state"],
                                  ckpt["agg_state"], ckpt["method_state"],
                                  ckpt["feedback_state"], ckpt["w_avg"], dict(ckpt["totals"]),
                                  float(ckpt["sim_time_s"]),
                                  privacy_state=self.privacy.checked_state(
                                      ckpt["privacy_state"]),
                                  # check_buffers passed: the mapping the template needs
                                  buffers=cast("dict[str, torch.Tensor]", bufs),
                                  events=dict(ckpt["events"]),
                                  selection_state=dict(state)),
                         self.device)
