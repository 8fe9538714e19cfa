"""The round loop.

One round, in order: sample the cohort → gather its per-client state → train
the cohort (backend) → [privacy.mode=local: clip and noise each update] →
screen the updates (client side) → uplink: encode → decode and stack → screen
the rows (server side) → clip (norm bounding) → aggregate [privacy.mode=central:
DP-FedAvg's clipped, noised sum instead; :mod:`fedloom.privacy`] → server
optimizer step → check the step → scatter per-client state back → evaluate
(on schedule) → log → checkpoint (on schedule). The engine
holds no math; each step is one call.

What never reaches the model (each counted in the round's metrics, the run's
totals and the summary, and logged):

- **Rejected updates** (``rejected_updates``, ids in ``rejected_clients``,
  reasons in ``rejected_reasons``). A client is rejected, for the round only,
  when its update is non-finite, cannot be encoded or decoded (a
  :class:`~fedloom.compress.base.PayloadError`, ``ValueError`` or overflow
  from its compressor: the run goes on), holds a non-finite state row, or
  fails :func:`screen_updates` (``server.max_update_norm``,
  ``server.max_norm_ratio``). The rules run twice: on the dense update before
  encoding (a client never sends what the server would refuse, and a huge
  value in a coordinate a sparsifier leaves out is still seen), and on the
  decoded row the aggregator would receive (the server's own check, the one
  that holds for deployed clients too). A rejected client is treated as one
  whose worker failed: nothing of it is aggregated and its state rows stay as
  they were.
- **Clipped updates** (``clipped_updates``): with ``server.clip_norm`` every
  accepted row is scaled to at most that norm before any aggregator
  (:func:`clip_rows`), so it composes with every rule and compressor.
- **Rejected rounds** (``rejected_rounds``, reason in
  ``rejected_round_reason``): the aggregator raised (a ``LinAlgError`` or any
  ``RuntimeError``/``ValueError``/``ArithmeticError``), or returned a
  direction that is not a finite vector of the model's size, or the server
  optimizer's step, the feedback policy's shift or the new server states are
  not finite. The round's step is skipped: the model, the server optimizer's
  state, the aggregator's state, the feedback policy's server state (SA-PEF's
  ``L̂``, SCAFCOM's ``c``), the local method's server state and every client's
  state rows (EF residuals, EF21's ``h_k``, SCAFFOLD/SCAFCOM control variates,
  Ditto's personal models, FedBN's buffers) and the global module buffers
  (BatchNorm statistics) are exactly those before the round — a resumed run
  is bit-identical to an uninterrupted one through it. What the round did
  happen is kept: its bytes (``uplink_bytes``/``downlink_bytes``), its counts,
  and the running iterate average (``eval.average_iterates``), which averages
  the unchanged model as that round's iterate so it stays the mean of
  ``w_0 … w_{r+1}``. Departure for the Flower integration
  (``client_state=False``): the clients hold their own state and have already
  updated it when they sent; the server cannot undo that, so there a rejected
  round leaves the clients' residuals (and, under ``model.buffers=local``,
  their own buffers) as the clients wrote them.

:func:`run` is the entry point of both the CLI and notebooks.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from fedloom.aggregate.base import CohortInfo, default_server_lr, make_aggregator
from fedloom.attack import make_attack
from fedloom.buffers import (
    average_buffers,
    buffers_sha256,
    check_buffers,
    flatten_buffers,
    has_batch_statistics,
    load_buffers,
    module_buffers,
    random_in_train,
    trains_on_one_sample,
    unflatten_buffers,
)
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD, lr_at_round
from fedloom.compress import coordinates_sent, make_compressor
from fedloom.compress.feedback import UplinkContext, UplinkResult, feedback_from_config
from fedloom.compress.identity import Identity
from fedloom.config import Config, ConfigError, config_to_dict, load_config
from fedloom.data.federated import FederatedData, build_federated
from fedloom.data.sources import Dataset, load_dataset
from fedloom.device import (
    apply_threads,
    configure,
    describe,
    peak_memory_mb,
    reset_peak,
    resolve,
    to_device,
    to_host,
)
from fedloom.engine.checkpoint import (
    LOCK_FILE,
    CheckpointError,
    RunDirError,
    atomic_write_bytes,
    atomic_write_json,
    load_checkpoint,
    lock_run_dir,
    remove_leftovers,
    save_checkpoint,
)
from fedloom.engine.runlog import (
    METRICS_CSV_FILE,
    TENSORBOARD_DIR,
    MetricsCSV,
    TensorBoardSink,
)
from fedloom.hooks import RoundAdjust, metric_hooks, planner_from_config
from fedloom.metrics import accuracy_stats, conflict_rate, evaluate, evaluate_clients
from fedloom.models import build_model
from fedloom.params import Layout, training_mode
from fedloom.privacy import check_privacy, check_secure_aggregation, make_privacy
from fedloom.registry import accepted_options, build, get
from fedloom.rng import Purpose, derive_seed, numpy_gen, seeded_global_rng, torch_gen
from fedloom.state import ClientStateStore, FieldSpec
from fedloom.system import make_system

__all__ = ["Experiment", "Result", "RunState", "clip_rows", "model_sha256", "run",
           "screen_updates"]

log = logging.getLogger("fedloom")

_DTYPES = {"float32": torch.float32, "float64": torch.float64}
_NO_DATA = torch.empty(0)


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


def _finite_rows(rows: torch.Tensor) -> torch.Tensor:
    """Which rows hold only finite numbers. A row sum is NaN or ±inf when the row
    holds one (one pass, no m × d mask); only rows whose sum is not finite — a
    non-finite entry or a finite overflow — are checked entry by entry."""
    ok = torch.isfinite(rows.sum(dim=1))
    for i in (~ok).nonzero().flatten().tolist():
        ok[i] = bool(torch.isfinite(rows[i]).all())
    return ok


def _row_norms(rows: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each row (a matrix) or vector (a sequence), as float64.

    One pass in the rows' own dtype; a norm whose squares overflowed there
    (``inf``: a float32 row of 1e30 entries) or may have underflowed (below
    1e-18) is recomputed in float64, so a huge finite row has its finite norm.
    A row holding NaN or ±inf has a NaN or infinite norm.
    """
    if isinstance(rows, torch.Tensor):
        n = (torch.linalg.vector_norm(rows, dim=1).double() if rows.shape[0]
             else torch.zeros(0, dtype=torch.float64))
    else:
        n = torch.tensor([float(torch.linalg.vector_norm(r)) for r in rows], dtype=torch.float64)
    for i in (torch.isinf(n) | (n < 1e-18)).nonzero().flatten().tolist():
        n[i] = float(torch.linalg.vector_norm(rows[i], dtype=torch.float64))
    return n


def screen_updates(norms: torch.Tensor, ok: torch.Tensor, *, max_norm: float | None,
                   max_ratio: float | None) -> dict[int, str]:
    """Which of the cohort's updates to reject for their size; returns
    ``{position: reason}`` for the positions of ``ok`` (the updates still in) that fail.

    With ``n_k = ‖u_k‖₂`` (``norms``), reject ``k`` when

    - ``n_k > max_norm`` (an absolute bound, ``server.max_update_norm``), or
    - ``n_k > max_ratio · med``, ``med`` the **lower median** of the positive
      ``n_j`` of the accepted updates (``server.max_norm_ratio``). The lower
      median (the ⌈m/2⌉-th smallest) cannot be moved up by fewer than half of
      the cohort, so one huge update is caught even in a cohort of two; zero
      updates (nothing to send) do not pull it down, and a cohort with no
      positive norm has nothing to judge.

    The relative rule is the median-based outlier test of robust aggregation
    (the norm filter of e.g. Sun et al. 2019 uses an absolute bound; a ratio
    to the cohort needs no knowledge of the model's scale).

    Default ``1e4`` (``server.max_norm_ratio``), from the largest ratio
    ``max_k n_k / med`` measured on the reproduction configs, on the dense
    update before encoding (the stricter of the two checks) / on the decoded
    row: ``configs/quickstart.yaml`` 30 rounds 2.7 / 2.7; ``craft/synthetic``
    30 rounds 6.5 / 6.5; ``craft/mnist`` 3 rounds 2.1; ``craft/fmnist`` with
    CRAFT (MNIST data) 20 rounds 1.7; ``sapef/mnist`` with SA-PEF 10 rounds
    2.4 / 2.3; ``sapef/fmnist`` (MNIST data) with EF 2.1 / 2.4 and SCAFCOM
    1.7 / 1.7, 20 rounds; ``flare/composed`` 60 rounds 26 / 13;
    ``flare/mnist`` with 3 clients a round and FLARE, seed 0 (100 rounds) and
    seed 1 (300 rounds): 234 / 26 and 211 / 23 (in one early round each,
    round 2 and round 4; every other round ≤ 1.5), with 5 clients, seed 2,
    300 rounds 1.6 / 3.1; with EF, EF21 and EC+prox (3 clients, 300 rounds)
    ≤ 1.4 / 1.6; the activation-less model with 7 clients 1.7 / 1.7. The
    default is 43× the largest (FLARE's) and far below what breaks a run: a
    1e30 update is rejected whatever the cohort.
    """
    out: dict[int, str] = {}
    pos = ok.nonzero().flatten().tolist()
    if max_norm is not None:
        for i in pos:
            if float(norms[i]) > max_norm:
                out[i] = f"norm {float(norms[i]):.3g} above server.max_update_norm={max_norm:g}"
    if max_ratio is not None:
        positive = sorted(float(norms[i]) for i in pos if float(norms[i]) > 0)
        if positive:
            med = positive[(len(positive) - 1) // 2]
            for i in pos:
                if i not in out and float(norms[i]) > max_ratio * med:
                    out[i] = (f"norm {float(norms[i]):.3g} above server.max_norm_ratio="
                              f"{max_ratio:g} x the cohort's median norm {med:.3g}")
    return out


def clip_rows(rows: torch.Tensor, norms: torch.Tensor, ok: torch.Tensor,
              bound: float) -> int:
    """Norm bounding: ``u_k ← u_k · min(1, M / ‖u_k‖₂)`` in place for the rows
    ``ok``; returns how many were scaled.

    Sun et al., "Can You Really Backdoor Federated Learning?" (2019), §4: the
    server clips every update to a norm ``M`` before averaging, which bounds
    what any one client (a backdoor, a diverged one) can move the model. Here
    it is applied to each decoded row before any aggregator, so it composes
    with CRAFT, every other rule and every compressor. The direction is kept;
    the clipped norm equals ``M`` up to the rows' dtype rounding: ``norms`` may
    come from a float32 pass (relative error ~1e-6 at d = 2e5), so a row near
    or above the bound has its norm recomputed in float64 before it is scaled.
    """
    n = 0
    for i in ok.nonzero().flatten().tolist():
        if float(norms[i]) <= bound * (1 - 1e-4):
            continue
        v = float(torch.linalg.vector_norm(rows[i], dtype=torch.float64))
        if v > bound:
            rows[i].mul_(bound / v)
            n += 1
    return n


def _non_finite_reason(v: torch.Tensor) -> str:
    """Why a vector with a non-finite norm is refused."""
    if bool(_finite_rows(v.reshape(1, -1))[0]):
        return "norm overflows float64 (finite entries)"
    return "non-finite update"


def _all_finite(x: Any) -> bool:
    """Every tensor in ``x`` (a tensor, or nested dicts/lists/tuples/dataclass
    fields of them) is finite; other values are not checked."""
    if isinstance(x, torch.Tensor):
        return not x.is_floating_point() or bool(torch.isfinite(x).all())
    if isinstance(x, dict):
        return all(_all_finite(v) for v in x.values())
    if isinstance(x, list | tuple):
        return all(_all_finite(v) for v in x)
    if hasattr(x, "__dataclass_fields__"):
        return all(_all_finite(getattr(x, f)) for f in x.__dataclass_fields__)
    return True


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def model_sha256(w: torch.Tensor) -> str:
    """SHA-256 of the flat parameter vector's bytes (its own dtype, C order)."""
    return hashlib.sha256(w.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def resolve_auto(cfg: Config) -> Config:
    """``cfg`` with ``server.lr: auto`` replaced by the aggregator's public default
    step (:func:`~fedloom.aggregate.base.default_server_lr`); other configs as given.
    The run directory's ``config.yaml`` holds the number, so a rerun from it needs
    no default of this version."""
    if cfg.server.lr != "auto":
        return cfg
    try:
        lr = default_server_lr(cfg.aggregator.name)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"server.lr: auto: {e.args[0] if e.args else e}") from None
    return dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, lr=lr))


