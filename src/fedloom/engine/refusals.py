"""The refusals of combinations that cannot work together, one named function each.

Each raises :class:`~fedloom.config.ConfigError` with one line naming the
setting to change; :class:`~fedloom.engine.experiment.Experiment` calls them
while it builds, so a run that cannot work fails before any file is written.
What one component refuses of itself (an option's range) is that component's
own check; here are the combinations of two or more.
"""

from __future__ import annotations

from typing import Any

import torch

from fedloom.buffers import has_batch_statistics, trains_on_one_sample
from fedloom.capabilities import aggregator_caps, feedback_caps, selector_caps
from fedloom.config import BackendConfig, Config, ConfigError
from fedloom.privacy import check_privacy, check_secure_aggregation
from fedloom.selection import Uniform

__all__ = ["check_amp_dtype", "check_buffers_privacy", "check_cohort_size",
           "check_full_participation", "check_one_sample_batches", "check_poisson",
           "check_privacy_sampling",
           "check_privacy_scope", "check_selection_scope", "check_vmap_random"]


def check_amp_dtype(cfg: Config) -> None:
    """Mixed precision (``client.amp``) autocasts float32 only."""
    if cfg.client.amp != "none" and cfg.dtype != "float32":
        raise ConfigError(f"client.amp: {cfg.client.amp} needs dtype=float32 (autocast "
                          f"leaves {cfg.dtype} as it is)")


def check_cohort_size(cfg: Config, num_clients: int) -> None:
    """A cohort is drawn without replacement from the clients the data has."""
    if cfg.cohort.size > num_clients:
        raise ConfigError(f"cohort.size: must be <= the number of clients "
                          f"({num_clients}), got {cfg.cohort.size}")


def check_vmap_random(backend: BackendConfig, random_forward: bool) -> None:
    """The lock-step trainer cannot draw each client's dropout masks from its own stream."""
    b = backend
    inner = b.options.get("inner", "sequential") if b.name in ("process", "ray") else ""
    if random_forward and "vmap" in (b.name, inner):
        raise ConfigError(f"backend.{'name' if b.name == 'vmap' else 'options.inner'}: vmap cannot "
                          "draw each client's dropout masks from its own stream; use "
                          "sequential (or auto)")


def check_one_sample_batches(module: torch.nn.Module, x: torch.Tensor, sizes: Any,
                             batch_size: int) -> None:
    """A BatchNorm layer that cannot train on a last batch of one sample."""
    if not has_batch_statistics(module):
        return
    short = [k for k, n in enumerate(sizes) if n % batch_size == 1]
    if short and not trains_on_one_sample(module, x):
        raise ConfigError(f"client.batch_size: {batch_size} leaves client "
                          f"{short[0]} ({int(sizes[short[0]])} training samples) a batch "
                          "of one, which the model's BatchNorm cannot train on; choose "
                          "another batch size")


def check_full_participation(cfg: Config, aggregator: Any, num_clients: int) -> None:
    """A rule that needs every client in every round (``full_participation``)."""
    if aggregator_caps(aggregator).full_participation and cfg.cohort.size != num_clients:
        raise ConfigError(
            f"cohort.size: {cfg.aggregator.name} needs every client in every round; set "
            f"cohort.size={num_clients}"
        )


def check_poisson(cfg: Config, selector: Any, aggregator: Any) -> None:
    """``cohort.sampling: poisson`` draws each client independently (the uniform
    selector's place): no other selector, no rule that needs every client, no
    event-driven mode; ``cohort.rate`` is its rate only."""
    c = cfg.cohort
    if c.sampling != "poisson":
        if c.rate is not None:
            raise ConfigError("cohort.rate: the rate of cohort.sampling: poisson; with "
                              "sampling fixed the cohort is cohort.size clients")
        return
    if not isinstance(selector, Uniform | None) or c.selection.name != "uniform":
        raise ConfigError(f"cohort.selection.name: {c.selection.name} chooses a cohort of "
                          "cohort.size; cohort.sampling: poisson takes each client "
                          "independently (cohort.selection: uniform)")
    if aggregator_caps(aggregator).full_participation:
        raise ConfigError(f"cohort.sampling: poisson draws cohorts of varying size; "
                          f"{cfg.aggregator.name} needs every client in every round")
    if cfg.system.mode != "sync":
        raise ConfigError(f"cohort.sampling: poisson draws a round's cohort; system.mode "
                          f"{cfg.system.mode} dispatches clients one by one")


def check_privacy_sampling(privacy: Any, system: Any) -> None:
    """The accountant's ``q = cohort.size / N`` holds for a draw from all N clients."""
    if privacy.central and system is not None and system.has_availability:
        raise ConfigError("system.availability: the privacy accountant assumes the cohort "
                          "is drawn from all data.num_clients clients; not with "
                          "privacy.mode=central")


