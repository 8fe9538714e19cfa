"""The arguments of :class:`~fedloom.integrations.flower.strategies.FedloomRule`,
checked and grouped: the replies' screening (:class:`Screening`), the records' format
(:class:`RecordFormat`), and the rule and server optimizer it is given or names."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fedloom.aggregate.base import Aggregator, default_server_lr, make_aggregator
from fedloom.engine.objects import object_name
from fedloom.registry import build

_DTYPES = {"float32": torch.float32, "float64": torch.float64}


@dataclasses.dataclass(frozen=True)
class Screening:
    """The engine's screening of the replies (``server.*`` of a fedloom config): the
    norm bounds, the clip, and the most examples a reply may claim (``None``: none)."""

    max_update_norm: float | None = None
    max_norm_ratio: float | None = 1e4
    clip_norm: float | None = None
    max_num_examples: float | None = None

    def __post_init__(self) -> None:
        for name, v in (("max_update_norm", self.max_update_norm),
                        ("clip_norm", self.clip_norm),
                        ("max_num_examples", self.max_num_examples)):
            if v is not None:
                check_number(name, v, low=0.0)
        if self.max_norm_ratio is not None:
            check_number("max_norm_ratio", self.max_norm_ratio, low=1.0)


@dataclasses.dataclass(frozen=True)
class RecordFormat:
    """How the records' arrays are read and written: the precision of ``g_k`` and the
    step, the module they belong to, which keys are buffers and what becomes of them,
    and the compressor of compressed replies (``None``: every reply carries arrays)."""

    dtype: torch.dtype = torch.float32
    model: nn.Module | None = None
    buffers: Iterable[str] | Callable[[str], bool] | None = None
    buffers_policy: str = "average"
    compression: str | None = None
    compression_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def checked(cls, dtype: str, model: nn.Module | None,
                buffers: Iterable[str] | Callable[[str], bool] | None, buffers_policy: str,
                compression: str | None, compression_options: Mapping[str, Any] | None
                ) -> RecordFormat:
        """The format of the strategy's arguments; ``ValueError`` naming a bad one."""
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        if buffers_policy not in ("average", "keep_global"):
            raise ValueError(f"buffers_policy: must be 'average' or 'keep_global', "
                             f"got {buffers_policy!r}")
        return cls(_DTYPES[dtype], model, buffers, buffers_policy, compression,
                   dict(compression_options or {}))



def check_number(name: str, v: object, *, low: float) -> None:
    """``ValueError`` unless ``v`` is a finite number above ``low``."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not (
            math.isfinite(v) and v > low):
        raise ValueError(f"{name}: must be a finite number > {low:g}, got {v!r}")


def make_rule_aggregator(aggregator: str | Aggregator, server_lr: float | str,
                         server_optimizer: str | Any, options: dict[str, Any]
                         ) -> tuple[str, Aggregator]:
    """The rule's name and object: a registered one built with ``options``, or an
    object that holds its own (fedloom.engine.objects)."""
    if isinstance(aggregator, str):
        return aggregator, make_aggregator(aggregator, **options)
    if options:
        raise ValueError(f"{', '.join(options)}: options of an aggregator given as "
                         "an object belong to the object")
    if server_lr == "auto" and isinstance(server_optimizer, str):
        raise ValueError("server_lr: 'auto' picks a registered aggregator's default "
                         "step; with an aggregator object, give server_lr")
    return object_name(aggregator), aggregator


def make_server_optimizer(aggregator_name: str, server_optimizer: str | Any,
                          server_lr: float | str,
                          server_options: Mapping[str, float] | None,
                          options: dict[str, Any]) -> Any:
    """The server optimizer: a named one at ``server_lr`` (``auto``: the rule's
    default) with ``server_options``, or an object that holds its own."""
    if isinstance(server_optimizer, str):
        lr = (default_server_lr(aggregator_name, options) if server_lr == "auto"
              else server_lr)
        check_number("server_lr", lr, low=0.0)
        return build("server_optimizer", server_optimizer,
                     {"lr": float(lr), **(server_options or {})}, "server_options")
    if server_options or server_lr != "auto":
        raise ValueError("server_lr, server_options: a server optimizer given as an "
                         "object holds its own")
    return server_optimizer