@dataclass
class RunState:
    """Everything a round changes; a checkpoint is this plus the state store."""

    next_round: int
    w: torch.Tensor
    opt_state: dict[str, torch.Tensor]
    agg_state: Any
    method_state: dict[str, torch.Tensor] = field(default_factory=dict)
    feedback_state: dict[str, Any] = field(default_factory=dict)  # SA-PEF's L̂, SCAFCOM's c
    w_avg: torch.Tensor | None = None  # running mean of the iterates (eval.average_iterates)
    totals: dict[str, int] = field(
        default_factory=lambda: {"uplink_bytes": 0, "downlink_bytes": 0, "rejected_updates": 0,
                                 "rejected_rounds": 0, "clipped_updates": 0}
    )
    sim_time_s: float = 0.0  # the simulated clock (fedloom.system; 0 when off)
    # fedloom.privacy: adaptive clipping's C_t, local mode's participation counts
    privacy_state: dict[str, Any] = field(default_factory=dict)
    # the global module buffers (BatchNorm statistics; fedloom.buffers, model.buffers)
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class RoundPlan:
    """A round's cohort and jobs, and what the server keeps of them until the end."""

    round: int
    cohort: torch.Tensor
    lr: float
    jobs: list[ClientJob]
    alphas: list[float]
    fb_rows: list[dict[str, torch.Tensor]]
    old_rows: dict[str, torch.Tensor]
    comp: Any
    adjust: RoundAdjust                  # the round planner's changes (compression.adaptive)
    measured: list[list[Any]]            # per client metric hook: the clients' measurements
    dropped: list[int] = field(default_factory=list)
    # Kept cohort positions refused before or during the uplink, with the reason
    # (set by Experiment.uplink_round, after keep()).
    refused: dict[int, str] = field(default_factory=dict)
    # privacy.mode=local: updates the clients clipped (counted by uplink_round; None
    # where the clients clip elsewhere, as on Flower)
    dp_clipped: int | None = None
    # Clients the system model kept out (mid-round dropouts, late): not failed workers.
    withheld: set[int] = field(default_factory=set)

    def keep(self, kept: Sequence[int]) -> None:
        """Keep the cohort positions ``kept``; the others are dropped clients."""
        if len(kept) == len(self.cohort):
            return
        pos = torch.tensor(kept, dtype=torch.long)
        gone = sorted(set(range(len(self.cohort))) - set(kept))
        self.dropped = [int(self.cohort[i]) for i in gone]
        self.cohort = self.cohort[pos]
        self.old_rows = {f: v[pos] for f, v in self.old_rows.items()}
        self.alphas = [self.alphas[i] for i in kept]
        self.fb_rows = [self.fb_rows[i] for i in kept]


@dataclass
class Result:
    """What :func:`run` returns."""

    config: Config
    w: torch.Tensor
    layout: Layout
    model: torch.nn.Module
    metrics: list[dict[str, Any]]
    summary: dict[str, Any]
    run_dir: Path | None


