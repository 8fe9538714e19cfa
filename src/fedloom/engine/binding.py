"""The three values bound to a model: the parts a round's stages read.

:func:`bind` takes an :class:`~fedloom.engine.values.Algorithm`, a
:class:`~fedloom.engine.values.Federation` and a :class:`~fedloom.engine.values.Runtime`
with the model and returns :class:`Bound`: the split on the run's device
(:class:`~fedloom.engine.inputs.ClientData`), the model's space, the bound
algorithm (:class:`~fedloom.engine.algorithm.Algorithm`, LocalSGD built on the
model, each ``None`` component the schema's default), the backend, privacy, the
schedule, the screening rules, the evaluator and the round's surroundings
(:class:`Surroundings`). It refuses the combinations that cannot work
(:mod:`fedloom.engine.refusals`, whose messages name the config fields of
``record``) and runs the plug-ins' checks at the door (the aggregator, the server
step, ``client.transforms``, the compressor, the feedback policy, the local method and
the client selector on a synthetic input), so a bad run fails before any file is
written.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from fedloom.aggregate.base import CohortInfo, make_aggregator
from fedloom.aggregate.checks import check_aggregator
from fedloom.attack import Attack, make_attack
from fedloom.buffers import module_buffers, random_in_train
from fedloom.capabilities import aggregator_caps, backend_caps
from fedloom.client.checks import check_method, check_method_hooks
from fedloom.client.sgd import LocalSGD
from fedloom.client.transforms import check_local_transforms
from fedloom.compress import make_compressor
from fedloom.compress.checks import check_compressor
from fedloom.compress.feedback import feedback_from_config
from fedloom.compress.feedback.checks import check_feedback
from fedloom.compress.identity import Identity
from fedloom.config import Config, ConfigError, EvalConfig
from fedloom.config.sections import FeedbackConfig, PlannerConfig
from fedloom.data.augment import make_augment
from fedloom.data.feature import apply_feature_skew
from fedloom.data.federated import FederatedData, build_federated
from fedloom.data.heterogeneity import class_counts
from fedloom.device import resolve
from fedloom.engine import refusals
from fedloom.engine.algorithm import Algorithm as BoundAlgorithm
from fedloom.engine.clientfields import BUFFERS, FEEDBACK, METHOD, ClientFields
from fedloom.engine.events import EventDriver
from fedloom.engine.inputs import ClientData, ModelSpace, Schedule, ScreenRules
from fedloom.engine.stages.evaluation import Evaluator
from fedloom.engine.stages.reference import RootData, draw_root
from fedloom.engine.stages.screen import first_line
from fedloom.engine.trainers.backends import Backend
from fedloom.engine.values import Algorithm, Federation, LocalUpdate, Runtime
from fedloom.hooks import ClientMetric, planner_from_config
from fedloom.params import Layout, training_mode
from fedloom.privacy import Privacy, make_privacy, poisson_rate
from fedloom.registry import accepted_options, build, get
from fedloom.rng import Purpose, derive_seed, forked_rng, numpy_gen, torch_gen
from fedloom.selection.checks import check_selector
from fedloom.server_opt.checks import check_server_step
from fedloom.state import ClientStateStore, FieldSpec
from fedloom.system import System, make_system
from fedloom.transforms import Chain, from_fedloom

__all__ = ["Bound", "Surroundings", "bind"]

T = TypeVar("T")


@dataclass(frozen=True)
class Surroundings:
    """What surrounds a round: the simulated system and the event driver (``None``:
    off), Byzantine clients (``None``: none), the client metrics and the broadcast's
    size (it depends on ``d`` only: measured once)."""

    system: System | None
    events: EventDriver | None
    attack: Attack | None
    hooks: tuple[ClientMetric, ...]
    downlink_size: int
    # the server's root samples, where the aggregator asks for a reference update
    root: RootData | None = None


@dataclass(frozen=True)
class Bound:
    """The values bound to one model."""

    space: ModelSpace
    clients: ClientData
    algorithm: BoundAlgorithm
    backend: Backend
    privacy: Privacy
    schedule: Schedule
    rules: ScreenRules
    evaluator: Evaluator
    around: Surroundings
    partition_counts: np.ndarray  # [N, C] class counts of each client's part


def bind(algorithm: Algorithm, federation: Federation, runtime: Runtime,
         module: torch.nn.Module, *, record: Config, evaluation: EvalConfig, rounds: int,
         hooks: tuple[ClientMetric, ...] = (), state_dir: Path | None = None,
         user_model: bool = True) -> Bound:
    """The values bound to ``module`` (``user_model``: a module of the caller's, taken
    to the run's dtype and checked on one sample; one built from the config is
    already). ``state_dir``: where a memmap client state store keeps its files."""
    device, dtype = resolve(runtime.device), runtime.torch_dtype
    fed, x, y, counts = _split(federation, runtime, device, record)
    clean = (x, y)  # the root data is drawn from samples no attacker has poisoned
    try:  # Byzantine clients (attack.*), for robustness experiments; None when off
        attack = make_attack(federation.attack, runtime.seed, fed.num_clients)
        if attack is not None:  # the attackers' own samples, before any backend has them
            if attack.poisons and fed.population is not None:
                raise ValueError(f"attack.name: {federation.attack.name} poisons the "
                                 "attackers' stored samples; a population generated on "
                                 "demand stores none")
            x, y = attack.poison(x, y, fed.train, fed.dataset.num_classes)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    space, random_forward = _space(module, x, fed, algorithm, runtime, device, user_model)
    loc = algorithm.local
    try:
        augment = make_augment(fed.dataset.augment, federation.split.augment)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    trainer = LocalSGD(
        space.module, space.layout, batch_size=loc.batch_size, epochs=loc.epochs,
        steps=loc.steps, momentum=loc.momentum, weight_decay=loc.weight_decay,
        prox_mu=loc.prox_mu, amp=loc.amp, random_forward=random_forward, augment=augment,
        transforms=tuple(loc.transforms))
    algo = _components(algorithm, trainer, space.layout)
    n = fed.num_clients
    refusals.check_full_participation(record, algo.aggregator, n)
    refusals.check_poisson(record, federation.selector, algo.aggregator)
    system = make_system(federation.system_settings, runtime.seed, n, loc.batch_size,
                         federation.cohort,
                         full_participation=aggregator_caps(algo.aggregator).full_participation,
                         poisson=record.cohort.sampling == "poisson")
    # (trainer, method, x, y, threads, keep_heap, **backend.options): its signature is
    # the options' schema
    backend = get("backend", runtime.backend)(trainer, algo.method, x, y,
                                              threads=runtime.threads,
                                              keep_heap=runtime.keep_heap, **runtime.options)
    # after the backend: a batched one (vmap, lock-step) gives client.transforms [m, d]
    _check_plugins(algo, loc, space, federation.cohort, n, runtime,
                   batched=backend_caps(backend).loop is not None)
    # the method's job: two samples of the first client that has any
    first = torch.from_numpy(next((t for t in fed.train if len(t)), fed.train[0])[:2])
    _check_client_plugins(algo, loc, space, runtime, federation, n, x[first], y[first])
    downlink = Identity(checksum=algorithm.checksum)
    root = draw_root(aggregator_caps(algo.aggregator).reference_samples, fed.train, *clean,
                     runtime.seed, population=fed.population is not None)
    around = Surroundings(system, None, attack, tuple(hooks),
                          len(downlink.encode(torch.zeros(space.layout.size))), root)
    fields, new_store = _state(algo, space, n, runtime, state_dir)
    privacy = make_privacy(record, n)
    around = _refuse(record, algo, space, privacy, around, federation, runtime, n)
    clients = ClientData(fed, x, y, new_store, fields)
    selector = federation.selector
    refusals.check_selection_scope(record, selector, privacy)
    schedule = Schedule(runtime.seed, rounds, federation.cohort, n, loc, system, selector,
                        poisson_rate(record.cohort, n), privacy.groups)
    rules = dataclasses.replace(algorithm.screening, private=privacy.enabled)
    x_test = _to_run(fed.x_test, dtype, device)
    evaluator = Evaluator(space, clients, x_test, fed.y_test.to(device), evaluation,
                          seed=runtime.seed, local=trainer, method=algo.method,
                          client_lr=loc.lr,
                          extra=attack.test_sets(x_test, fed.y_test.to(device)) if attack
                          else {})
    return Bound(space, clients, algo, backend, privacy, schedule, rules, evaluator, around,
                 counts)


def _to_run(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # Index inputs (characters) stay integers; features take the run's dtype.
    return (t.to(dtype) if t.is_floating_point() else t).to(device)


def _split(federation: Federation, runtime: Runtime, device: torch.device, record: Config
           ) -> tuple[FederatedData, torch.Tensor, torch.Tensor, np.ndarray]:
    """The clients' parts, their samples on the run's device (each client's feature
    skew applied, once) and the class counts of each part (summary.json)."""
    fed = build_federated(federation.data, federation.split, runtime.seed)
    refusals.check_cohort_size(record, fed.num_clients)
    ds = fed.dataset
    x, y = _to_run(ds.x, runtime.torch_dtype, device), ds.y.to(device)
    if fed.population is not None:
        # generated on demand (fedloom.data.population): x, y are the held-out users'
        # samples, and the split's measures are theirs, a sample of the population
        refusals.check_population(record, fed.population)
        return fed, x, y, fed.population.sample_counts
    # Each client's whole part (train and its own test split): the heterogeneity
    # measures and the rows its feature skew (data.feature) transforms.
    parts = [np.concatenate([tr, te]) for tr, te in zip(fed.train, fed.test, strict=True)]
    counts = class_counts(ds.y.numpy(), parts, ds.num_classes)
    f = federation.split.feature
    try:
        x = apply_feature_skew(x, parts, f.name, f.scale, runtime.seed)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return fed, x, y, counts


def _space(module: torch.nn.Module, x: torch.Tensor, fed: FederatedData, algorithm: Algorithm,
           runtime: Runtime, device: torch.device, user_model: bool
           ) -> tuple[ModelSpace, bool]:
    """The model's space, and whether its train-mode forward draws random numbers."""
    if user_model:
        module = module.to(runtime.torch_dtype).to(device)
        _check_output(module, x[:1], fed.dataset.num_classes)
    # Eval mode for evaluation; local training runs a train-mode copy (dropout,
    # batch statistics), its buffers under model.buffers (fedloom.buffers).
    module.eval()
    layout = Layout.from_module(module)
    try:
        random_forward = random_in_train(module, x[:8])
    except Exception as e:  # the user's forward, in train mode
        raise ConfigError(f"model: forward in train mode on {len(x[:8])} samples "
                          f"failed: {first_line(e)}") from None
    refusals.check_vmap_random(runtime.backend_settings, random_forward)
    refusals.check_one_sample_batches(module, x, fed.num_train(), algorithm.local.batch_size)
    return ModelSpace(module, layout, module_buffers(module), algorithm.buffers,
                      runtime.torch_dtype, device), random_forward


