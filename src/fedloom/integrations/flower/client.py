"""The client side: :class:`FedloomMod`, :class:`FedloomTrainer` and :func:`client_app`.

The mod applies a fedloom compressor and error-feedback policy to any ClientApp's
outgoing update and answers the strategy's discovery query; the trainer is
:func:`client_app`'s train handler, fedloom's local SGD on client ``k``'s partition
(the package docstring has the message formats, the buffers and the scope).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp

from fedloom.buffers import flatten_buffers, unflatten_buffers
from fedloom.compress import make_compressor
from fedloom.compress.feedback import UplinkContext, feedback_from_config
from fedloom.config import Config, load_config
from fedloom.engine.clientfields import FEEDBACK
from fedloom.engine.inputs import ModelSpace
from fedloom.engine.stages.plan import client_job
from fedloom.integrations.flower.cache import _client_data, _experiment
from fedloom.integrations.flower.messages import (
    BUFFER_STATE_KEY,
    BUFFERS_KEY,
    HELLO_KEY,
    REPLY_KEY,
    STATE_KEY,
    ConfigSource,
    _check_scope,
    _client_id,
    _round_settings,
    buffers_from_arrays,
    buffers_to_arrays,
    from_arrays,
    to_arrays,
)
from fedloom.params import Layout
from fedloom.privacy import make_privacy
from fedloom.rng import Purpose, torch_gen


class FedloomMod:
    """Compressor + error feedback on a ClientApp's outgoing update (see module doc).

    Args:
        config: the fedloom config (its ``compression`` section and ``seed`` are used).
        layout: the model's :class:`~fedloom.params.Layout`; by default built from
            the config's model and data, as fedloom's own engine does.
    """

    def __init__(self, config: ConfigSource, overrides: Sequence[str] = (), *,
                 layout: Layout | None = None) -> None:
        self.cfg = load_config(config, overrides)
        _check_scope(self.cfg)
        # privacy.mode=local: the client clips and adds its noise before its feedback
        # policy and compressor, as in the engine (fedloom.privacy; N is not used here).
        self.privacy = make_privacy(self.cfg, self.cfg.data.num_clients)
        self._layout = layout
        self._parts: tuple[Layout, Any, Any] | None = None
        # Kept in the precision the engine's state store uses (state.dtype), so a
        # Flower run and `fedloom run` round the residual alike.
        self.state_dtype = {"float32": torch.float32, "float16": torch.float16}[
            self.cfg.state.dtype]

    def parts(self) -> tuple[Layout, Any, Any]:
        if self._parts is None:
            layout = self._layout or _experiment(self.cfg).space.layout
            c = self.cfg.compression
            comp = make_compressor(c.name, layout=layout, **c.options)
            fb = feedback_from_config(c.feedback, layout)
            self._parts = (layout, comp, fb)
        return self._parts

    def __call__(self, msg: Message, context: Context, call_next: Any) -> Message:
        mtype = msg.metadata.message_type
        if not mtype.startswith(MessageType.TRAIN):
            return call_next(msg, context)
        if HELLO_KEY in msg.content:  # the strategy's discovery, answered here
            return Message(RecordDict({HELLO_KEY: ConfigRecord(
                {"client-id": _client_id(context)})}), reply_to=msg)
        layout, comp, fb = self.parts()
        k, r, lr = _round_settings(msg, context, self.cfg)
        w = from_arrays(layout, msg.content.array_records["arrays"])
        state = self._load_state(context, fb, layout.size, w.dtype)
        alpha = fb.alpha(lr, 1, {})
        start = fb.start_point(w, state, alpha)
        if start is not None:  # SA-PEF: the client trains from w − α e
            msg.content["arrays"] = to_arrays(layout, start)
        reply = call_next(msg, context)
        if reply.has_error():
            return reply
        w_k = from_arrays(layout, reply.content["arrays"]).to(w.dtype)
        metrics = reply.content["metrics"]
        steps = int(metrics["num-steps"]) if "num-steps" in metrics else 1
        g = (w - w_k).contiguous()
        if self.privacy.local:  # a non-finite update is sent as zero plus noise
            g, _ = self.privacy.privatize(g if bool(torch.isfinite(g).all())
                                          else torch.zeros_like(g), r, k)
        ctx = UplinkContext(r, lr, steps, alpha,
                            torch_gen(self.cfg.seed, r, k, Purpose.COMPRESS))
        up = fb.uplink(g, state, comp, ctx, {})
        # A non-finite update is rejected by the server; the state stays as it was,
        # as the engine does for a rejected client.
        if (up.sent is None or bool(torch.isfinite(up.sent).all())) and all(
                bool(torch.isfinite(v).all()) for v in up.state.values()):
            self._save_state(context, up.state, self.state_dtype)
        content = RecordDict({
            REPLY_KEY: ConfigRecord({"payload": up.payload, "client-id": k,
                                     "residual-norm": float(up.residual_norm)}),
            "metrics": metrics,
        })
        if BUFFERS_KEY in reply.content:  # the trained module buffers, as they are
            content[BUFFERS_KEY] = reply.content[BUFFERS_KEY]
        return Message(content, reply_to=msg)

    @staticmethod
    def _load_state(context: Context, fb: Any, d: int,
                    dtype: torch.dtype) -> dict[str, torch.Tensor]:
        fields = fb.fields(d)
        if STATE_KEY in context.state:
            rec = context.state.array_records[STATE_KEY].to_torch_state_dict()
            return {f: rec[f].to(dtype) for f in fields}
        return {f: torch.zeros(d, dtype=dtype) for f in fields}

    @staticmethod
    def _save_state(context: Context, state: Mapping[str, torch.Tensor],
                    dtype: torch.dtype) -> None:
        if state:
            context.state[STATE_KEY] = ArrayRecord(
                OrderedDict((k, v.detach().to(dtype).clone()) for k, v in state.items()))


class FedloomTrainer:
    """The train handler of :func:`client_app`: fedloom's local SGD on client k's data.

    A model with buffers trains from the buffers the message carries (the global
    ones), or under ``model.buffers: local`` from the client's own, kept in
    ``Context.state`` once it has trained (the engine's ``bn.buffers`` row, in
    ``state.dtype``), and replies with the buffers its training ends with. Nothing
    of a previous message in the same process is used.
    """

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.state_dtype = {"float32": torch.float32, "float16": torch.float16}[
            cfg.state.dtype]

    def __call__(self, msg: Message, context: Context) -> Message:
        exp = _experiment(self.cfg)
        space, clients, algo = exp.space, exp.clients, exp.algorithm
        k, r, lr = _round_settings(msg, context, self.cfg)
        if not 0 <= k < clients.num_clients:
            raise ValueError(f"client-id: {k} is not a client of this config "
                             f"(0..{clients.num_clients - 1})")
        w = from_arrays(space.layout, msg.content.array_records["arrays"]).to(space.dtype)
        x_k, y_k = _client_data(self.cfg, clients, k)
        # The feedback policy's rows live in Context.state (kept by FedloomMod);
        # its hooks on local training (FLARE / EC+prox's penalty) come with the
        # job, built as the engine builds it. The mod already shifted the model
        # handed over to its start point (SA-PEF), so the job starts from it.
        state = (FedloomMod._load_state(context, algo.feedback, space.layout.size, w.dtype)
                 if clients.fields.has(FEEDBACK) else {})
        bufs = self._start_buffers(space, msg, context)
        job = client_job(algo.feedback, seed=self.cfg.seed, client=k, round=r, w=w, lr=lr,
                         x=x_k, y=y_k, fb_state=state, fb_server={}, alpha=0.0,
                         buffers=bufs, shifted_here=False)
        # The prox anchor is the model received (SA-PEF's start point when shifted).
        w_k, loss, steps, _ = algo.local.train(job)
        content = RecordDict({
            "arrays": to_arrays(space.layout, w_k),
            "metrics": MetricRecord({"num-examples": len(y_k), "num-steps": steps,
                                     "train-loss": float(loss)}),
        })
        if bufs:
            trained = algo.local._trained_buffers()
            content[BUFFERS_KEY] = buffers_to_arrays(trained)
            # FedBN: the client keeps what it trained to, unless its reply is not
            # finite (the server rejects it, and the engine keeps the old row).
            if (self.cfg.model.buffers == "local" and bool(torch.isfinite(w_k).all())
                    and all(bool(torch.isfinite(v).all()) for v in trained.values())):
                context.state[BUFFER_STATE_KEY] = ArrayRecord(OrderedDict(
                    own=flatten_buffers(trained, self.state_dtype).cpu()))
        return Message(content, reply_to=msg)

    def _start_buffers(self, space: ModelSpace, msg: Message, context: Context
                       ) -> dict[str, torch.Tensor] | None:
        """The buffers local training starts from: ``None`` for a model without
        any (``space``'s template is empty); the client's own under ``model.buffers:
        local`` once it has them; else the message's."""
        template = space.buffer_template
        if not template:
            return None
        if self.cfg.model.buffers == "local" and BUFFER_STATE_KEY in context.state:
            row = context.state.array_records[BUFFER_STATE_KEY].to_torch_state_dict()["own"]
            return unflatten_buffers(row.to(space.device, space.dtype), template)
        if BUFFERS_KEY not in msg.content:
            raise ValueError("buffers: the model has buffers and the message carries none "
                             f"(a {BUFFERS_KEY!r} ArrayRecord beside 'arrays')")
        return buffers_from_arrays(template, msg.content[BUFFERS_KEY])


def client_app(config: ConfigSource, overrides: Sequence[str] = ()) -> ClientApp:
    """A ClientApp that trains with fedloom's local SGD and uplinks through :class:`FedloomMod`."""
    cfg = load_config(config, overrides)
    _check_scope(cfg)
    app = ClientApp(mods=[FedloomMod(cfg)])
    app.train()(FedloomTrainer(cfg))
    return app