class Experiment:
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
    ) -> None:
        cfg = resolve_auto(cfg)  # server.lr: auto → the aggregator's public default step
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        # The device first: device=cuda without CUDA fails before any data is loaded.
        self.device = resolve(cfg.device)
        if cfg.client.amp != "none" and self.dtype != torch.float32:
            raise ConfigError(f"client.amp: {cfg.client.amp} needs dtype=float32 (autocast "
                              f"leaves {cfg.dtype} as it is)")
        ds = data if data is not None else load_dataset(cfg.data, cfg.seed)
        self.fed: FederatedData = build_federated(ds, cfg.data, cfg.seed)
        if cfg.cohort.size > self.fed.num_clients:
            raise ConfigError(f"cohort.size: must be <= the number of clients "
                              f"({self.fed.num_clients}), got {cfg.cohort.size}")
        ds = self.fed.dataset
        # Index inputs (characters) stay integers; features take the run's dtype.
        self.x = (ds.x.to(self.dtype) if ds.x.is_floating_point() else ds.x).to(self.device)
        self.y = ds.y.to(self.device)
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
            random_forward = random_in_train(self.module, self.x[:8])
        except Exception as e:  # the user's forward, in train mode
            raise ConfigError(f"model: forward in train mode on {len(self.x[:8])} samples "
                              f"failed: {_first_line(e)}") from None
        b = cfg.backend
        if random_forward and "vmap" in (b.name, b.inner if b.name in ("process", "ray") else ""):
            raise ConfigError(f"backend.{'name' if b.name == 'vmap' else 'inner'}: vmap cannot "
                              "draw each client's dropout masks from its own stream; use "
                              "sequential (or auto)")
        if has_batch_statistics(self.module):  # a last batch of one sample (BatchNorm1d)
            sizes = self.fed.num_train()
            short = [k for k, n in enumerate(sizes) if n % cfg.client.batch_size == 1]
            if short and not trains_on_one_sample(self.module, self.x):
                raise ConfigError(f"client.batch_size: {cfg.client.batch_size} leaves client "
                                  f"{short[0]} ({int(sizes[short[0]])} training samples) a batch "
                                  "of one, which the model's BatchNorm cannot train on; choose "
                                  "another batch size")
        c = cfg.client
        self.trainer = LocalSGD(
            self.module, self.layout, batch_size=c.batch_size, epochs=c.epochs, steps=c.steps,
            momentum=c.momentum, weight_decay=c.weight_decay, prox_mu=c.prox_mu, amp=c.amp,
            random_forward=random_forward, augment=self._augment(ds, cfg),
        )
        try:
            self.aggregator = make_aggregator(cfg.aggregator.name, **cfg.aggregator.options)
            self.method = build("method", c.method, c.method_options, "client.method_options")
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e).splitlines()[0]) from None
        if getattr(self.aggregator, "full_participation", False) and (
            cfg.cohort.size != self.fed.num_clients
        ):
            raise ConfigError(
                f"cohort.size: {cfg.aggregator.name} needs every client in every round; set "
                f"cohort.size={self.fed.num_clients}"
            )
        # Simulated devices, deadlines and availability (system.*); None when off.
        self.system = make_system(cfg.system, cfg.seed, self.fed.num_clients, c.batch_size,
                                  cfg.cohort.size, full_participation=getattr(
                                      self.aggregator, "full_participation", False))
        self.backend = get("backend", cfg.backend.name)(self.trainer, self.method, cfg.backend,
                                                        self.x, self.y)
        s = cfg.server
        # server.optimizer: a registered name, plug-in or module:attr; its factory
        # takes the server section's keys it names (lr, momentum, beta1, beta2, eps).
        opt = get("server_optimizer", s.optimizer)
        self.server = opt(**accepted_options(opt, {"lr": s.lr, "momentum": s.momentum,
                                                   "beta1": s.beta1, "beta2": s.beta2,
                                                   "eps": s.eps}))
        self.requires = frozenset(getattr(self.aggregator, "requires", frozenset()))
        comp = cfg.compression
        try:
            self.uplink = make_compressor(comp.name, layout=self.layout, **comp.options)
            # Plug-ins behind protocols (fedloom.hooks): the engine calls them by role.
            self.feedback = feedback_from_config(comp, self.layout)
            self.planner = planner_from_config(comp)
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
        method_fields = self.method.fields(self.layout.size)
        fb_fields = {f"fb.{k}": v for k, v in self.feedback.fields(self.layout.size).items()}
        if set(method_fields) & set(fb_fields):  # pragma: no cover (prefix keeps them apart)
            raise ConfigError("client.method and compression.feedback share a state field")
        self.method_fields = list(method_fields)
        self.fb_fields = list(fb_fields)
        # model.buffers=local (FedBN): each client's buffers, and whether it has any yet.
        buf_fields = ({"bn.buffers": FieldSpec(sum(v.numel() for v in
                                                   self.buffer_template.values())),
                       "bn.buffers_set": FieldSpec(1)}
                      if cfg.model.buffers == "local" and self.buffer_template else {})
        self.buf_fields = list(buf_fields)
        self.store = ClientStateStore(
            self.fed.num_clients, {**method_fields, **fb_fields, **buf_fields},
            storage=cfg.state.storage, dtype=cfg.state.dtype, directory=state_dir,
            memmap_above_mb=cfg.state.memmap_above_mb,
            compute_dtype=self.dtype,
        )
        # Differential privacy and secure aggregation refuse, with one line, what they
        # cannot cover (fedloom.privacy: the components' declared properties).
        self.privacy = make_privacy(cfg, self.fed.num_clients)
        if self.privacy.central and self.system is not None and self.system.has_availability:
            # The accountant's q = cohort.size / N holds for a draw from all N clients.
            raise ConfigError("system.availability: the privacy accountant assumes the cohort "
                              "is drawn from all data.num_clients clients; not with "
                              "privacy.mode=central")
        check_privacy(self.privacy, aggregator=self.aggregator, aggregator_name=cfg.aggregator.name,
                      feedback=self.feedback, feedback_name=comp.feedback, method=self.method,
                      method_name=c.method, w=self.layout.flatten(self.module))
        if cfg.server.secure_aggregation:
            check_secure_aggregation(aggregator=self.aggregator,
                                     aggregator_name=cfg.aggregator.name,
                                     compressor=self.uplink, compressor_name=comp.name)
        if (self.buffer_template and cfg.model.buffers != "keep_global"
                and (self.privacy.enabled or cfg.server.secure_aggregation)):
            # Averaged in the clear, a client's batch statistics would escape the noise
            # and the masking, which cover w only.
            raise ConfigError("model.buffers: privacy and secure aggregation cover the "
                              "parameters only; the model's buffers (BatchNorm statistics) "
                              "need model.buffers=keep_global (or model.norm=group)")
        self.n_train = torch.from_numpy(self.fed.num_train())
        # All clients' test samples in one tensor, with the owner of each, so the
        # per-client evaluation is one pass of the model.
        test_idx = [t for t in self.fed.test]
        self.client_test_idx = torch.from_numpy(np.concatenate(test_idx)).long().to(self.device)
        self.client_test_owner = torch.from_numpy(
            np.concatenate([np.full(len(t), k) for k, t in enumerate(test_idx)])
        ).long().to(self.device)
        xt = self.fed.x_test
        self.x_test = (xt.to(self.dtype) if xt.is_floating_point() else xt).to(self.device)
        self.y_test = self.fed.y_test.to(self.device)
        # per-client accuracies of the last evaluation (written to client_acc.json)
        self.last_client_acc: np.ndarray | None = None
        self.last_personal_acc: np.ndarray | None = None
        # Process-wide settings, last (nothing above can fail after them); close()
        # puts the previous ones back. Determinism and TF32 off on CUDA
        # (fedloom.device.configure); backend.threads for the process that trains
        # (process and ray workers set their own).
        self._restore = [configure(self.device)]
        in_process = cfg.backend.name not in ("process", "ray")
        self.threads, undo = apply_threads(cfg.backend.threads if in_process else 0)
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
            return make_augment(getattr(ds, "augment", ""), cfg.data.augment)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    # ------------------------------------------------------------------ rounds
    def initial_state(self) -> RunState:
        w = self.layout.flatten(self.module).to(self.dtype)
        # Every server state on the run's device (an aggregator's init knows no device).
        return to_device(RunState(0, w, self.server.init(w), self.aggregator.init(self.layout),
                                  method_state=self.method.init_server(w),
                                  feedback_state=self.feedback.init_server(w),
                                  w_avg=w.clone() if self.cfg.eval.average_iterates else None,
                                  privacy_state=self.privacy.init(),
                                  # the initial buffers, not the module's: evaluation
                                  # loads each round's buffers into the module
                                  buffers={n: v.clone()
                                           for n, v in self.buffer_template.items()}),
                         self.device)

    def sample_cohort(self, r: int) -> torch.Tensor:
        """``cohort.size`` distinct clients, uniformly, from the round's own generator."""
        gen = numpy_gen(self.cfg.seed, r, -1, Purpose.COHORT)
        if self.system is not None and self.system.has_availability:  # available ones only
            return self.system.sample(r, gen, self.cfg.cohort.size)
        ids = gen.choice(self.fed.num_clients, self.cfg.cohort.size, replace=False)
        return torch.from_numpy(np.sort(ids)).long()

    def lr(self, r: int) -> float:
        return lr_at_round(self.cfg.client.lr, self.cfg.client.schedule, r, self.cfg.rounds)

    def round(self, st: RunState) -> tuple[RunState, dict[str, Any]]:
        """Run round ``st.next_round``; return the new state and its metrics."""
        t0 = time.perf_counter()
        plan = self.plan_round(st)
        sysm = self.system
        if sysm is None:
            raw = self.backend.train_cohort(plan.jobs)
        else:  # dropouts, partial work (fedloom.system)
            sim = sysm.begin(plan, self)
            raw = sim.train(self.backend, plan.jobs)
        t_train = time.perf_counter() - t0
        results, ups = self.uplink_round(st, plan, raw)
        if sysm is None:
            return self.finish_round(st, plan, results, ups, t0=t0, t_train=t_train)
        results, ups = sysm.after_uplink(sim, plan, self, results, ups)  # timing, late
        new, metrics = self.finish_round(st, plan, results, ups, t0=t0, t_train=t_train)
        return sysm.finish(sim, st, new, metrics)

    def plan_round(self, st: RunState) -> RoundPlan:
        """The round's cohort and fully specified client jobs (the client state rows
        they need are gathered from the store)."""
        r = st.next_round
        cohort = self.sample_cohort(r)
        lr = self.lr(r)
        w = st.w
        # The store stays in host memory; the cohort's rows go to the device
        # (pinned, asynchronous copies on CUDA).
        old_rows = to_device({f: self.store.gather(f, cohort) for f in self.store.fields},
                             self.device, pin=True)
        fb = self.feedback
        probe = fb.probes_smoothness  # the policy asks for the local L estimate
        # The module holds the global buffers: an evaluation that names none
        # (a planner's, a metric hook's) sees the current ones.
        load_buffers(self.module, st.buffers)
        adjust = self.planner.plan(r, w, st.feedback_state, self)
        comp = adjust.compressor if adjust.compressor is not None else self.uplink
        epochs = adjust.epochs
        jobs, alphas, fb_rows, steps = [], [], [], []
        ships = getattr(self.backend, "ships_indices", False)
        measured: list[list[Any]] = [[] for _ in self.client_metrics]
        for i, k in enumerate(cohort.tolist()):
            idx = torch.from_numpy(self.fed.train[k])
            fb_state = {f[3:]: old_rows[f][i] for f in self.fb_fields}
            steps.append(self.trainer.num_steps(len(idx), epochs))
            alpha = fb.alpha(lr, steps[-1], st.feedback_state)
            for hook, got in zip(self.client_metrics, measured, strict=True):
                value = hook.measure(self, w, k, fb_state, len(idx))
                if value is not None:
                    got.append(value)
            # A backend that ships sample positions gathers the samples where it
            # trains: no copy of the cohort's data here.
            xk, yk = (_NO_DATA, _NO_DATA) if ships else (self.x[idx], self.y[idx])
            bufs = st.buffers  # a client's own (model.buffers=local) once it has them
            if self.buf_fields and bool(old_rows["bn.buffers_set"][i, 0] > 0):
                bufs = unflatten_buffers(old_rows["bn.buffers"][i], self.buffer_template)
            job = ClientJob(k, r, w, lr, xk, yk,
                            derive_seed(self.cfg.seed, r, k, Purpose.BATCH),
                            start_loss="start_losses" in self.requires,
                            state={f: old_rows[f][i] for f in self.method_fields},
                            start=fb.start_point(w, fb_state, alpha),
                            grad_shift=fb.grad_shift(fb_state, st.feedback_state),
                            penalty=fb.penalty(w, fb_state, r), epochs=epochs,
                            probe_smoothness=probe, data_index=idx, buffers=bufs)
            jobs.append(self.method.prepare(job, st.method_state))
            alphas.append(alpha)
            fb_rows.append(fb_state)
        return RoundPlan(r, cohort, lr, jobs, alphas, fb_rows, old_rows, comp, adjust, measured)

    def uplink_round(self, st: RunState, plan: RoundPlan, raw: Sequence[ClientResult | None]
                     ) -> tuple[list[ClientResult], list[UplinkResult]]:
        """Drop the clients whose training failed (``None``), screen the kept
        clients' dense updates (non-finite, :func:`screen_updates`), then run each
        accepted client's feedback policy and compressor: what it sends and its new
        state. A client refused here, or whose encode or decode fails, gets an
        empty placeholder result and is named in ``plan.refused`` (rejected and
        counted by :meth:`finish_round`; the run goes on)."""
        r, fb = plan.round, self.feedback
        # A client whose worker died (backend.on_failure=drop) is dropped for the
        # round: nothing of it is aggregated and its state rows stay as they were.
        plan.keep([i for i, res in enumerate(raw) if res is not None])
        # Results of workers elsewhere (process, ray: host tensors) onto the run's device.
        raw = to_device(list(raw), self.device)
        failed = [k for k in plan.dropped if k not in plan.withheld]
        if failed:
            log.warning("round %d: dropped clients %s (their worker failed)", r + 1, failed)
        results = [res for res in raw if res is not None]
        if self.attack is not None:  # an attacker sends its transform of the update
            for res in results:
                res.update = self.attack(res.update, res.client, r)

        # Client side, before encoding: the rules the server applies to what it
        # receives, on the dense update (a huge value in a coordinate that a
        # sparsifier leaves out is seen here, and nothing non-finite is encoded).
        # One pass a client: its norm, which is finite exactly when the update is
        # (and its float64 norm does not overflow: an absurd update all the same).
        if self.privacy.local:
            plan.dp_clipped = 0
            # Each client clips and adds its noise first: everything it sends, and
            # whether it sends, depends on its data only through the noisy update (a
            # non-finite update is sent as zero plus noise, not withheld).
            for res in results:
                u = res.update
                if not bool(torch.isfinite(u).all()):
                    u = torch.zeros_like(u)
                res.update, was = self.privacy.privatize(u, r, res.client)
                plan.dp_clipped += int(was)
        refused: dict[int, str] = {}
        norms = _row_norms([res.update for res in results])
        finite = torch.isfinite(norms)
        for i in (~finite).nonzero().flatten().tolist():
            refused[i] = _non_finite_reason(results[i].update)
        s = self.cfg.server
        # Under privacy the ratio rule is off: it would make one client's acceptance
        # depend on the others' norms (the clip bounds every contribution instead).
        ratio = None if self.privacy.enabled else s.max_norm_ratio
        if s.max_update_norm is not None or ratio is not None:
            refused.update(screen_updates(norms, finite, max_norm=s.max_update_norm,
                                          max_ratio=ratio))

        # Uplink: feedback + compressor; the server sees decode(payload), as bytes.
        ups = []
        for i, res in enumerate(results):
            up = None
            if i not in refused:
                ctx = UplinkContext(r, plan.lr, res.steps, plan.alphas[i],
                                    torch_gen(self.cfg.seed, r, res.client, Purpose.COMPRESS),
                                    self.cfg.client.momentum, len(results), self.fed.num_clients)
                try:
                    up = fb.uplink(res.update, plan.fb_rows[i], plan.comp, ctx,
                                   st.feedback_state)
                except (ValueError, ArithmeticError, struct.error) as e:
                    # PayloadError is a ValueError; a float32 header field that
                    # overflows is an OverflowError or struct.error. One client's
                    # payload that cannot be made or read is that client's fault.
                    refused[i] = f"update could not be encoded or decoded ({_first_line(e)})"
            if up is None:  # nothing was sent: no bytes, no state
                up = UplinkResult(b"", res.update.new_empty(0), {}, float("nan"))
            ups.append(up)
            # The dense update is not needed past its uplink: free it now, so a
            # round holds one m × d copy less at its peak.
            res.update = res.update.new_empty(0)
        plan.refused = refused
        return results, ups

    def finish_round(self, st: RunState, plan: RoundPlan, results: Sequence[ClientResult],
                     ups: Sequence[UplinkResult], *, t0: float, t_train: float,
                     client_state: bool = True, client_buffers: bool = False
                     ) -> tuple[RunState, dict[str, Any]]:
        """The server's half of a round, from what the kept clients sent: reject
        non-finite, undecodable and out-of-bound rows, clip, aggregate, step, check
        the step (a bad one is skipped, the round counted in ``rejected_rounds``),
        scatter client state (unless the clients keep it themselves:
        ``client_state=False``; ``client_buffers=True`` still keeps the accepted
        clients' own buffers under ``model.buffers=local``, which they send anyway,
        for the per-client evaluation), evaluate, log."""
        r, cohort, lr, w = plan.round, plan.cohort, plan.lr, st.w
        fb, alphas, fb_rows, old_rows = self.feedback, plan.alphas, plan.fb_rows, plan.old_rows
        dropped, refused = plan.dropped, plan.refused
        down_bytes = self.downlink_size * len(plan.jobs)
        up_bytes = sum(len(u.payload) + sum(len(x) for x in u.extra_payloads) for u in ups)
        sent = [u for i, u in enumerate(ups) if i not in refused]
        density = (float(np.mean([coordinates_sent(u.payload) for u in sent])) / self.layout.size
                   if sent else float("nan"))
        d = self.layout.size
        row_list = [fb.server_row(u, fb_rows[i], st.feedback_state) if i not in refused
                    else torch.zeros(d, dtype=self.dtype, device=self.device)
                    for i, u in enumerate(ups)]
        rows = (torch.stack(row_list) if row_list
                else torch.empty((0, d), device=self.device)).to(self.dtype)
        del row_list
        reasons = dict(refused)
        # Server side: the same checks on the rows the aggregator would receive.
        # With a size rule on, one norm pass also tells the non-finite rows.
        srv = self.cfg.server
        sized = (srv.max_update_norm is not None or srv.max_norm_ratio is not None
                 or srv.clip_norm is not None)
        norms = _row_norms(rows) if sized else None
        finite = torch.isfinite(norms) if norms is not None else _finite_rows(rows)
        # Masks and ids stay on the host (m entries): a host index works on a device
        # tensor, not the other way round.
        finite = finite.cpu()
        for i in refused:
            finite[i] = False
        for i, res in enumerate(results):  # a non-finite state row is rejected too
            if i in reasons:
                continue
            states = [*res.state.values(), *ups[i].state.values(), *res.buffers.values()]
            if not bool(finite[i]):
                reasons[i] = _non_finite_reason(rows[i])
            elif any(not bool(_finite_rows(v.reshape(1, -1))[0]) for v in states):
                finite[i] = False
                reasons[i] = "non-finite client state"
        clipped = 0
        if norms is not None and bool(finite.any()):
            big = screen_updates(norms, finite, max_norm=srv.max_update_norm,
                                 max_ratio=None if self.privacy.enabled else srv.max_norm_ratio)
            for i, why in big.items():
                finite[i] = False
                reasons[i] = why
            if srv.clip_norm is not None:
                clipped = clip_rows(rows, norms, finite, srv.clip_norm)
        rejected = [int(cohort[i]) for i in sorted(reasons)]
        if rejected:
            log.warning("round %d: rejected updates from clients %s: %s", r + 1, rejected,
                        "; ".join(f"{int(cohort[i])}: {reasons[i]}" for i in sorted(reasons)))
        weights = torch.tensor([res.num_samples for res in results], dtype=self.dtype,
                               device=self.device).reshape(-1)
        losses = torch.tensor([res.loss for res in results], dtype=torch.float64)

        t1 = time.perf_counter()
        agg_metrics: dict[str, Any] = {}
        new_w, opt_state, agg_state = w, st.opt_state, st.agg_state
        feedback_state = st.feedback_state
        conflicts = 0.0
        bad_round: str | None = None
        ok_list = finite.tolist()
        accepted = [u for u, ok in zip(ups, ok_list, strict=True) if ok]
        privacy_state = st.privacy_state
        # Central DP releases its noised sum even when no update was accepted.
        if bool(finite.any()) or self.privacy.central:
            # boolean indexing copies m × d: only when some row was rejected
            ok = finite if not bool(finite.all()) else slice(None)
            start = None
            if "start_losses" in self.requires:
                start = torch.tensor([res.start_loss for res in results], dtype=torch.float64)[ok]
            # Client ids on the host (they index host-side state); the per-client
            # numbers on the device, where the rules combine them with the rows.
            dev = self.device
            info = CohortInfo(
                clients=cohort[ok], round=r, num_clients=self.fed.num_clients,
                losses=losses[ok].to(dev),
                steps=torch.tensor([res.steps for res in results])[ok].to(dev), lr=lr,
                momentum=self.cfg.client.momentum,
                start_losses=start.to(dev) if start is not None else None,
            )
            agg: torch.Tensor | None = None
            try:
                if self.privacy.central:  # DP-FedAvg: clip, sum, noise, fixed denominator
                    agg, cand_privacy, agg_metrics = self.privacy.aggregate(
                        rows, finite, st.privacy_state, r)
                    cand_agg_state = st.agg_state
                else:
                    agg, cand_agg_state, agg_metrics = self.aggregator(rows[ok], weights[ok],
                                                                       st.agg_state, info=info)
            except (NotImplementedError, RecursionError):
                raise  # a missing feature or a bug, not a bad cohort
            except (RuntimeError, ValueError, ArithmeticError) as e:
                # torch.linalg's LinAlgError is a RuntimeError: an ill-posed
                # cohort (1e30 rows, a singular system) must not end the run.
                bad_round = f"the aggregator failed ({_first_line(e)})"
            if agg is not None:
                if not isinstance(agg, torch.Tensor) or tuple(agg.shape) != (d,):
                    shape = tuple(agg.shape) if isinstance(agg, torch.Tensor) else type(agg)
                    bad_round = f"the aggregate has shape {shape}, expected ({d},)"
                elif not _all_finite(agg):
                    bad_round = "the aggregate is not finite"
                else:
                    cand_w, cand_opt = self.server.step(w, agg, st.opt_state)
                    # The feedback policy's end of round only for a step that is
                    # applied: it may change the accepted clients' state (CSER).
                    probes = [res.extra["smoothness"]
                              for res, ok_k in zip(results, ok_list, strict=True)
                              if ok_k and "smoothness" in res.extra]
                    end = fb.end_round(accepted, st.feedback_state, self.fed.num_clients, probes)
                    if end.w_shift is not None:
                        cand_w = cand_w - end.w_shift.to(cand_w.dtype)
                    if not (_all_finite(cand_w) and _all_finite(cand_opt)):
                        bad_round = "the server optimizer's step is not finite"
                    elif not (_all_finite(cand_agg_state) and _all_finite(end.server)):
                        bad_round = "the new aggregator or feedback state is not finite"
                    else:
                        conflicts = conflict_rate(rows[ok], agg)
                        new_w, opt_state, agg_state = cand_w, cand_opt, cand_agg_state
                        if self.privacy.central:
                            privacy_state = cand_privacy
                        feedback_state = end.server
                        down_bytes += end.downlink_bytes
        else:
            # No update accepted: no step; the policy's end of round sees nobody
            # (its server state stays, e.g. SCAFCOM's c).
            end = fb.end_round([], st.feedback_state, self.fed.num_clients, [])
            feedback_state = end.server
            down_bytes += end.downlink_bytes
        if bad_round is not None:
            log.warning("round %d: step skipped, model and state unchanged: %s", r + 1, bad_round)
            conflicts = float("nan")
        if plan.adjust.state:  # the planner's server state rides with the uplink's
            feedback_state = {**feedback_state, **plan.adjust.state}
        method_state = st.method_state
        if ((client_state or (client_buffers and self.buf_fields)) and self.store.fields
                and bool(finite.any()) and bad_round is None):
            ok_pos = finite.nonzero().squeeze(1)
            ok_ids = cohort[ok_pos]
            new_rows = {f: torch.stack([results[i].state[f] for i in ok_pos.tolist()])
                        for f in (self.method_fields if client_state else [])}
            for f in (self.fb_fields if client_state else []):
                new_rows[f] = torch.stack([ups[i].state[f[3:]] for i in ok_pos.tolist()])
            if self.buf_fields and all(results[i].buffers for i in ok_pos.tolist()):
                new_rows["bn.buffers"] = torch.stack([flatten_buffers(results[i].buffers,
                                                                      self.dtype)
                                                      for i in ok_pos.tolist()])
                new_rows["bn.buffers_set"] = torch.ones((len(ok_pos), 1), dtype=self.dtype)
            for f, rows_f in new_rows.items():
                self.store.scatter(f, ok_ids, rows_f)
            if client_state and self.method_fields:
                method_state = self.method.server_update(
                    st.method_state, {f: old_rows[f][ok_pos] for f in self.method_fields},
                    {f: new_rows[f] for f in self.method_fields}, self.fed.num_clients)
        # Buffers (fedloom.buffers): the data-weighted mean of the accepted clients'
        # (average, local), after a step that is applied; never under keep_global.
        new_buffers = st.buffers
        if st.buffers and bad_round is None and self.cfg.model.buffers != "keep_global":
            kept = [i for i, ok_k in enumerate(finite.tolist()) if ok_k and results[i].buffers]
            if kept:
                new_buffers = average_buffers([results[i].buffers for i in kept],
                                              [results[i].num_samples for i in kept])
        t_agg = time.perf_counter() - t1
        w_avg = st.w_avg
        if w_avg is not None:  # mean of w_0 … w_{r+1}
            w_avg = w_avg + (new_w - w_avg) / (r + 2)

        totals = dict(st.totals)
        totals["uplink_bytes"] += up_bytes
        totals["downlink_bytes"] += down_bytes
        totals["rejected_updates"] += len(rejected)
        # .get: checkpoints written before these counts existed resume too
        totals["rejected_rounds"] = totals.get("rejected_rounds", 0) + int(bad_round is not None)
        totals["clipped_updates"] = totals.get("clipped_updates", 0) + clipped
        ok_loss = losses[finite & torch.isfinite(losses)]
        ok_w = weights[finite & torch.isfinite(losses)].double().cpu()  # with the host losses
        train_loss = float((ok_loss * ok_w).sum() / ok_w.sum()) if ok_w.numel() else float("nan")
        metrics: dict[str, Any] = {
            "round": r + 1,
            "lr": lr,
            "cohort_size": len(plan.jobs),
            "train_loss": train_loss,
            "uplink_bytes": up_bytes,
            "downlink_bytes": down_bytes,
            "uplink_bytes_total": totals["uplink_bytes"],
            "downlink_bytes_total": totals["downlink_bytes"],
            "rejected_updates": len(rejected),
            "rejected_updates_total": totals["rejected_updates"],
            "rejected_rounds": int(bad_round is not None),
            "rejected_rounds_total": totals["rejected_rounds"],
            "clipped_updates": clipped,
            "clipped_updates_total": totals["clipped_updates"],
            "dropped_clients": len(dropped),
            "conflict_rate": conflicts,
            "density": density,
            **plan.adjust.metrics,
            **{k: float(v) for k, v in agg_metrics.items()},
        }
        if self.fb_fields:
            ok_list = finite.tolist()
            norms = [u.residual_norm for u, ok in zip(ups, ok_list, strict=True) if ok]
            metrics["residual_norm"] = float(np.mean(norms)) if norms else float("nan")
            metrics["alpha"] = float(np.mean(alphas))
            metrics.update(fb.round_metrics(feedback_state))
        for hook, got in zip(self.client_metrics, plan.measured, strict=True):
            if got:
                metrics.update(hook.summarize(got))
        if rejected:
            metrics["rejected_clients"] = rejected
            metrics["rejected_reasons"] = [reasons[i] for i in sorted(reasons)]
        if bad_round is not None:
            metrics["rejected_round_reason"] = bad_round
        if dropped:
            metrics["dropped_client_ids"] = dropped
        extras = [res.extra for res, ok in zip(results, finite.tolist(), strict=True) if ok]
        for key in sorted({k for e in extras for k in e}):
            metrics[key] = float(np.mean([e[key] for e in extras if key in e]))
        load_buffers(self.module, new_buffers)  # evaluations see the new global buffers
        if (r + 1) % self.cfg.eval.every == 0 or r + 1 == self.cfg.rounds:
            metrics.update(self.evaluate(w_avg if w_avg is not None else new_w))
            if self.method.personal:
                metrics.update(self.evaluate_personal(new_w))
        metrics["train_s"] = t_train
        metrics["agg_s"] = t_agg
        metrics["wall_s"] = time.perf_counter() - t0
        if self.privacy.local:  # who sent a message (a rejected round's were sent too)
            privacy_state = self.privacy.participated(
                privacy_state, cohort[[i for i in range(len(results)) if i not in refused]])
            if plan.dp_clipped is not None:
                metrics["dp_clipped"] = plan.dp_clipped
        if self.privacy.enabled:
            metrics["dp_epsilon"] = self.privacy.epsilon(privacy_state, r + 1)
        return RunState(r + 1, new_w, opt_state, agg_state, method_state, feedback_state, w_avg,
                        totals, privacy_state=privacy_state, buffers=new_buffers), metrics

    def global_eval(self, w: torch.Tensor) -> tuple[float, float]:
        """``(accuracy, loss)`` of ``w`` on the global test set only (for hooks)."""
        return evaluate(self.module, self.layout, w, self.x_test, self.y_test,
                        self.cfg.eval.batch_size)

    def make_uplink(self, **options: Any) -> Any:
        """The configured compressor with ``options`` replacing the section's (for hooks)."""
        opts = {**self.cfg.compression.options, **options}
        return make_compressor(self.cfg.compression.name, layout=self.layout, **opts)

    def _ffl(self, w: torch.Tensor, st: RunState) -> tuple[Any, int | None, dict[str, Any]]:
        """The round planner's answer as ``(compressor, epochs, state and metrics)``:
        the form the adaptive schedule had when the engine computed it (kept for
        callers of that private entry point)."""
        adj = self.planner.plan(st.next_round, w, st.feedback_state, self)
        return adj.compressor, adj.epochs, {**adj.state, **adj.metrics}

    def evaluate(self, w: torch.Tensor) -> dict[str, float]:
        """Global test accuracy/loss and per-client accuracy statistics of ``w``."""
        bs = self.cfg.eval.batch_size
        acc, loss = evaluate(self.module, self.layout, w, self.x_test, self.y_test, bs)
        out = {"test_acc": acc, "test_loss": loss}
        if self.client_test_idx.numel():
            per_client = evaluate_clients(
                self.module, self.layout, w, self.x[self.client_test_idx],
                self.y[self.client_test_idx], self.client_test_owner, self.fed.num_clients, bs,
            )
            if self.buf_fields:  # FedBN: a client's own split with its own statistics
                for k, bufs in self._local_buffers(range(self.fed.num_clients)):
                    idx = torch.from_numpy(self.fed.test[k])
                    if len(idx):
                        per_client[k], _ = evaluate(self.module, self.layout, w, self.x[idx],
                                                    self.y[idx], bs, buffers=bufs)
            out.update(accuracy_stats(per_client))
            self.last_client_acc = per_client
        return out

    def _local_buffers(self, ids: Sequence[int], chunk: int = 256
                       ) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """``(client, its own buffers)`` for the clients of ``ids`` that have any
        (``model.buffers=local``)."""
        out = []
        ids = list(ids)
        for s in range(0, len(ids), chunk):
            part = ids[s : s + chunk]
            have = self.store.gather("bn.buffers_set", part)[:, 0] > 0
            if not bool(have.any()):
                continue
            rows = self.store.gather("bn.buffers", part)
            out += [(k, unflatten_buffers(rows[j], self.buffer_template))
                    for j, k in enumerate(part) if bool(have[j])]
        return out

    def evaluate_personal(self, w: torch.Tensor, chunk: int = 64) -> dict[str, float]:
        """Per-client accuracy of the personal models (``w`` where none exists yet)."""
        acc = np.full(self.fed.num_clients, np.nan)
        bs = self.cfg.eval.batch_size
        for s in range(0, self.fed.num_clients, chunk):
            ids = list(range(s, min(s + chunk, self.fed.num_clients)))
            models = to_device(self.store.gather("personal", ids), self.device)
            have = self.store.gather("personal_set", ids)[:, 0] > 0
            for j, k in enumerate(ids):
                te = self.fed.test[k]
                if len(te) == 0:
                    continue
                v = models[j] if bool(have[j]) else w
                idx = torch.from_numpy(te)
                own = dict(self._local_buffers([k])) if self.buf_fields else {}
                acc[k], _ = evaluate(self.module, self.layout, v, self.x[idx], self.y[idx], bs,
                                     buffers=own.get(k))
        self.last_personal_acc = acc
        return accuracy_stats(acc, prefix="personal_acc")

    def close(self) -> None:
        """Stop the backend's workers, if it has any; put back the process-wide
        settings the run changed (threads, CUDA determinism flags)."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()
        while getattr(self, "_restore", None):
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
            "store": self.store.state_dict(snapshot_dir, tag=f"r{st.next_round}"),
            "config": config_to_dict(self.cfg),
        }

    def restore(self, ckpt: dict[str, Any], snapshot_dir: Path | None = None) -> RunState:
        # A model with buffers needs them (a checkpoint from before they were kept has none).
        bufs = ckpt.get("buffers", None if self.buffer_template else {})
        why = check_buffers(bufs, self.buffer_template)
        if why is not None:
            raise ValueError(f"'buffers' is {why}")
        self.store.load_state_dict(ckpt["store"], snapshot_dir)
        # Loaded on the CPU (map_location), continued on the run's device.
        return to_device(RunState(ckpt["next_round"], ckpt["w"], ckpt["opt_state"],
                                  ckpt["agg_state"], ckpt["method_state"],
                                  ckpt["feedback_state"], ckpt["w_avg"], dict(ckpt["totals"]),
                                  # .get: checkpoints from before the simulated clock
                                  float(ckpt.get("sim_time_s", 0.0)),
                                  # .get: checkpoints from before fedloom.privacy
                                  privacy_state=self.privacy.checked_state(
                                      ckpt.get("privacy_state") or self.privacy.init()),
                                  buffers=bufs),
                         self.device)


# ---------------------------------------------------------------------- run dir
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
CHECKPOINT_FILE = "checkpoints/last.pt"
PREVIOUS_CHECKPOINT_FILE = "checkpoints/prev.pt"
MODEL_FILE = "model.pt"
CLIENT_ACC_FILE = "client_acc.json"
LABELS_FILE = "labels.json"

Callback = Callable[[RunState, dict[str, Any]], None]


def _ranges(rounds: Sequence[int]) -> str:
    """``[1, 2, 3, 5]`` → ``"1–3, 5"``."""
    out: list[str] = []
    for k in sorted(rounds):
        if out and out[-1].split("–")[-1] == str(k - 1):
            out[-1] = f"{out[-1].split('–')[0]}–{k}"
        else:
            out.append(str(k))
    return ", ".join(out)


# A checkpoint's totals and the metrics line of its round must agree.
_TOTAL_KEYS = {"uplink_bytes": "uplink_bytes_total", "downlink_bytes": "downlink_bytes_total",
               "rejected_updates": "rejected_updates_total"}


def _read_metrics(path: Path, upto: int,
                  totals: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """The metrics of rounds ``1 … upto`` (the checkpoint's round), validated.

    Each line must be a UTF-8 JSON object with an integer ``round``. Lines of
    later rounds (run after the checkpoint by a killed run; they are run again)
    are dropped, and so is a torn last line (what a kill leaves; alone, it is not
    reported). Other damaged lines are dropped with a warning naming them when
    rounds ``1 … upto`` are all intact without them; otherwise — a
    round missing, repeated or out of order, the file missing or not a file, or
    the line of round ``upto`` whose totals differ from the checkpoint's
    ``totals`` (a file from another run) — :class:`RunDirError`, one line naming
    the file. Rounds are never dropped silently.
    """
    if upto == 0:
        return []
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise RunDirError(f"{path}: is a directory, not the metrics file") from None
    except FileNotFoundError:
        raise RunDirError(f"{path}: missing, but the checkpoint is at round {upto}: the "
                          f"metrics of rounds {_ranges(range(1, upto + 1))} are lost") from None
    except OSError as e:
        raise RunDirError(f"{path}: cannot be read ({e.strerror or e})") from None
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the file ends with a newline
    out: list[dict[str, Any]] = []
    bad: list[int] = []  # 1-based line numbers
    for no, line in enumerate(lines, 1):
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            obj = None
        rnd = obj.get("round") if isinstance(obj, dict) else None
        if not isinstance(rnd, int) or isinstance(rnd, bool) or rnd < 1:
            bad.append(no)
            continue
        if rnd <= upto:
            if out and rnd <= out[-1]["round"]:
                what = "appears twice" if any(m["round"] == rnd for m in out) else "is out of order"
                raise RunDirError(f"{path}: round {rnd} {what} (line {no})")
            out.append(obj)
    missing = sorted(set(range(1, upto + 1)) - {m["round"] for m in out})
    if missing:
        dmg = f" ({len(bad)} damaged lines: {_ranges(bad)})" if bad else ""
        raise RunDirError(f"{path}: rounds {_ranges(missing)} before the checkpoint's round "
                          f"{upto} are missing{dmg}")
    if totals is not None:
        last = out[-1]
        for key, name in _TOTAL_KEYS.items():
            if name in last and key in totals and last[name] != totals[key]:
                raise RunDirError(f"{path}: round {upto} has {name}={last[name]}, the checkpoint "
                                  f"{totals[key]}: the file is not this run's")
    if bad and bad != [len(lines)]:  # a torn last line is what a kill leaves: no news
        log.warning("%s: dropped %d damaged lines (%s); rounds 1–%d are intact", path, len(bad),
                    _ranges(bad), upto)
    return out


# Per-round details that make no sense as a run's final value.
_PER_ROUND_ONLY = ("rejected_clients", "rejected_reasons", "rejected_round_reason",
                   "dropped_client_ids")


class DivergenceWatch:
    """Says, once, that a run's training loss went non-finite or rose 10× over its
    first value, and names the setting most likely at fault.

    Rule: round ``r``'s ``train_loss`` is not finite, or exceeds ``10·L_1`` with
    ``L_1 > 0`` the first finite one, or ``10·ln C`` (``C`` classes: ``ln C`` is
    the cross-entropy of a uniform guess, about where training starts, so a first
    round that already blew up is caught too). The likely setting: ``server.lr`` when it is
    above the aggregator's public default (:func:`resolve_auto`) or the server
    optimizer is adaptive and ``server.lr >= 0.1`` (such optimizers move every
    coordinate by about ``server.lr`` a round); ``client.lr`` otherwise.
    """

    FACTOR = 10.0

    def __init__(self, cfg: Config, num_classes: int = 0) -> None:
        self.cfg = resolve_auto(cfg)
        self.first: float | None = None
        self.uniform = float(np.log(num_classes)) if num_classes >= 2 else 0.0
        self.message: str | None = None

    def see(self, m: dict[str, Any]) -> str | None:
        """The warning, the first time round metrics ``m`` trip the rule; else None."""
        loss = m.get("train_loss")
        if self.message is not None or not isinstance(loss, int | float):
            return None
        if m.get("cohort_size", 1) <= m.get("dropped_clients", 0):
            return None  # nobody reported (none available, all dropped): no loss to judge
        if not np.isfinite(loss):
            what = "is not finite"
        elif self.first is not None and self.first > 0 and loss > self.FACTOR * self.first:
            what = f"is {loss:.3g}, {loss / self.first:.0f}× its first value {self.first:.3g}"
        elif self.uniform and loss > self.FACTOR * self.uniform:
            what = (f"is {loss:.3g}, {loss / self.uniform:.0f}× a uniform guess's "
                    f"ln C = {self.uniform:.3g}")
        else:
            if self.first is None:
                self.first = float(loss)
            return None
        self.message = f"round {m.get('round')}: the training loss {what}; {self._culprit()}"
        return self.message

    def _culprit(self) -> str:
        s, c, name = self.cfg.server, self.cfg.client, self.cfg.aggregator.name
        try:
            default = default_server_lr(name)
        except (KeyError, ValueError):
            default = s.lr
        if s.lr > default:
            return (f"likely server.lr={s.lr:g}, above {name}'s public default {default:g} "
                    "(server.lr=auto uses it)")
        if s.optimizer in ("adam", "yogi", "adagrad") and s.lr >= 0.1:
            return (f"likely server.lr={s.lr:g}: server.optimizer={s.optimizer} moves every "
                    "coordinate by about server.lr a round")
        return f"likely client.lr={c.lr:g} (or server.lr={s.lr:g}) is too large"


def _versions() -> dict[str, str]:
    """What produced the run: fedloom, torch, numpy and Python versions."""
    import platform

    from fedloom import __version__

    return {"fedloom": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def _summary(exp: Experiment, st: RunState, history: list[dict[str, Any]],
             warnings: Sequence[str] = ()) -> dict[str, Any]:
    summary: dict[str, Any] = {"rounds": st.next_round, "model_sha256": model_sha256(st.w),
                               "num_parameters": exp.layout.size,
                               "backend": getattr(exp.backend, "name", exp.cfg.backend.name),
                               # the step used (server.lr: auto resolved to the rule's default)
                               "server_lr": exp.cfg.server.lr,
                               "versions": _versions()}
    if st.buffers:  # module buffers (BatchNorm statistics) are not in w
        summary["buffers_sha256"] = buffers_sha256(st.buffers)
        summary["buffers"] = exp.cfg.model.buffers
    if warnings:
        summary["warnings"] = list(warnings)
    for m in history:  # final value of each metric (eval metrics from the last eval round)
        summary.update({k: v for k, v in m.items() if k not in _PER_ROUND_ONLY})
    summary["rejected_updates_total"] = st.totals["rejected_updates"]
    summary["rejected_rounds_total"] = st.totals.get("rejected_rounds", 0)
    summary["clipped_updates_total"] = st.totals.get("clipped_updates", 0)
    summary["wall_s_total"] = float(sum(m.get("wall_s", 0.0) for m in history))
    # Where it ran (fedloom.device): the device, its name and total memory, the
    # run's peak memory on it (CUDA: allocated tensors; CPU: the process's peak RSS,
    # named in peak_device_memory_kind), and the torch threads used.
    summary.update(describe(exp.device))
    peak, kind = peak_memory_mb(exp.device)
    summary["peak_device_memory_mb"] = round(peak, 1)
    summary["peak_device_memory_kind"] = kind
    summary["threads"] = exp.threads
    worker = getattr(getattr(exp.backend, "chosen", None) or exp.backend, "worker_threads", None)
    if worker is not None:
        summary["worker_threads"] = worker
    return summary


def _check_extension(old_rounds: Any, resolved: dict[str, Any]) -> None:
    """Resuming with another ``rounds`` extends a run: allowed when nothing before the
    run's end depends on the total, so the result is that of a run of the new total
    from the start (bit for bit). The cosine schedule does (its rate at round ``t``
    uses the last round), so it is refused, as is a smaller total."""
    new = resolved["rounds"]
    if not isinstance(old_rounds, int) or new < old_rounds:
        raise ConfigError(f"rounds: {new} is below the run's {old_rounds}: a run can be "
                          "extended, not shortened (use another --out)")
    sched = resolved["client"]["schedule"]["name"]
    if sched == "cosine":
        raise ConfigError(f"rounds: cannot extend the run from {old_rounds} to {new} rounds: "
                          "client.schedule.name=cosine depends on the total number of rounds "
                          f"(start a new run with rounds={new})")


def _same_but_rounds(a: dict[str, Any], b: dict[str, Any]) -> bool:
    # `logging` (where metrics are copied to) is not part of the experiment either.
    return {**a, "rounds": None, "logging": None} == {**b, "rounds": None, "logging": None}


def _with_defaults(saved: dict[str, Any]) -> dict[str, Any]:
    """A run directory's saved config with today's defaults filled in: a run made
    before a setting existed resumes (a new setting's default is the behaviour
    from before it). A saved config that no longer loads (a renamed or removed
    key) is compared as it is, and so differs."""
    try:
        return config_to_dict(load_config(saved))
    except (ConfigError, TypeError, ValueError):
        return saved


def _config_diff(a: Any, b: Any, at: str = "") -> list[str]:
    """The dotted keys where saved config ``a`` and given config ``b`` differ,
    each as ``key: saved → given`` (rounds and logging are not compared)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for k in sorted(set(a) | set(b), key=str):
            if not at and k in ("rounds", "logging"):
                continue
            out += _config_diff(a.get(k, "<unset>"), b.get(k, "<unset>"),
                                f"{at}.{k}" if at else str(k))
        return out
    return [] if a == b else [f"{at}: {a!r} → {b!r}"]


def _check_run_dir(run_dir: Path, resolved: dict[str, Any], resume: bool) -> None:
    """A new run needs an empty directory; a resumed one the same config."""
    saved = run_dir / CONFIG_FILE
    if resume:
        if not (saved.exists() or saved.is_symlink()):
            return
        try:
            old = yaml.safe_load(saved.read_bytes().decode("utf-8"))
        except IsADirectoryError:
            raise RunDirError(f"{saved}: is a directory, not the run's config") from None
        except UnicodeDecodeError as e:
            raise RunDirError(f"{saved}: not UTF-8 text (byte {e.start}): the run's config is "
                              "damaged") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise RunDirError(f"{saved}: not valid YAML{where}: the run's config is damaged"
                              ) from None
        except OSError as e:
            raise RunDirError(f"{saved}: cannot be read ({e.strerror or e})") from None
        if not isinstance(old, dict):
            raise RunDirError(f"{saved}: holds no config mapping: the run's config is damaged")
        old = _with_defaults(old)
        if {**old, "logging": None} != {**resolved, "logging": None}:
            if not _same_but_rounds(old, resolved):
                diff = _config_diff(old, resolved)
                raise ConfigError(
                    f"{saved}: the config differs from the one given at "
                    f"{'; '.join(diff[:3])}{' …' if len(diff) > 3 else ''}; resume needs the "
                    "same config and overrides (only rounds may change, to extend the run)"
                )
            _check_extension(old.get("rounds"), resolved)
    elif any(p.name != LOCK_FILE for p in run_dir.iterdir()):
        raise ConfigError(f"{run_dir}: run directory exists and is not empty "
                          "(use --resume to continue it, or another --out)")


def run(
    config: str | Path | dict[str, Any] | Config,
    overrides: Sequence[str] = (),
    *,
    out: str | Path | None = None,
    resume: bool = False,
    callbacks: Sequence[Callback] = (),
    data: Dataset | None = None,
    model: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
) -> Result:
    """Run an experiment; return the final model, metrics and summary.

    Args:
        config: a YAML path, a mapping or a :class:`Config`.
        overrides: dotted ``key=value`` overrides.
        out: the run directory. ``None`` runs in memory (no files, no checkpoints).
            A directory that holds a run is never overwritten unless ``resume``.
            It is locked for the run's life: a second run on it gets
            :class:`~fedloom.engine.checkpoint.RunDirError` naming the holder's pid.
        resume: continue from ``out``'s newest intact checkpoint (``last.pt``, or
            ``prev.pt`` when ``last.pt`` is missing or damaged: a warning names
            both); the config must match the one saved there. The result is
            bit-identical to an uninterrupted run. A damaged checkpoint, state
            snapshot, config or metrics file with no intact one to fall back on
            raises one line naming it.
        callbacks: called as ``cb(state, metrics)`` after each round is logged
            (``metrics.jsonl``, ``metrics.csv``, TensorBoard) and checkpointed:
            ``metrics`` is that round's record (``metrics["round"]`` its number,
            equal to ``state.next_round``), so ``wandb.log(metrics,
            step=metrics["round"])`` or ``mlflow.log_metrics(metrics,
            step=metrics["round"])`` (numeric values) sends each round to W&B or
            MLflow. A resumed run calls them for the rounds it runs. An exception
            from a callback stops the run (``KeyboardInterrupt`` included); the
            checkpoints written so far stay, and ``resume`` continues from them.
        data: your own dataset (:func:`fedloom.data.from_arrays`) instead of ``data.name``.
        model: your own ``torch.nn.Module`` (its current weights are ``w_0``) or a
            factory returning one, instead of ``model.name``. Layer groups are
            derived from it, so CRAFT's per-layer mode works on it.
    """
    cfg = resolve_auto(load_config(config, overrides))
    run_dir = Path(out) if out is not None else None
    resolved = config_to_dict(cfg)
    if run_dir is None:
        if cfg.logging.tensorboard:
            raise ConfigError("logging.tensorboard: writes into the run directory; give out=DIR")
        exp = Experiment(cfg, data=data, model=model)
        try:
            return _loop(exp, cfg, resolved, None, resume, callbacks)
        finally:
            exp.close()
    # The lock comes first: nothing in the directory (its memmap state files
    # included, which Experiment creates) is touched by a run that does not hold it.
    lock, created = lock_run_dir(run_dir)
    try:
        _check_run_dir(run_dir, resolved, resume)
        exp = Experiment(cfg, state_dir=run_dir / "state", data=data, model=model)
        try:
            return _loop(exp, cfg, resolved, run_dir, resume, callbacks)
        finally:
            exp.close()
    except BaseException:
        # A run dir made by this call that holds no checkpoint has nothing worth
        # keeping; one with a checkpoint stays so that --resume can continue it.
        if created and not any((run_dir / f).exists()
                               for f in (CHECKPOINT_FILE, PREVIOUS_CHECKPOINT_FILE)):
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    finally:
        lock.release()


# Keys every checkpoint dict holds (Experiment.checkpoint_state).
_CKPT_KEYS = ("format", "next_round", "w", "opt_state", "agg_state", "method_state",
              "feedback_state", "w_avg", "totals", "store", "config")


def _restore_checked(exp: Experiment, cfg: Config, resolved: dict[str, Any],
                     path: Path) -> tuple[RunState, set[str]]:
    """Load, check and restore one checkpoint; return its state and the snapshot
    files it names. Raises :class:`CheckpointError` naming ``path``."""
    ck = load_checkpoint(path, _CKPT_KEYS)

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what}")

    if ck["format"] != 1:
        raise bad(f"checkpoint dict format {ck['format']!r}, expected 1")
    # Another `rounds` is an extension, checked against config.yaml (_check_extension).
    if not (isinstance(ck["config"], dict) and _same_but_rounds(ck["config"], resolved)):
        raise bad("written by a run with another config")
    if ck["config"].get("rounds") != cfg.rounds:
        _check_extension(ck["config"].get("rounds"), resolved)
    nr = ck["next_round"]
    if not isinstance(nr, int) or isinstance(nr, bool) or not 0 <= nr <= cfg.rounds:
        raise bad(f"next_round={nr!r} is not a round of this run (0 … {cfg.rounds})")
    d = exp.layout.size
    for key in ("w", "w_avg"):
        v = ck[key]
        if key == "w_avg" and v is None and not cfg.eval.average_iterates:
            continue
        if not (isinstance(v, torch.Tensor) and v.dtype == exp.dtype and tuple(v.shape) == (d,)):
            raise bad(f"{key!r} is not a {cfg.dtype} vector of the model's {d} parameters")
    totals = ck["totals"]
    if not (isinstance(totals, dict) and all(k in totals for k in _TOTAL_KEYS)
            and all(isinstance(v, int) for v in totals.values())):
        raise bad("'totals' is not a mapping of the run's integer totals")
    for key in ("opt_state", "method_state", "feedback_state", "store"):
        if not isinstance(ck[key], dict):
            raise bad(f"{key!r} is a {type(ck[key]).__name__}, not a mapping")
    try:
        st = exp.restore(ck, path.parent)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError,
            OSError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # A snapshot file's error names that file; say which checkpoint named it.
        raise (CheckpointError(f"{msg} (named by {path})") if msg.startswith(str(path.parent))
               else bad(f"cannot be restored ({msg})")) from None
    files = {v["file"] for v in ck["store"].values() if isinstance(v, dict)}
    return st, files