def _check_output(module: torch.nn.Module, x: torch.Tensor, num_classes: int) -> None:
    try:
        # eval mode: no dropout draw, no BatchNorm statistic moved by the check
        with torch.no_grad(), training_mode(module, False):
            out = module(x)
    except Exception as e:  # the user's forward failed on one sample of the data
        raise ConfigError(f"model: forward on one sample of shape {tuple(x.shape[1:])} "
                          f"failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if out.ndim != 2 or out.shape[1] != num_classes:
        raise ConfigError(f"model: outputs shape {tuple(out.shape[1:])} per sample, the data "
                          f"has {num_classes} classes")


def _components(algorithm: Algorithm, trainer: LocalSGD, layout: Layout) -> BoundAlgorithm:
    """The algorithm's components, each ``None`` one the schema's default; the
    method checks the trainer's settings it cannot run with."""
    a = algorithm
    try:
        aggregator = a.aggregator if a.aggregator is not None else make_aggregator("fedavg")
        if a.method is not None:
            method = a.method
        else:
            method = build("method", "sgd",
                           accepted_options(get("method", "sgd"), {"layout": layout}),
                           "client.method.options")
        check_method_hooks(method)  # before its first hook is called
        method.check_trainer(trainer)
        server = (a.server if a.server is not None
                  else build("server_optimizer", "sgd", {"lr": 1.0}, "server.optimizer"))
        compressor = (a.compressor if a.compressor is not None
                      else make_compressor("identity", layout=layout))
        feedback = (a.feedback if a.feedback is not None
                    else feedback_from_config(FeedbackConfig(), layout))
        planner = a.planner if a.planner is not None else planner_from_config(PlannerConfig())
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    return BoundAlgorithm(trainer, method, compressor, feedback, planner, aggregator, server)


# The synthetic rows the plug-ins are checked on: at most this many numbers
# (64 MiB in float32), at least two rows, else the cohort's size.
_PROBE_NUMBERS = 2**24


def _check_plugins(algo: BoundAlgorithm, loc: LocalUpdate, space: ModelSpace, cohort: int,
                   num_clients: int, runtime: Runtime, *, batched: bool) -> None:
    """The aggregator, the server step, ``client.transforms`` and the compressor run on
    a synthetic input of the run's shapes (the checks at the door: :mod:`fedloom.aggregate.checks`,
    :mod:`fedloom.server_opt.checks`, :func:`~fedloom.client.transforms.check_local_transforms`,
    :mod:`fedloom.compress.checks`),
    on copies: the rows come from their own stream ``(seed, "probe")``, no global RNG is
    drawn and no run state is touched; ``batched``: the local-step terms also get the
    batched trainers' ``[m, d]``. A violation is a one-line ConfigError."""
    d, dtype, device = space.layout.size, space.dtype, space.device
    m = max(2, min(cohort, _PROBE_NUMBERS // max(d, 1)))
    gen = torch_gen(runtime.seed, purpose=Purpose.PROBE)
    rows = (1e-2 * torch.randn(m, d, generator=gen, dtype=dtype)).to(device)
    w = space.layout.flatten(space.module).detach().clone()
    info = CohortInfo(clients=torch.arange(m), round=0, num_clients=num_clients,
                      losses=torch.ones(m, dtype=torch.float64, device=device),
                      steps=torch.ones(m, dtype=torch.int64, device=device),
                      lr=loc.lr, momentum=loc.momentum,
                      start_losses=torch.ones(m, dtype=torch.float64, device=device), w=w,
                      reference=rows.mean(0))
    weights = 10.0 * torch.arange(1, m + 1, dtype=dtype, device=device)
    try:
        check_aggregator(_copy(algo.aggregator), space.layout, rows, weights, info)
        check_server_step(_copy(algo.server), w.clone(), rows.mean(0))
        check_local_transforms([_copy(t) for t in loc.transforms], w.clone(), rows[0].clone(),
                               batched=batched)
        check_compressor(_copy(algo.compressor), rows[0].clone(),
                         (torch_gen(runtime.seed, 0, 0, Purpose.PROBE),
                          torch_gen(runtime.seed, 0, 1, Purpose.PROBE)))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_client_plugins(algo: BoundAlgorithm, loc: LocalUpdate, space: ModelSpace,
                          runtime: Runtime, federation: Federation, n: int,
                          x: torch.Tensor, y: torch.Tensor) -> None:
    """The feedback policy, the local method and the client selector run two rounds on
    copies before round 1 (:mod:`fedloom.compress.feedback.checks`,
    :mod:`fedloom.client.checks`, :mod:`fedloom.selection.checks`): one client's
    synthetic update of size ``d``; a job of ``x, y`` (two samples of a client) with
    one local step; cohorts of the run's size. Their generators are the ``probe``
    stream's and any draw from torch's global generators (a user's dropout) is undone, so
    the run trains as it would without the checks. A violation is a one-line ConfigError."""
    sel = federation.selector
    if from_fedloom(algo.feedback) and from_fedloom(algo.method) and (
            sel is None or from_fedloom(sel)):
        return  # fedloom's own (no selector given: uniform), tested by their suites
    seed, d = runtime.seed, space.layout.size
    w = space.layout.flatten(space.module).detach().clone()
    g = (1e-2 * torch.randn(d, generator=torch_gen(seed, purpose=Purpose.PROBE),
                            dtype=space.dtype)).to(space.device)
    probe = (0, 1)  # the two rounds of each check
    try:
        with forked_rng(derive_seed(seed, -1, -1, Purpose.PROBE), space.device):
            check_feedback(_copy(algo.feedback), _copy(algo.compressor), w, g,
                           tuple(torch_gen(seed, r, 0, Purpose.PROBE) for r in probe),
                           lr=loc.lr, momentum=loc.momentum, num_clients=n)
            trainer = dataclasses.replace(  # the run's client.transforms untouched
                algo.local, transforms=tuple(_copy(t) for t in algo.local.transforms))
            check_method(_copy(algo.method), trainer, w, x, y, lr=loc.lr,
                         seeds=tuple(derive_seed(seed, r, 0, Purpose.PROBE) for r in probe),
                         num_clients=n)
            if sel is not None:
                check_selector(_copy(sel), n, federation.cohort,
                               tuple(numpy_gen(seed, r, -1, Purpose.PROBE) for r in probe),
                               loc.batch_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _copy(obj: T) -> T:
    """A copy of ``obj`` for its check, so that what a plug-in keeps in itself (a
    round counter) is as it was given when round 1 starts; ``obj`` itself when it
    cannot be copied (an open handle), the check then seen by the object. fedloom's
    own classes are not run by the checks (but for a chain's terms): not copied."""
    if from_fedloom(obj) and not isinstance(obj, Chain):
        return obj
    try:
        return copy.deepcopy(obj)
    except Exception:  # any __deepcopy__/__reduce__ of the user's class may fail
        return obj


def _state(algo: BoundAlgorithm, space: ModelSpace, num_clients: int, runtime: Runtime,
           state_dir: Path | None) -> tuple[ClientFields, Callable[[], ClientStateStore]]:
    """The clients' state rows: the method's, the feedback policy's and, under
    ``model.buffers=local`` (FedBN), each client's buffers and whether it has any yet;
    and how a store of them is made (one a run state: ``Experiment.init``, ``restore``).
    One is made here, so that a bad setting or directory fails before round 1."""
    d, template = space.layout.size, space.buffer_template
    own_buffers = space.buffer_policy == "local" and bool(template)
    buffer_fields = ({"buffers": FieldSpec(sum(v.numel() for v in template.values())),
                      "buffers_set": FieldSpec(1)} if own_buffers else {})
    try:
        fields = ClientFields({METHOD: algo.method.fields(d), FEEDBACK: algo.feedback.fields(d),
                               BUFFERS: buffer_fields})
    except ValueError as e:
        raise ConfigError(f"client.method: {e}") from None
    st = runtime.state
    new_store = functools.partial(ClientStateStore, num_clients, fields.specs,
                                  storage=st.storage, dtype=st.dtype, directory=state_dir,
                                  memmap_above_mb=st.memmap_above_mb, compute_dtype=space.dtype)
    new_store()
    return fields, new_store


def _refuse(record: Config, algo: BoundAlgorithm, space: ModelSpace, privacy: Privacy,
            around: Surroundings, federation: Federation, runtime: Runtime,
            num_clients: int) -> Surroundings:
    """Differential privacy, secure aggregation and the event modes refuse, with one
    line, what they cannot cover; the surroundings with the event driver (system.mode
    async, buffered; ``None``: synchronous)."""
    refusals.check_privacy_sampling(privacy, around.system)
    refusals.check_privacy_scope(record, privacy, aggregator=algo.aggregator,
                                 feedback=algo.feedback, method=algo.method,
                                 compressor=algo.compressor, w=space.layout.flatten(space.module))
    refusals.check_buffers_privacy(record, privacy, bool(space.buffer_template))
    refusals.check_event_mode(record, aggregator=algo.aggregator, feedback=algo.feedback,
                              privacy=privacy, num_clients=num_clients)
    system = federation.system_settings
    if system.mode == "sync":
        return around
    return dataclasses.replace(around, events=EventDriver(system, runtime.seed))
