"""What a component declares about itself, one frozen dataclass per kind.

The engine and the composition checks (:mod:`fedloom.privacy`,
:mod:`fedloom.engine.refusals`) decide from these alone, without knowing any
algorithm: whether a rule needs each client's loss at the received model, whether
a sum-only server can compute it, whether a backend gathers the samples itself.
A component declares ``capabilities = AggregatorCaps(...)`` (a class attribute;
a property where the answer depends on the component's options, as FedAvg's
``weighted``); what it does not declare is the dataclass's default, the answer
that refuses or costs nothing it has not asked for.

One reader per kind (:func:`aggregator_caps`, …) is the only place a component's
capabilities are looked up. Before the dataclasses, components declared loose
attributes (``linear = True``, ``requires = frozenset({"start_losses"})``) that
the engine probed with a default; a plug-in that still does is translated by the
reader, with one deprecation message naming it, and runs as it did. A loose flag
set below a declared ``capabilities`` (a plug-in's subclass of a built-in that
sets ``row_only = False``) overrides that field the same way.

The engine looks nothing up on a component by name: what it once probed
(``getattr(backend, "streams", False)``, a compressor's ``decode_into``) is a
field here. The few protocol members a plug-in written before them may lack (a
backend's ``close()`` and ``name``) and a model's own ``fedloom_vmap`` are read
by the functions below the readers, with the answer they had before.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["AggregatorCaps", "BackendCaps", "CompressorCaps", "FeedbackCaps", "LoopCaps",
           "MethodCaps", "SelectorCaps", "aggregator_caps", "backend_caps", "backend_close",
           "backend_name", "compressor_caps", "feedback_caps", "method_caps", "model_vmap",
           "selector_caps"]

log = logging.getLogger("fedloom")


@dataclass(frozen=True)
class AggregatorCaps:
    """An aggregator's capabilities (:mod:`fedloom.aggregate.base`)."""

    # The optional CohortInfo fields the rule reads ("start_losses", "steps", "lr"):
    # the engine computes the costly ones only when asked.
    requires: frozenset[str] = frozenset()
    # Needs every client in every round (AFL's minimax weights).
    full_participation: bool = False
    # The direction is Σ_k a_k g_k with coefficients independent of the updates'
    # values: a sum-only (secure aggregation) server can compute it.
    linear: bool = False
    # Under unit weights the rule is the plain mean (DP-FedAvg's estimator).
    dp_mean: bool = False
    # Weights the clients by their sample counts (central DP drops the weights).
    weighted: bool = False
    # The server trains a reference update of its own each round on this many root
    # samples (CohortInfo.reference, fedloom.engine.stages.reference); 0: none.
    reference_samples: int = 0

    def __post_init__(self) -> None:
        # A set or tuple given by a caller is kept hashable and unchangeable.
        object.__setattr__(self, "requires", frozenset(self.requires))


@dataclass(frozen=True)
class CompressorCaps:
    """A compressor's capabilities (:mod:`fedloom.compress.base`)."""

    # Payloads are dense values on the same coordinates for every client: a sum-only
    # (secure aggregation) server can add them.
    linear: bool = False
    # ``encode(x, gen=...)`` reads ``x``, the generator and the compressor's settings
    # only (no state, nothing of the cohort), and the object pickles: a ``process``
    # worker may encode its client's update where it was made.
    pure: bool = False
    # It has ``decode_into(payload, out)``: decodes straight into the server's row
    # ``out`` and returns it (the identity's, with no copy); otherwise the server
    # copies ``decode(payload, d)`` into the row.
    decode_into: bool = False


@dataclass(frozen=True)
class FeedbackCaps:
    """An error-feedback policy's capabilities (:mod:`fedloom.compress.feedback`)."""

    # SA-PEF's α schedule: "theory" sends smoothness probes and "residual" update and
    # residual norms, both unnoised (privacy refuses them); "constant" sends nothing.
    schedule: str = "constant"
    # The server uses each client's row only: no server state, model shift or extra
    # payload built from the clients' messages (privacy.mode=central needs it).
    row_only: bool = False