def _open_checkpoint(exp: Experiment, cfg: Config, resolved: dict[str, Any], ckpt_dir: Path
                     ) -> tuple[RunState, set[str], str | None] | None:
    """The newest intact checkpoint of ``ckpt_dir``: ``(state, its snapshot files,
    why last.pt was passed over or None)``, or ``None`` when there is none at all.

    ``last.pt`` is tried first, then ``prev.pt``; if neither is intact,
    :class:`CheckpointError` names both and what is wrong with each.
    """
    last, prev = ckpt_dir / "last.pt", ckpt_dir / "prev.pt"

    def there(p: Path) -> bool:
        return p.exists() or p.is_symlink()

    if not (there(last) or there(prev)):
        return None
    problems: list[str] = []
    for p in (last, prev):
        if not there(p):
            problems.append(f"{p}: missing")
            continue
        try:
            st, files = _restore_checked(exp, cfg, resolved, p)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        return st, files, (problems[0] if problems else None)
    raise CheckpointError("; ".join(problems) + "; no intact checkpoint to resume from (start "
                          "again with another --out)")


def _save(ckpt_dir: Path, state: dict[str, Any], keep: set[str]) -> set[str]:
    """Write ``last.pt`` (the one it replaces becomes ``prev.pt``), then drop the
    state snapshot files that neither names: ``keep`` are those of the newest
    checkpoint before this one (the new snapshot files were complete before the
    checkpoint named them). Returns the snapshot files the new checkpoint names."""
    save_checkpoint(ckpt_dir / "last.pt", state, keep_previous=ckpt_dir / "prev.pt")
    new = {v["file"] for v in state["store"].values() if isinstance(v, dict)}
    _drop_snapshots(ckpt_dir, new | keep)
    return new


