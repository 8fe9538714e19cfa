"""The aggregator interface.

An aggregator holds settings; its state goes in and comes back (the optax
pattern)::

    state = agg.init(layout)
    direction, state, metrics = agg(updates, weights, state, info=info)

``updates`` is ``[m, d]`` (one pseudo-gradient ``g_k = w − w_k`` per row),
``weights`` is ``[m]`` (``n_k``; rules normalise them as they need), and the
returned direction is applied by the server optimizer as ``w ← w − η_g·opt(direction)``.

A rule states the public default of ``η_g`` for its direction as the class
attribute ``default_server_lr`` (``server.lr: auto`` uses it; FedAvg's 1.0 when
a rule does not say), or as a class method ``server_lr_for(options)`` where it
depends on the rule's options: the same ``η_g`` means very different steps for rules
whose directions differ in scale (CRAFT's is about unit length per layer). A rule whose
default changed writes it out (``resolve_options``) and reads older records as they ran
(``recorded_options``): :func:`resolve_options`, :func:`recorded_config`.

A rule declares what the engine and privacy may assume in ``capabilities``, an
:class:`~fedloom.capabilities.AggregatorCaps` (``requires``, ``linear``, ``dp_mean``,
``full_participation``, ``weighted``), read by the engine through
:func:`~fedloom.capabilities.aggregator_caps` only. Each field and the defaults:
docs/reference/api.md (Aggregators, compressors, error feedback, local methods).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fedloom.capabilities import AggregatorCaps
from fedloom.params import Layout

__all__ = ["Aggregator", "CohortInfo", "Stateless", "check_chunk", "check_cohort",
           "default_server_lr", "make_aggregator", "recorded_config", "resolve_options"]

# FedAvg's η_g (McMahan et al. 2017: w ← Σ p_k w_k), for a rule that states none.
FEDAVG_SERVER_LR = 1.0


@dataclass(frozen=True)
class CohortInfo:
    """What some rules need beyond the updates (all rows aligned with ``updates``)."""

    clients: torch.Tensor                 # client ids, int64 [m]
    round: int
    num_clients: int                      # N, the population size
    losses: torch.Tensor | None = None    # local training loss per client
    steps: torch.Tensor | None = None     # local steps per client
    lr: float | None = None               # client learning rate this round
    momentum: float = 0.0                 # client SGD momentum
    start_losses: torch.Tensor | None = None  # F_k(w): loss at the received model (before training)
    # The global model the rows are relative to (w_k = w − g_k): for rules on the
    # clients' models rather than their differences (LoRA's products B_k A_k)
    w: torch.Tensor | None = None
    # The server's own update g_0 on its root data, where the rule declares
    # AggregatorCaps.reference_samples (FLTrust's trust reference)
    reference: torch.Tensor | None = None


class Aggregator(Protocol):
    """``capabilities.requires`` names the optional :class:`CohortInfo` fields the
    rule reads; the engine computes the costly ones (``start_losses``) only when asked."""

    @property
    def capabilities(self) -> AggregatorCaps: ...

    def init(self, layout: Layout) -> Any: ...

    def __call__(
        self,
        updates: torch.Tensor,
        weights: torch.Tensor,
        state: Any,
        *,
        info: CohortInfo | None = None,
    ) -> tuple[torch.Tensor, Any, Mapping[str, float]]: ...


class Stateless:
    """Base of the rules that keep no state between rounds (``init`` gives ``None``)."""

    def init(self, layout: Layout) -> None:
        return None


def make_aggregator(name: str, **options: Any) -> Aggregator:
    """Build a registered aggregator; unknown options raise a ``ValueError`` naming them."""
    from fedloom.registry import build

    agg: Aggregator = build("aggregator", name, options, "aggregator.options")
    return agg


def default_server_lr(name: str, options: Mapping[str, Any] | None = None) -> float:
    """The public default server step of aggregator ``name`` (``server.lr: auto``);
    a rule whose step scale depends on its options says so with a class method
    ``server_lr_for(options)`` (CRAFT's ``step``)."""
    from fedloom.registry import get

    cls = get("aggregator", name)
    pick = getattr(cls, "server_lr_for", None)
    value = (pick(dict(options or {})) if callable(pick)
             else getattr(cls, "default_server_lr", FEDAVG_SERVER_LR))
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1e300:
        raise ValueError(f"aggregator {name!r}: default_server_lr must be a number > 0, "
                         f"got {value!r}")
    return float(value)


def resolve_options(name: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``options`` of aggregator ``name`` with what this version's defaults decide written
    out (a class method ``resolve_options(options)``: CRAFT's step), so that a run's
    ``config.yaml`` needs no default of this version; as given for other rules and for a
    name not registered (or a plug-in not imported)."""
    return _hook(name, "resolve_options", options)


def recorded_config(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded config (``config.yaml`` as a mapping) with its aggregator's options as
    its run used them (a class method ``recorded_options(options)``: a CRAFT record from
    before its default moved names no step, and ran step fixed)."""
    out = dict(saved)
    agg = out.get("aggregator")
    if isinstance(agg, Mapping) and isinstance(agg.get("name"), str):
        opts = agg.get("options")
        opts = opts if isinstance(opts, Mapping) else {}
        out["aggregator"] = {**agg, "options": _hook(agg["name"], "recorded_options", opts)}
    return out


def _hook(name: str, method: str, options: Mapping[str, Any] | None) -> dict[str, Any]:
    from fedloom.registry import get

    opts = dict(options or {})
    try:
        cls = get("aggregator", name)
    except (KeyError, ValueError):  # unknown (reported where it is built), not imported
        return opts
    pick = getattr(cls, method, None)
    return dict(pick(opts)) if callable(pick) else opts


def normalise_weights(weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``p_k = n_k / Σ n_j``."""
    w = weights.to(dtype)
    total = w.sum()
    if not torch.isfinite(total) or total <= 0:
        raise ValueError("aggregator: weights must be finite with a positive sum")
    return w / total


def check_cohort(rule: str, updates: torch.Tensor, weights: torch.Tensor) -> None:
    """One line naming the rule when ``updates`` is not ``[m, d]`` with one weight a row."""
    if updates.ndim != 2 or weights.shape != (updates.shape[0],):
        raise ValueError(
            f"{rule}: updates {tuple(updates.shape)} and weights {tuple(weights.shape)} "
            "do not align"
        )


def check_chunk(chunk: object) -> int:
    """``aggregator.options.chunk``: a column chunk, an integer >= 1."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"aggregator.options.chunk: must be an integer >= 1, got {chunk!r}")
    return chunk