@dataclass(frozen=True)
class MethodCaps:
    """A local method's capabilities (:mod:`fedloom.client.methods`); read from the
    method's factory too, before the run is built (FedBN's ``model.buffers``)."""

    # The buffer policy the method is (fedloom.buffers), which sets model.buffers;
    # None: the configured one.
    model_buffers: str | None = None
    # Its local work is plain local SGD with the terms its prepare() puts into the job
    # (job.transforms): no run() of its own, so the lock-step trainer may run it.
    batched: bool = False


@dataclass(frozen=True)
class LoopCaps:
    """What a batched trainer's gradient function runs of the one step loop
    (:mod:`fedloom.client.loop`); the rest trains on the sequential path, with one
    line in the log naming why (:func:`fedloom.client.loop.loop_reason`)."""

    # Local methods whose work is the loop with their terms, then complete()
    # (MethodCaps.batched: FedBABU, SCAFFOLD, FedDyn); plain local SGD always.
    methods: bool = False
    # The smoothness probe (SA-PEF's theory α): a second gradient at the first step.
    probe: bool = False
    # A method's own loss in place of the cross-entropy (MOON's objective).
    objective: bool = False
    # Clients of one batch with different prox weights (the stacked chain has one μ).
    mixed_prox: bool = False


@dataclass(frozen=True)
class BackendCaps:
    """A backend's capabilities (:mod:`fedloom.engine.trainers.backends`)."""

    # Jobs carry data_index and the backend gathers the samples where it trains (its
    # workers hold the data): the engine ships no copy of a client's samples.
    ships_indices: bool = False
    # ``train_cohort(jobs, on_result=sink)`` hands each result to the sink as it is
    # trained (the engine's early uplink works on it while the others still train).
    streams: bool = False
    # It writes each update into the sink's ``rows`` (the server's), where it can.
    writes_rows: bool = False
    # The rows it writes must be in shared memory (its workers are other processes).
    shared_rows: bool = True
    # The torch threads each of its worker processes runs with (summary.json's
    # worker_threads); None: it trains in this process, with the run's threads.
    worker_threads: int | None = None
    # A batched trainer (vmap, lock-step): what of the step loop it runs itself.
    loop: LoopCaps | None = None


@dataclass(frozen=True)
class SelectorCaps:
    """A client selector's capabilities (:mod:`fedloom.selection`)."""

    # Every available client is equally likely, whatever the past rounds reported:
    # the sampling the privacy accountant assumes, and nothing a client reported
    # steers who trains (privacy and secure aggregation need it).
    uniform: bool = False


Caps = TypeVar("Caps", AggregatorCaps, CompressorCaps, FeedbackCaps, MethodCaps, BackendCaps,
               SelectorCaps)

# How a loose flag's value was used before (truthiness, a collection of names):
# the translation keeps each decision the engine took from it.
_TRANSLATE: dict[str, Callable[[Any], Any]] = {
    "requires": frozenset,
    "full_participation": bool, "linear": bool, "dp_mean": bool, "weighted": bool,
    "row_only": bool, "ships_indices": bool, "decode_into": bool,
    "streams": bool, "writes_rows": bool, "shared_rows": bool,
}
_WARNED: set[tuple[str, str]] = set()


def aggregator_caps(obj: object) -> AggregatorCaps:
    """The capabilities of aggregator ``obj``."""
    return _read(obj, AggregatorCaps, "aggregator")


def compressor_caps(obj: object) -> CompressorCaps:
    """The capabilities of compressor ``obj``."""
    return _read(obj, CompressorCaps, "compressor")


def feedback_caps(obj: object) -> FeedbackCaps:
    """The capabilities of feedback policy ``obj``."""
    return _read(obj, FeedbackCaps, "feedback")


def method_caps(obj: object) -> MethodCaps:
    """The capabilities of local method ``obj`` (the method or its factory)."""
    return _read(obj, MethodCaps, "method")


def backend_caps(obj: object) -> BackendCaps:
    """The capabilities of backend ``obj``."""
    return _read(obj, BackendCaps, "backend")


