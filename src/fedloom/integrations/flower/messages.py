"""What fedloom's Flower messages carry, and what both apps check before a round.

The records' keys (the mod's ``Context.state`` record, a reply's ConfigRecord, the
discovery query, the buffers' ArrayRecord), a model's flat vector and its buffers as
ArrayRecords (:func:`to_arrays`, :func:`from_arrays`, :func:`buffers_to_arrays`,
:func:`buffers_from_arrays`), a message's serialized size (:func:`content_bytes`),
which client a SuperNode is and a train message's round settings, and the scope
check a config passes on Flower (the package docstring's "Scope").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, Context, Message

from fedloom.buffers import check_buffers
from fedloom.config import Config, ConfigError
from fedloom.integrations.flower.records import rec_float, rec_int
from fedloom.params import Layout

SUPPORTED_FEEDBACK = ("none", "ef", "saef", "sapef", "flare", "ec_prox")
# A policy's hooks on local training (FLARE's and EC+prox's penalty on the first
# local steps) need FedloomTrainer, which reads the mod's state, not any train handler.
STATE_KEY = "fedloom.feedback"   # Context.state record of the mod
REPLY_KEY = "fedloom"            # ConfigRecord of a reply: payload, client-id, residual-norm
HELLO_KEY = "fedloom.hello"      # ConfigRecord of the discovery query
# A model with buffers (BatchNorm statistics; fedloom.buffers): the ArrayRecord beside
# "arrays" in a train message (the global buffers) and in its reply (the trained ones);
# absent for a model without buffers, so those messages are as before.
BUFFERS_KEY = "buffers"
BUFFER_STATE_KEY = "fedloom.buffers"  # Context.state record: the client's own (local)

ConfigSource = str | Path | Mapping[str, Any] | Config


def to_arrays(layout: Layout, w: torch.Tensor) -> ArrayRecord:
    """The flat vector as an ArrayRecord of the model's named tensors."""
    return ArrayRecord(OrderedDict((k, v.detach().clone()) for k, v in layout.unflatten(w).items()))


def from_arrays(layout: Layout, rec: ArrayRecord) -> torch.Tensor:
    """An ArrayRecord of named tensors as the flat vector (missing or misshapen
    tensors raise a one-line ``ValueError`` naming the tensor)."""
    sd = rec.to_torch_state_dict()
    for spec in layout.tensors:
        if spec.name not in sd:
            raise ValueError(f"arrays: no tensor {spec.name!r} in the message")
        if tuple(sd[spec.name].shape) != spec.shape:
            raise ValueError(f"arrays: tensor {spec.name!r} has shape "
                             f"{tuple(sd[spec.name].shape)}, the model has {spec.shape}")
    return layout.flatten(sd)


def buffers_to_arrays(bufs: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Module buffers as an ArrayRecord (names and dtypes kept, in order)."""
    return ArrayRecord(OrderedDict((n, v.detach().cpu().clone()) for n, v in bufs.items()))


def buffers_from_arrays(template: Mapping[str, torch.Tensor], rec: Any
                        ) -> dict[str, torch.Tensor]:
    """The buffers of an ArrayRecord, checked against ``template`` (the model's:
    the same names in the same order, dtypes and shapes; else a one-line
    ``ValueError``), on the template's device."""
    if not isinstance(rec, ArrayRecord):
        raise ValueError(f"buffers: a {type(rec).__name__}, not an ArrayRecord")
    try:
        bufs = dict(rec.to_torch_state_dict())
    except (TypeError, RuntimeError) as e:  # an array torch cannot hold
        raise ValueError(f"buffers: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                         ) from None
    why = check_buffers(bufs, template)
    if why is not None:
        raise ValueError(f"buffers: {why}")
    return {n: v.to(template[n].device) for n, v in bufs.items()}


def content_bytes(obj: Any) -> int:
    """Serialized size of a Flower object and everything under it (what its
    transport carries, before gRPC's own framing)."""
    children = getattr(obj, "children", None) or {}
    return len(obj.deflate()) + sum(content_bytes(c) for c in children.values())


def _client_id(context: Context) -> int:
    cfg = context.node_config
    for key in ("client-id", "partition-id"):
        if key in cfg:
            return int(cfg[key])
    raise ValueError("node_config: set client-id or partition-id for this SuperNode")


def _round_settings(msg: Message, context: Context, cfg: Config) -> tuple[int, int, float]:
    """(client, 0-based round, learning rate) of a train message: what the strategy
    sent, else the node's client id, Flower's server round and the config's lr."""
    conf = msg.content["config"]
    k = rec_int(conf["client-id"]) if "client-id" in conf else _client_id(context)
    r = (rec_int(conf["fedloom-round"]) if "fedloom-round" in conf
         else rec_int(conf["server-round"]) - 1)
    lr = rec_float(conf["lr"]) if "lr" in conf else cfg.client.lr
    return k, r, lr


def _check_scope(cfg: Config) -> None:
    fb = cfg.compression.feedback.name
    if fb not in SUPPORTED_FEEDBACK:
        raise ConfigError(f"compression.feedback.name: {fb!r} changes local training or needs "
                          f"server-side client state; on Flower use one of "
                          f"{', '.join(SUPPORTED_FEEDBACK)}")
    if cfg.compression.feedback.options.get("alpha_schedule", "constant") != "constant":
        raise ConfigError("compression.feedback.options.alpha_schedule: only 'constant' on "
                          "Flower")
    if cfg.compression.adaptive.name != "none":
        raise ConfigError("compression.adaptive.name: not supported on Flower")
    if cfg.attack.fraction > 0:  # a Flower client trains and sends its own update
        raise ConfigError("attack.fraction: Byzantine clients are simulated in-process "
                          "(fedloom run, any backend), not on Flower")
    if cfg.client.method.name != "sgd":
        raise ConfigError(f"client.method.name: {cfg.client.method.name!r} is not supported "
                          "on Flower (use sgd)")
    # Real clients have real time: the simulated clock, deadline and dropouts are
    # in-process only (availability is the cohort sampling, which applies here too).
    if cfg.system.profile != "off" or cfg.system.dropout > 0:
        raise ConfigError("system.profile: simulated devices and dropouts are for in-process "
                          "runs; on Flower only system.availability/pattern apply")