def check_privacy_scope(cfg: Config, privacy: Any, *, aggregator: Any, feedback: Any,
                        method: Any, compressor: Any, w: torch.Tensor) -> None:
    """What differential privacy and secure aggregation cannot cover, as the
    components declare it (:func:`fedloom.privacy.check_privacy`,
    :func:`fedloom.privacy.check_secure_aggregation`)."""
    check_privacy(privacy, aggregator=aggregator, aggregator_name=cfg.aggregator.name,
                  feedback=feedback, feedback_name=cfg.compression.feedback.name, method=method,
                  method_name=cfg.client.method.name, w=w)
    if cfg.server.secure_aggregation:
        check_secure_aggregation(aggregator=aggregator, aggregator_name=cfg.aggregator.name,
                                 compressor=compressor, compressor_name=cfg.compression.name)
        # an honest client can clip before masking; a Byzantine one would not, and the
        # in-process server's clipping of its row is a defence a SecAgg server cannot run
        if cfg.server.clip_norm is not None and cfg.attack.fraction > 0:
            raise ConfigError("server.clip_norm: clips each client's row, which "
                              "server.secure_aggregation keeps from the server (an attacker "
                              "would not clip its own); not with attack.fraction > 0")


def check_buffers_privacy(cfg: Config, privacy: Any, has_buffers: bool) -> None:
    """Averaged in the clear, a client's batch statistics would escape the noise
    and the masking, which cover the parameters only."""
    if (has_buffers and cfg.model.buffers != "keep_global"
            and (privacy.enabled or cfg.server.secure_aggregation)):
        raise ConfigError("model.buffers: privacy and secure aggregation cover the "
                          "parameters only; the model's buffers (BatchNorm statistics) "
                          "need model.buffers=keep_global (or model.options.norm=group)")


def check_event_mode(cfg: Config, *, aggregator: Any, feedback: Any, privacy: Any,
                     num_clients: int) -> None:
    """What the event-driven round modes (``system.mode`` async, buffered;
    :mod:`fedloom.engine.events`) cannot run: a rule that needs the whole
    federation each step, a feedback policy with server state or a model shift
    (a client dispatched at an older model would read a newer one), differential
    privacy (its accountant counts synchronous rounds), a round planner, and too
    few clients to keep ``concurrency`` in flight besides the buffer."""
    s = cfg.system
    if s.mode == "sync":
        return
    m = f"system.mode {s.mode}"
    if s.mode == "async" and cfg.attack.fraction > 0 and not aggregator_caps(aggregator).linear:
        # one arrival a step: a median, Krum or clipping around it returns that arrival
        raise ConfigError(f"aggregator.name: {cfg.aggregator.name} on FedAsync's one arrival "
                          "a step returns that arrival, no defence against attack.fraction > 0 "
                          "(system.mode buffered aggregates system.buffer arrivals)")
    if aggregator_caps(aggregator).full_participation:
        raise ConfigError(f"aggregator.name: {cfg.aggregator.name} needs every client in "
                          f"every step; not with {m}")
    if not feedback_caps(feedback).row_only:
        raise ConfigError(f"compression.feedback.name: {cfg.compression.feedback.name} keeps "
                          f"server state or shifts the model; not with {m}")
    if privacy.enabled:
        raise ConfigError(f"privacy.mode: the accountant counts synchronous rounds; not with {m}")
    if cfg.compression.adaptive.name != "none":
        raise ConfigError(f"compression.adaptive.name: plans synchronous rounds; not with {m}")
    k = s.buffer if s.mode == "buffered" else 1
    if s.concurrency + k - 1 > num_clients:
        raise ConfigError(f"system.concurrency: {s.concurrency} in flight and up to {k - 1} "
                          f"waiting in the buffer need {s.concurrency + k - 1} clients; the "
                          f"run has {num_clients}")


def check_selection_scope(cfg: Config, selector: Any, privacy: Any) -> None:
    """A client selector steered by what clients report (not ``SelectorCaps.uniform``:
    :mod:`fedloom.selection`) is refused under differential privacy (the accountant's
    amplification by sampling assumes a uniform cohort, and a loss-driven cohort
    depends on unnoised client data), under secure aggregation (the server would read
    each client's loss) and in the event-driven round modes (they dispatch clients as
    others arrive, not cohorts)."""
    if selector_caps(selector).uniform:
        return
    name = cfg.cohort.selection.name
    mode = cfg.system.mode
    if mode != "sync":
        raise ConfigError(f"cohort.selection.name: {name} chooses synchronous cohorts; "
                          f"system.mode {mode} dispatches clients one by one "
                          "(cohort.selection: uniform)")
    if privacy.enabled:
        raise ConfigError(f"cohort.selection.name: {name} chooses clients from their "
                          "reported losses; differential privacy (privacy.mode) needs the "
                          "uniform cohort its accountant assumes (cohort.selection: uniform)")
    if cfg.server.secure_aggregation:
        raise ConfigError(f"cohort.selection.name: {name} reads each client's reported loss, "
                          "which secure aggregation keeps from the server "
                          "(cohort.selection: uniform)")


def check_population(cfg: Config, population: Any) -> None:
    """What a population generated on demand (:mod:`fedloom.data.population`) cannot
    do: a transform of every client's rows, or an evaluation of every client."""
    n = population.num_clients
    if cfg.data.feature.name != "none":
        raise ConfigError(f"data.feature.name: a population of {n} users is generated on "
                          "demand; no feature skew of every client's rows")
    if cfg.eval.finetune_steps:
        raise ConfigError(f"eval.finetune_steps: a population of {n} users is evaluated on "
                          "its held-out users; no per-client fine-tuning")
