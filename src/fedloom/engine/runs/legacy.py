"""The one reader of checkpoints written in an earlier layout.

A checkpoint of an earlier version lacks entries that later ones added, or keeps
one in an older shape. :func:`current_layout` turns its state dict into this
version's layout, once, where a checkpoint is read
(:func:`fedloom.engine.runs.directory`'s restore of ``last.pt`` or ``prev.pt``), so that
:func:`fedloom.engine.snapshot.restore_state` reads the current layout only. Each
entry a version lacked takes the value that means the behaviour from before it:

- ``buffers`` (before module buffers were kept): none, for a model without
  buffers; a model with buffers cannot resume without them (``None``, which the
  restore refuses, naming it);
- ``sim_time_s`` (before the simulated clock): 0;
- ``privacy_state`` (before :mod:`fedloom.privacy`; empty for no mechanism): the
  mechanism's initial state;
- ``events`` (before the event modes): none in flight;
- ``selection_state`` (before client selectors, which ran the stateless uniform
  selection): the selector's initial state;
- ``evaluation`` (before the state held its last evaluation's per-client numbers):
  none (the run's last round evaluates again);
- ``opt_state`` as one flat mapping (before the server step became a chain of
  transforms): the chain's tuple (:func:`legacy_opt_state`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Fresh", "current_layout", "legacy_opt_state"]


@dataclass(frozen=True)
class Fresh:
    """What this run starts with, for the entries an earlier checkpoint lacks."""

    has_buffers: bool                                   # the model has buffers
    opt_state: Callable[[torch.Tensor], Any]            # the server optimizer's init(w)
    privacy_state: Callable[[], dict[str, Any]]         # the mechanism's init()
    selection_state: Callable[[], dict[str, Any]]       # the selector's state before round 0


def current_layout(ckpt: dict[str, Any], fresh: Fresh) -> dict[str, Any]:
    """The state dict ``ckpt`` in this version's layout (see the module docstring);
    a new dict, ``ckpt`` unchanged. :class:`ValueError` for a flat ``opt_state``
    that does not fit the server optimizer."""
    out = dict(ckpt)
    if "buffers" not in out:
        out["buffers"] = None if fresh.has_buffers else {}
    out.setdefault("sim_time_s", 0.0)
    if not out.get("privacy_state"):
        out["privacy_state"] = fresh.privacy_state()
    if not out.get("events"):
        out["events"] = {}
    if out.get("selection_state") is None:
        out["selection_state"] = fresh.selection_state()
    out.setdefault("evaluation", {})
    out["opt_state"] = legacy_opt_state(out["opt_state"], lambda: fresh.opt_state(out["w"]))
    return out


def legacy_opt_state(stored: Any, fresh: Callable[[], Any]) -> Any:
    """A checkpoint's server-optimizer state in this version's layout.

    A chain of server transforms (:mod:`fedloom.transforms`) keeps a tuple, one
    entry a transform: ``None`` or its own mapping of named tensors. Earlier
    versions kept one flat mapping, each transform's tensors in chain order under
    the same names (``v``, ``m``, with the ``prefix`` that kept two of a kind
    apart). Where ``stored`` is a mapping and the optimizer's fresh state
    (``fresh()``, its ``init(w)``) a tuple, each transform's mapping takes the
    next entries of the flat one by name, each a tensor of the fresh one's shape
    and dtype (:class:`ValueError` if not); any other state is returned as stored.
    """
    if not isinstance(stored, dict):
        return stored
    template = fresh()
    if not isinstance(template, tuple):
        return stored
    flat = list(stored.items())
    out: list[dict[str, Any] | None] = []
    for own in template:
        if own is None:  # a stateless transform (a scale)
            out.append(None)
            continue
        if not isinstance(own, dict):
            raise ValueError("'opt_state' is one flat mapping (an earlier version's) and the "
                             f"server optimizer keeps a {type(own).__name__} for a transform")
        group, flat = dict(flat[:len(own)]), flat[len(own):]
        out.append({name: _legacy_entry(group, name, like) for name, like in own.items()})
    if flat:
        raise ValueError(f"'opt_state' holds {flat[0][0]!r}, which the server optimizer "
                         "does not keep")
    return tuple(out)


def _legacy_entry(group: dict[str, Any], name: str, like: Any) -> Any:
    """The entry ``name`` of a transform's group of a flat state (``PREFIX + name``)."""
    keys = [k for k in group if k == name] or [k for k in group if k.endswith(name)]
    value = group[keys[0]] if len(keys) == 1 else None
    if not (isinstance(value, torch.Tensor) and isinstance(like, torch.Tensor)
            and value.shape == like.shape and value.dtype == like.dtype):
        raise ValueError(f"'opt_state' has no tensor {name!r} of the server optimizer's "
                         "shape and dtype where its flat layout should")
    return value