def selector_caps(obj: object) -> SelectorCaps:
    """The capabilities of client selector ``obj``."""
    return _read(obj, SelectorCaps, "selector")


# Members of a protocol that a plug-in written before them may lack, looked up here
# (the engine calls the protocol; it probes no component): the plug-in's own where
# it has one, else the answer it had before they were on the protocol.

def backend_name(obj: object, default: str) -> str:
    """Backend ``obj``'s ``name`` (auto's: the backend it chose); ``default`` (the
    config's ``backend.name``) for a plug-in without one."""
    name: str = getattr(obj, "name", default)
    return name


def backend_close(obj: object) -> Callable[[], None]:
    """Backend ``obj``'s ``close()``, which stops what it started (workers, a pool, a
    Ray instance) when the run ends; every built-in has one. For a plug-in without
    one, a call that does nothing."""
    close: Callable[[], None] | None = getattr(obj, "close", None)
    return close if close is not None else _nothing


def model_vmap(module: object) -> bool:
    """Whether model ``module`` lets torch.func batch its clients (the ``vmap`` backend):
    a model says it may not with the attribute ``fedloom_vmap = False`` (a causal LM
    with gradient checkpointing, whose layers call ``requires_grad_`` inside the
    forward, which torch.func refuses); by default it may."""
    return bool(getattr(module, "fedloom_vmap", True))


def _nothing() -> None:
    return None


def _read(obj: object, caps_type: type[Caps], kind: str) -> Caps:
    declared = getattr(obj, "capabilities", None)
    if declared is not None and not isinstance(declared, caps_type):
        raise TypeError(f"{kind} {_name(obj)}: capabilities must be a {caps_type.__name__}, "
                        f"got {type(declared).__name__}")
    caps = declared if declared is not None else caps_type()
    at = _depth(obj, "capabilities") if declared is not None else None
    loose: dict[str, Any] = {}
    for f in dataclasses.fields(caps_type):
        if not hasattr(obj, f.name):
            continue
        if declared is not None:
            # A flag counts over declared capabilities only where it is set below them
            # (a subclass's, or the instance's own); a built-in's option of the same
            # name (FedAvg's weighted, SA-PEF's schedule) agrees with its declaration.
            depth = _depth(obj, f.name)
            if at is None or depth is None or depth >= at:
                continue
        value = _TRANSLATE.get(f.name, _same)(getattr(obj, f.name))
        if declared is None or value != getattr(caps, f.name):
            loose[f.name] = value
    if not loose:
        return caps
    _deprecated(obj, kind, caps_type, loose)
    return dataclasses.replace(caps, **loose)


def _same(value: Any) -> Any:
    return value


def _depth(obj: object, name: str) -> int | None:
    """Where ``name`` is set: 0 on ``obj`` itself, then down its classes (a class or
    a factory function: itself, then its bases); None when only ``__getattr__``
    gives it."""
    chain: Iterable[Any] = (obj.__mro__ if isinstance(obj, type)
                            else (obj, *type(obj).__mro__))
    for i, o in enumerate(chain):
        if name in getattr(o, "__dict__", {}):
            return i
    return None


def _name(obj: object) -> str:
    # a class or a factory function by its own name, an instance by its class's
    target = obj if isinstance(obj, type) or hasattr(obj, "__qualname__") else type(obj)
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"


def _deprecated(obj: object, kind: str, caps_type: type, loose: dict[str, Any]) -> None:
    """One message per plug-in and process: the flags it still declares loose."""
    who = _name(obj)
    if (kind, who) in _WARNED:
        return
    _WARNED.add((kind, who))
    fields = ", ".join(f"{k}={v!r}" for k, v in loose.items())
    msg = (f"{kind} {who} declares the loose flags {', '.join(loose)}; declare "
           f"capabilities = fedloom.capabilities.{caps_type.__name__}({fields}) instead "
           "(read the same for now)")
    warnings.warn(msg, DeprecationWarning, stacklevel=4)  # the reader's caller
    log.warning("%s", msg)