def _drop_snapshots(ckpt_dir: Path, keep: set[str]) -> None:
    """Delete the state snapshot files of ``ckpt_dir`` not in ``keep`` (a damaged
    one may be a directory: it goes too, the folder is the run's own)."""
    for f in ckpt_dir.glob("state-*.bin"):
        if f.name not in keep:
            if f.is_dir() and not f.is_symlink():
                shutil.rmtree(f, ignore_errors=True)
            else:
                f.unlink(missing_ok=True)


def _loop(
    exp: Experiment, cfg: Config, resolved: dict[str, Any], run_dir: Path | None,
    resume: bool, callbacks: Sequence[Callback],
) -> Result:
    st = exp.initial_state()
    history: list[dict[str, Any]] = []
    snap_files: set[str] = set()  # snapshot files of the newest checkpoint on disk
    ckpt_dir = (run_dir / CHECKPOINT_FILE).parent if run_dir is not None else None
    if run_dir is not None and ckpt_dir is not None:
        if (ckpt_dir.exists() or ckpt_dir.is_symlink()) and not ckpt_dir.is_dir():
            raise RunDirError(f"{ckpt_dir}: is not a directory (the run's checkpoints go there)")
        # A write killed before its rename left a temporary file: never read, drop it.
        gone = [p.name for folder in (run_dir, ckpt_dir) for p in remove_leftovers(folder)]
        if gone:
            log.info("%s: removed %d temporary files left by a killed write (%s)", run_dir,
                     len(gone), ", ".join(sorted(gone)))
        passed_over = None
        if resume:
            found = _open_checkpoint(exp, cfg, resolved, ckpt_dir)
            if found is None:
                log.info("%s: no checkpoint; starting at round 1", ckpt_dir)
            else:
                st, snap_files, passed_over = found
            history = _read_metrics(run_dir / METRICS_FILE, st.next_round,
                                    st.totals if found is not None else None)
        if passed_over is not None:
            last = ckpt_dir / "last.pt"
            msg = f"{passed_over}; resumed from {ckpt_dir / 'prev.pt'} (round {st.next_round})"
            if last.exists() or last.is_symlink():
                # Out of the rotation (the next save would make it prev.pt), kept to look at.
                kept = last.with_name("last.pt.damaged")
                if kept.is_dir() and not kept.is_symlink():
                    shutil.rmtree(kept)
                else:
                    kept.unlink(missing_ok=True)
                os.replace(last, kept)
                msg += f"; the damaged file is now {kept.name}"
            # Only prev.pt's snapshot files are of use now (the rounds after it
            # are run again and write their own).
            _drop_snapshots(ckpt_dir, snap_files)
            log.warning("%s", msg)
        atomic_write_bytes(run_dir / CONFIG_FILE,
                           yaml.safe_dump(resolved, sort_keys=False).encode())
        classes = getattr(exp.fed.dataset, "classes", None)
        if classes:  # the user's class names (CSV text labels): class k is classes[k]
            atomic_write_json(run_dir / LABELS_FILE, {name: k for k, name in enumerate(classes)})
        # Rewrite the metrics file to the rounds the state reflects (drops rounds
        # run after the last checkpoint by a killed run; they are run again).
        atomic_write_bytes(run_dir / METRICS_FILE,
                           "".join(json.dumps(m) + "\n" for m in history).encode())
    # Rounds restored from the run directory are checked silently (the summary
    # still carries the warning); a new round that trips the rule is logged once.
    watch = DivergenceWatch(exp.cfg, exp.fed.num_classes)
    for m in history:
        watch.see(m)
    # Views of metrics.jsonl (fedloom.engine.runlog), rebuilt from the history above.
    csv_log = (MetricsCSV(run_dir / METRICS_CSV_FILE, history)
               if run_dir is not None and cfg.logging.csv else None)
    if run_dir is not None and csv_log is None:
        # resumed with logging.csv off: an older copy would disagree with metrics.jsonl
        (run_dir / METRICS_CSV_FILE).unlink(missing_ok=True)
    tb = (TensorBoardSink(run_dir / TENSORBOARD_DIR, st.next_round + 1 if resume else None)
          if run_dir is not None and cfg.logging.tensorboard else None)
    metrics_f = open(run_dir / METRICS_FILE, "a") if run_dir is not None else None
    stop_reason = None
    try:
        while st.next_round < cfg.rounds:
            # privacy.target_epsilon: no round that would spend more than the budget.
            stop_reason = exp.privacy.stop_reason(st.privacy_state, st.next_round)
            if stop_reason is not None:
                log.warning("stopped before round %d: %s", st.next_round + 1, stop_reason)
                if (ckpt_dir is not None and metrics_f is not None and cfg.checkpoint.every
                        and st.next_round % cfg.checkpoint.every):
                    os.fsync(metrics_f.fileno())
                    snap_files = _save(ckpt_dir, exp.checkpoint_state(st, ckpt_dir), snap_files)
                break
            st, m = exp.round(st)
            history.append(m)
            if watch.see(m) is not None:
                log.warning("%s", watch.message)
            if metrics_f is not None:
                metrics_f.write(json.dumps(m) + "\n")
                metrics_f.flush()
            if csv_log is not None:
                csv_log.write_last()
            if tb is not None:
                tb.write(m)
            if (ckpt_dir is not None and metrics_f is not None and cfg.checkpoint.every
                    and (st.next_round % cfg.checkpoint.every == 0 or st.next_round == cfg.rounds)):
                # The metrics of the rounds a checkpoint covers are on disk before it.
                os.fsync(metrics_f.fileno())
                snap_files = _save(ckpt_dir, exp.checkpoint_state(st, ckpt_dir), snap_files)
            for cb in callbacks:
                cb(st, m)
    finally:
        if metrics_f is not None:
            metrics_f.close()
        if tb is not None:
            tb.close()
    exp.layout.load_into(exp.module, st.w)
    load_buffers(exp.module, st.buffers)  # model.pt's state_dict and Result.model hold them
    summary = _summary(exp, st, history, [watch.message] if watch.message else [])
    if exp.privacy.enabled:  # ε spent (also when no round ran) and why the run stopped
        summary["dp_epsilon"] = exp.privacy.epsilon(st.privacy_state, st.next_round)
        summary["dp_delta"] = exp.privacy.delta
    if stop_reason is not None:
        summary["stop_reason"] = stop_reason
    if run_dir is not None:
        import io

        buf = io.BytesIO()
        torch.save({"state_dict": to_host(dict(exp.module.state_dict())), "w": to_host(st.w),
                    "names": exp.layout.names}, buf)
        atomic_write_bytes(run_dir / MODEL_FILE, buf.getvalue())
        atomic_write_json(run_dir / SUMMARY_FILE, summary)
        per_client = {name: [None if np.isnan(a) else float(a) for a in arr]
                      for name, arr in (("client_acc", exp.last_client_acc),
                                        ("personal_acc", exp.last_personal_acc))
                      if arr is not None}
        atomic_write_json(run_dir / CLIENT_ACC_FILE, per_client)
        from fedloom.report.plots import write_run_plots

        write_run_plots(run_dir, history)
    return Result(cfg, st.w, exp.layout, exp.module, history, summary, run_dir)
