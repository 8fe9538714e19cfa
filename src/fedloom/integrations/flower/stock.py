"""Compression and error feedback for a stock Flower ClientApp, as one mod.

:class:`CompressionMod` wraps a train handler written the Flower way (it loads
``msg.content["arrays"]``, trains, and replies with
``ArrayRecord(model.state_dict())`` and a ``MetricRecord`` with
``num-examples``) and turns its reply into a compressed payload::

    app = ClientApp(mods=[CompressionMod("topk", {"ratio": 0.01}, feedback="sapef",
                                         alpha=0.5)])

and the server's strategy decodes it with the same settings::

    strategy = CRAFT(compression="topk", compression_options={"ratio": 0.01})


Per message the mod loads the client's residual from ``Context.state`` (and for
SA-PEF hands the app the model moved to ``w − α e``), computes ``g = w − w_k``
against the model received, sends ``C(g + (1 − α) e)`` and keeps the new residual
(only when finite). The reply has no ``ArrayRecord``, so a strategy that does not
decode it (Flower's ``FedAvg``) stops instead of averaging a payload. Policies:
``none``, ``ef``, ``saef``, ``sapef`` (constant α) need nothing from the app;
``flare`` and ``ec_prox`` need the app to apply :class:`LocalPenalty`
(``app_applies_penalty=True``); ``ef21``, ``cser`` and ``scafcom`` are refused.
The message's records, random streams and each policy's needs:
docs/deploy.md (``CompressionMod`` in detail).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from fedloom.compress import make_compressor
from fedloom.compress.feedback import UplinkContext, make_feedback
from fedloom.integrations.flower.records import StateLayout, pack_buffers, rec_float, rec_int
from fedloom.integrations.flower.strategies import (
    BUFFERS_KEY,
    NODE_KEY,
    PARTITION_FIELD,
    PAYLOAD_KEY,
)
from fedloom.rng import Purpose, torch_gen

try:
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
except ImportError as e:  # pragma: no cover (the extra is missing)
    raise ImportError("fedloom.integrations.flower needs Flower: pip install 'fedloom[flower]'"
                      ) from e

__all__ = ["PENALTY_FEEDBACK", "STOCK_FEEDBACK", "CompressionMod", "LocalPenalty",
           "partition_id_mod"]

STOCK_FEEDBACK = ("none", "ef", "saef", "sapef")
PENALTY_FEEDBACK = ("flare", "ec_prox")   # need app_applies_penalty=True
PENALTY_KEY = "fedloom.penalty"           # ArrayRecord: target (and mask) of the round
PENALTY_CONFIG_KEY = "fedloom.penalty-config"
STATE_KEY = "fedloom.stock-feedback"   # Context.state: the policy's rows
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16}


class CompressionMod:
    """A Flower mod: a fedloom compressor and error-feedback policy on a stock
    ClientApp's reply (module doc).

    Args:
        compression: a registered compressor (``topk``, ``randk``, ``qsgd``, …).
        options: its options by name (``{"ratio": 0.01}``).
        feedback: ``none``, ``ef``, ``saef``, ``sapef``; ``flare`` or ``ec_prox``
            with ``app_applies_penalty=True``.
        alpha: SA-PEF's α in [0, 1] (``sapef`` only).
        feedback_options: the policy's other options by name (FLARE's ``tau``,
            ``tau_decay``, ``penalty_steps``, ``penalty``).
        app_applies_penalty: the wrapped app calls :class:`LocalPenalty`.
        seed: the run seed of the compressor's random stream.
        dtype: precision of ``g`` and the residual on the client.
        state_dtype: precision the residual is kept in between rounds.
        model, buffers: as :class:`~fedloom.integrations.flower.strategies.FedloomRule`.
    """

    def __init__(self, compression: str, options: Mapping[str, Any] | None = None, *,
                 feedback: str = "ef", alpha: float | None = None,
                 feedback_options: Mapping[str, Any] | None = None,
                 app_applies_penalty: bool = False, seed: int = 0,
                 dtype: str = "float32", state_dtype: str = "float32",
                 model: nn.Module | None = None,
                 buffers: Iterable[str] | Callable[[str], bool] | None = None) -> None:
        if feedback in PENALTY_FEEDBACK and not app_applies_penalty:
            raise ValueError(f"feedback: {feedback!r} adds a penalty to the local loss; a "
                             "stock app applies it only when it calls LocalPenalty "
                             "(then pass app_applies_penalty=True)")
        if feedback not in STOCK_FEEDBACK + PENALTY_FEEDBACK:
            raise ValueError(f"feedback: {feedback!r} needs fedloom's own train handler or "
                             f"server-side state; a stock app takes one of "
                             f"{', '.join(STOCK_FEEDBACK + PENALTY_FEEDBACK)}")
        fb_opts: dict[str, Any] = dict(feedback_options or {})
        if alpha is not None:
            if feedback != "sapef":
                raise ValueError(f"alpha: only for feedback 'sapef', not {feedback!r}")
            fb_opts["alpha"] = alpha
        self.feedback_name, self.feedback_options = feedback, fb_opts
        self.compression, self.options = compression, dict(options or {})
        for name, v in (("dtype", dtype), ("state_dtype", state_dtype)):
            if v not in _DTYPES:
                raise ValueError(f"{name}: must be one of {', '.join(_DTYPES)}, got {v!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: must be an integer >= 0, got {seed!r}")
        self.seed = seed
        self.dtype, self.state_dtype = _DTYPES[dtype], _DTYPES[state_dtype]
        self.model, self.buffer_names = model, buffers
        self._parts: tuple[StateLayout, Any, Any] | None = None
        # Check the names and options now, on a one-tensor layout, so a typo fails
        # when the app is built, not on the first message.
        from fedloom.params import Layout

        probe = Layout.flat(16)
        make_compressor(compression, layout=probe, **self.options)
        self.feedback = self._feedback(probe)

    def _feedback(self, layout: Any) -> Any:
        from fedloom.registry import accepted_options, get

        extra = accepted_options(get("feedback", self.feedback_name), {"layout": layout})
        return make_feedback(self.feedback_name, **self.feedback_options, **extra)

    def _setup(self, arrays: ArrayRecord) -> tuple[StateLayout, Any, Any]:
        if self._parts is None:
            sl = StateLayout.from_arrays(arrays, model=self.model, buffers=self.buffer_names)
            comp = make_compressor(self.compression, layout=sl.layout, **self.options)
            self._parts = (sl, comp, self._feedback(sl.layout))
        return self._parts

    def __call__(self, msg: Message, context: Context, call_next: Any) -> Message:
        if not msg.metadata.message_type.startswith(MessageType.TRAIN):
            return call_next(msg, context)
        sl, comp, fb = self._setup(msg.content.array_records["arrays"])
        w, bufs = sl.split(msg.content.array_records["arrays"], self.dtype)
        conf = msg.content.config_records.get("config", ConfigRecord())
        r = rec_int(conf["server-round"]) - 1 if "server-round" in conf else 0
        lr = rec_float(conf["lr"]) if "lr" in conf else 0.0
        k = _client(context)
        state = self._load(context, sl.layout.size)
        alpha = fb.alpha(lr, 1, {})
        start = fb.start_point(w, state, alpha)
        penalty = fb.penalty(w, state, r)
        if start is not None or penalty is not None:
            # A new RecordDict: the one received may be shared with other messages.
            content = RecordDict(dict(msg.content.items()))
            if start is not None:  # SA-PEF: the app trains from w − α e
                content["arrays"] = sl.join(start, bufs)
            if penalty is not None:  # FLARE / EC+prox: for LocalPenalty
                vecs = OrderedDict(target=penalty.target.detach().clone())
                if penalty.mask is not None:
                    vecs["mask"] = penalty.mask.detach().clone()
                content[PENALTY_KEY] = ArrayRecord(vecs)
                content[PENALTY_CONFIG_KEY] = ConfigRecord({
                    "tau": float(penalty.tau), "steps": int(min(penalty.steps, 2**62)),
                    "kind": penalty.kind})
            msg.content = content
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        w_k, bufs_k = sl.split(reply.content["arrays"], self.dtype)
        g = (w - w_k).contiguous()
        ctx = UplinkContext(r, lr, 1, alpha, torch_gen(self.seed, r, k, Purpose.COMPRESS))
        up = fb.uplink(g, state, comp, ctx, {})
        if (up.sent is None or bool(torch.isfinite(up.sent).all())) and all(
                bool(torch.isfinite(v).all()) for v in up.state.values()):
            self._save(context, up.state)
        fields: dict[str, Any] = {"payload": up.payload,
                                  "residual-norm": float(up.residual_norm)}
        if bufs_k:  # raw bytes, in the layout's order and dtypes (see the module doc)
            fields[BUFFERS_KEY] = pack_buffers(sl, bufs_k)
        pid = _partition_id(context)
        if pid is not None:  # the strategy names the client by it in its log
            fields[PARTITION_FIELD] = pid
        content = RecordDict({PAYLOAD_KEY: ConfigRecord(fields)})
        for name, rec in reply.content.metric_records.items():
            content[name] = rec
        return Message(content, reply_to=msg)

    def _load(self, context: Context, d: int) -> dict[str, torch.Tensor]:
        assert self._parts is not None
        fields = self._parts[2].fields(d)
        if STATE_KEY in context.state:
            rec = context.state.array_records[STATE_KEY].to_torch_state_dict()
            if all(f in rec and rec[f].numel() == d for f in fields):
                return {f: rec[f].to(self.dtype) for f in fields}
            raise ValueError(f"Context.state[{STATE_KEY!r}]: the kept residual is not of "
                             f"this model (size {d})")
        return {f: torch.zeros(d, dtype=self.dtype) for f in fields}

    def _save(self, context: Context, state: Mapping[str, torch.Tensor]) -> None:
        if state:
            context.state[STATE_KEY] = ArrayRecord(OrderedDict(
                (f, v.detach().to(self.state_dtype).clone()) for f, v in state.items()))


def _partition_id(context: Context) -> int | None:
    v = context.node_config.get("partition-id", context.node_config.get("client-id"))
    return int(v) if isinstance(v, int | float | str) and str(v).lstrip("-").isdigit() else None


def partition_id_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """A Flower mod that adds the SuperNode's ``partition-id`` (``node_config``) to
    each train reply, in a ConfigRecord ``"fedloom.node"``, so that fedloom's
    strategies name a rejected or failed client by it rather than by Flower's
    64-bit node id. Flower's own strategies ignore the record.
    (:class:`CompressionMod` replies carry it already.)"""
    reply = call_next(msg, context)
    pid = _partition_id(context)
    if (pid is not None and not reply.has_error()
            and msg.metadata.message_type.startswith(MessageType.TRAIN)):
        reply.content[NODE_KEY] = ConfigRecord({PARTITION_FIELD: pid})
    return reply


def _client(context: Context) -> int:
    cfg = context.node_config
    for key in ("partition-id", "client-id"):
        if key in cfg:
            return int(cfg[key])
    return int(context.node_id)


class LocalPenalty:
    """FLARE's / EC+prox's penalty for a stock train handler (module doc).

    ``from_message(msg, model)`` reads what :class:`CompressionMod` sent with the
    arrays (an inactive penalty when it sent none: a round without one, or
    another policy); ``apply(model, step)`` adds the penalty's gradient to each
    parameter's ``.grad`` on the first ``steps`` local steps of the round, as
    fedloom's local SGD adds it to its flat gradient.
    """

    def __init__(self, views: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]],
                 tau: float, steps: int, kind: str) -> None:
        self.views, self.tau, self.steps, self.kind = views, tau, steps, kind

    @classmethod
    def from_message(cls, msg: Message, model: nn.Module) -> LocalPenalty:
        content = msg.content
        if PENALTY_KEY not in content.array_records:
            return cls({}, 0.0, 0, "l1")
        conf = content.config_records[PENALTY_CONFIG_KEY]
        vecs = content.array_records[PENALTY_KEY].to_torch_state_dict()
        sl = StateLayout.from_arrays(content.array_records["arrays"])
        target = sl.layout.unflatten(vecs["target"])
        mask = sl.layout.unflatten(vecs["mask"]) if "mask" in vecs else None
        params = dict(model.named_parameters())
        missing = [n for n in target if n not in params]
        if missing:
            raise ValueError(f"{PENALTY_KEY}: the model has no parameter {missing[0]!r}")
        views = {n: (t, None if mask is None else mask[n]) for n, t in target.items()}
        return cls(views, rec_float(conf["tau"]), rec_int(conf["steps"]), str(conf["kind"]))

    @property
    def active(self) -> bool:
        return bool(self.views) and self.steps > 0 and self.tau > 0

    def apply(self, model: nn.Module, step: int) -> None:
        """Add ``τ m sign(w − t)`` (``l1``) or ``2τ m (w − t)`` (``l2``) to the grads."""
        if not self.active or step >= self.steps:
            return
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, (t, m) in self.views.items():
                p = params[name]
                diff = p - t.to(p.device, p.dtype)
                g = torch.sign(diff) if self.kind == "l1" else 2.0 * diff
                if m is not None:
                    g = g * m.to(p.device, p.dtype)
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.add_(self.tau * g)
