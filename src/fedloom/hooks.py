"""Round hooks: the protocols through which a plug-in plans a round or measures
the cohort, so that the engine calls them without knowing any algorithm.

Two kinds, registered like every other component (:mod:`fedloom.registry`):

- **round planner** (kind ``planner``, config ``compression.adaptive``, entry
  point group ``fedloom.planners``): before the cohort trains, ``plan`` may
  replace the round's uplink compressor and local epochs, report metrics and
  keep server state (FFL's adaptive rate, :mod:`fedloom.compress.adaptive`).
  Its options are ``compression.adaptive.options``.
- **client metric** (kind ``metric``, config ``metrics.hooks`` or a boolean
  key ``metrics.NAME: true``, entry point group ``fedloom.metrics``): before
  the cohort trains, ``measure`` is called for each sampled client with the
  global model and the client's feedback state rows; ``summarize`` turns the
  round's measurements into metrics (SA-PEF's gradient mismatch,
  :mod:`fedloom.compress.mismatch`). Its options come from the section keys
  ``metrics.NAME_OPTION`` (e.g. ``mismatch_alpha`` → ``alpha``) and
  ``metrics.options.NAME``.

``exp`` is a :class:`~fedloom.engine.inputs.HookView` of the running experiment;
a hook reads it (``cfg``, ``layout``, ``fed``, ``x``, ``y``, ``trainer``,
``global_eval(w)``, ``make_uplink(**options)``) and changes nothing in it: what
it keeps goes in the state it returns, which is checkpointed with the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from fedloom.config import metric_names
from fedloom.registry import accepted_options, build, get, register

__all__ = ["ClientMetric", "NoPlanner", "RoundAdjust", "RoundPlanner", "metric_hooks",
           "planner_from_config"]


@dataclass(frozen=True)
class RoundAdjust:
    """What a round planner changes in one round (``None``: the configured value)."""

    compressor: Any = None                  # the uplink compressor of the round
    epochs: int | None = None               # local epochs of the round
    metrics: dict[str, float] = field(default_factory=dict)   # logged with the round
    state: dict[str, Any] = field(default_factory=dict)       # kept in the server state


class RoundPlanner(Protocol):
    def plan(self, round: int, w: torch.Tensor, state: Mapping[str, Any],
             exp: Any) -> RoundAdjust:
        """Plan round ``round`` (from 0) of global model ``w``; ``state`` is the
        uplink's server state (the feedback policy's keys and the planner's own,
        from earlier rounds' :attr:`RoundAdjust.state`)."""
        ...


class ClientMetric(Protocol):
    def measure(self, exp: Any, w: torch.Tensor, client: int,
                rows: Mapping[str, torch.Tensor], n: int) -> Any:
        """One sampled client's measurement (``None``: nothing to measure);
        ``rows`` are its feedback state rows, ``n`` its training samples."""
        ...

    def summarize(self, values: Sequence[Any]) -> dict[str, float]:
        """The round's metrics from the non-``None`` measurements (at least one)."""
        ...


class NoPlanner:
    """Every round as configured."""

    def plan(self, round: int, w: torch.Tensor, state: Mapping[str, Any],
             exp: Any) -> RoundAdjust:
        return RoundAdjust()


@register("planner", "none")
def no_planner() -> NoPlanner:
    """Every round as configured: the configured compressor and local epochs.

    Reference:
        paper: none (no adaptation).
        code: none needed.
        departures: none.
    """
    return NoPlanner()


def planner_from_config(adaptive: Any) -> RoundPlanner:
    """The round planner of a ``compression.adaptive`` section (``{name, options}``)."""
    try:
        get("planner", adaptive.name)
    except KeyError as e:
        raise ValueError(f"compression.adaptive.name: {e.args[0] if e.args else e}") from None
    planner: RoundPlanner = build("planner", adaptive.name, dict(adaptive.options),
                                  "compression.adaptive.options")
    return planner


def metric_hooks(metrics: Any) -> list[ClientMetric]:
    """The client metrics a ``metrics`` section turns on, built with their options:
    the section's ``NAME_OPTION`` keys the factory takes, then ``options[NAME]``."""
    hooks = []
    extra = getattr(metrics, "options", {}) or {}
    for name in metric_names(metrics):
        field_ = f"metrics.options.{name}"
        try:
            factory = get("metric", name)
        except KeyError as e:
            raise ValueError(f"metrics.hooks: {e.args[0] if e.args else e}") from None
        prefix = f"{name}_"
        section = {f.name[len(prefix):]: getattr(metrics, f.name)
                   for f in dataclasses.fields(metrics) if f.name.startswith(prefix)}
        opts = accepted_options(factory, section)
        own = extra.get(name, {})
        if not isinstance(own, Mapping):
            raise ValueError(f"{field_}: must be a mapping, got {own!r}")
        opts.update(own)
        hooks.append(build("metric", name, opts, field_))
    return hooks
