"""Deploying fedloom on Flower (Message API, ``flwr >= 1.21``; extra ``[flower]``).

Three pieces, each usable alone:

- :class:`FedloomStrategy` — a Flower server strategy that runs fedloom's
  server half of a round: it samples the cohort with fedloom's derived
  generator, sends each sampled client the model and its round settings,
  **decodes** the fedloom payloads it gets back (Flower's own averaging never
  sees an encoded payload: the replies carry no ``ArrayRecord`` of weights, so
  a stock strategy fails loudly instead of averaging indices as numbers; a
  model's buffers ride in their own, which a stock strategy would take for the
  model, and the next round's clients then fail on the missing weights), rejects
  non-finite or malformed updates, and aggregates with any fedloom aggregator
  (CRAFT included) and server optimizer — the same
  :meth:`~fedloom.engine.experiment.Experiment.finish_round` the in-process engine
  runs.
- :class:`FedloomMod` — a ClientApp mod that applies a fedloom compressor and
  error-feedback policy to the outgoing update ``g = w − w_k``. Its
  per-client state (EF residual, SA-PEF's residual) lives in Flower's
  ``Context.state`` across rounds; for SA-PEF it also moves the model the
  client starts from to ``w − α e``. It works with any ClientApp whose train
  handler replies with the trained weights under ``"arrays"`` (the names of
  the model's parameters) and ``"metrics"`` (``num-examples``; optionally
  ``num-steps`` and ``train-loss``) — and, for a model with buffers, the
  trained buffers under ``"buffers"``, which the mod passes on as they are.
- For a stock Flower app (its own ClientApp, its own data), the rules are
  drop-in strategies instead (:mod:`fedloom.integrations.flower.strategies`:
  ``CRAFT``, ``Krum``, …, and :class:`~fedloom.integrations.flower.stock.CompressionMod`
  for compression): no fedloom config on the SuperNodes.
- :func:`client_app` / :func:`server_app` — build both apps from a fedloom
  config: the ClientApp trains with fedloom's local SGD on client ``k``'s
  partition of the config's data (the same generators as the engine), so a
  Flower run reproduces ``fedloom run`` on the same config. The ClientApp
  keeps its data, model and client slice per process; the ServerApp pulls
  replies every 0.1 s (:func:`poll_replies`) instead of Flower's 3 s.

Module buffers (BatchNorm statistics, :mod:`fedloom.buffers`). For a model
with buffers every train message carries the global buffers as a second
ArrayRecord, ``"buffers"``, beside ``"arrays"``, and every reply the buffers
the client's local training ended with; a model without buffers sends
neither, so its messages are as they were. :class:`FedloomTrainer` trains from
the message's buffers or, under ``model.buffers: local``, from the client's
own once it has trained (kept in ``Context.state`` in ``state.dtype``, as the
engine's store row): a reply is a function of the message and the Context,
whichever process runs it and whatever that process ran before. The strategy
rejects a reply whose buffers are missing or not the model's (names in order,
dtypes, shapes) as undecodable, and hands the rest to ``finish_round``: a
client with non-finite buffers is rejected; under ``average`` and ``local``
the global buffers become the data-weighted mean of the accepted clients'
(``num_batches_tracked``: the maximum); under ``keep_global`` they never
change (the replies still carry them, so that non-finite buffers reject a
client as in the engine). Under ``local`` the server also keeps each accepted
client's buffers, which it receives anyway, and evaluates that client's test
split with them, as the engine does. Departure, shared with the mod's
residual: a client does not learn that the server rejected a finite reply (a
norm bound, a skipped round), so it keeps its new buffers where the engine
keeps the old row. Measured (tests/test_flower_buffers.py: ResNet-8 of width
4 with BatchNorm on the digits, float64, 4 clients, 2 a round, 3 rounds,
Flower's simulation): the model, the buffers and every round's evaluation
equal ``fedloom run``'s bit for bit under each policy.

Which client a SuperNode is: ``node_config["client-id"]``, else
``node_config["partition-id"]`` (set by Flower's simulation and by
``flower-supernode --node-config "partition-id=K"``). Before round 1 the
strategy asks every node (a ``query`` message the mod answers) and keeps the
client → node map. The question travels as a ``train`` message that the
mod answers itself (every training ClientApp has a train handler, not every
one a query handler).

Scope: feedback policies whose client part is a start point, a penalty on
the first local steps and an uplink (``none``, ``ef``, ``saef``, ``sapef``
with a constant α; ``flare`` and ``ec_prox``, whose penalty needs
:class:`FedloomTrainer` as the train handler); local method ``sgd``;
aggregators that do not need the clients' start losses; every
``model.buffers`` policy, except that privacy and secure aggregation (SecAgg+,
:mod:`fedloom.integrations.secagg`) take ``keep_global`` only, as in the
engine (they cover ``w``; averaged buffers would be sent in the clear). Others
(SCAFCOM's shift needs the server's control variate, EF21 and CSER need
server-side copies of client state) raise a one-line ``ConfigError`` naming
the field.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from fedloom.buffers import buffers_sha256, check_buffers, flatten_buffers, unflatten_buffers
from fedloom.client.sgd import ClientResult
from fedloom.compress import make_compressor
from fedloom.compress.base import PayloadError
from fedloom.compress.feedback import UplinkContext, UplinkResult, feedback_from_config
from fedloom.config import Config, ConfigError, config_to_dict, load_config
from fedloom.engine.dispatch import client_job
from fedloom.engine.experiment import Experiment
from fedloom.engine.fields import FEEDBACK
from fedloom.engine.runstate import RunState, model_sha256
from fedloom.params import Layout
from fedloom.privacy import make_privacy
from fedloom.rng import Purpose, torch_gen

try:
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
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import Strategy
except ImportError as e:  # pragma: no cover (the extra is missing)
    raise ImportError("fedloom.integrations.flower needs Flower: pip install 'fedloom[flower]'"
                      ) from e

__all__ = ["FedloomMod", "FedloomStrategy", "FedloomTrainer", "client_app", "from_arrays",
           "poll_replies", "server_app", "to_arrays"]

log = logging.getLogger("fedloom")

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


# --------------------------------------------------------------------- arrays
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
    k = int(conf["client-id"]) if "client-id" in conf else _client_id(context)
    r = int(conf["fedloom-round"]) if "fedloom-round" in conf else int(conf["server-round"]) - 1
    lr = float(conf["lr"]) if "lr" in conf else cfg.client.lr
    return k, r, lr


def _check_scope(cfg: Config) -> None:
    fb = cfg.compression.feedback
    if fb not in SUPPORTED_FEEDBACK:
        raise ConfigError(f"compression.feedback: {fb!r} changes local training or needs "
                          f"server-side client state; on Flower use one of "
                          f"{', '.join(SUPPORTED_FEEDBACK)}")
    if cfg.compression.alpha_schedule != "constant":
        raise ConfigError("compression.alpha_schedule: only 'constant' on Flower")
    if cfg.compression.adaptive != "none":
        raise ConfigError("compression.adaptive: not supported on Flower")
    if cfg.client.method != "sgd":
        raise ConfigError(f"client.method: {cfg.client.method!r} is not supported on Flower "
                          "(use sgd)")
    # Real clients have real time: the simulated clock, deadline and dropouts are
    # in-process only (availability is the cohort sampling, which applies here too).
    if cfg.system.profile != "off" or cfg.system.dropout > 0:
        raise ConfigError("system.profile: simulated devices and dropouts are for in-process "
                          "runs; on Flower only system.availability/pattern apply")


_EXPERIMENTS: dict[str, Experiment] = {}
# Client k's training slice, keyed by (config, k): a ClientApp process that gets a
# second message (Flower's simulation runtime, or any runtime that keeps the process)
# neither reloads the data nor gathers the slice again. Flower's deployment runtime
# (flwr 1.42, both isolation modes) starts a fresh process per message, so there the
# cache lives for one message; docs/deploy.md has the measured costs.
_CLIENT_DATA: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
# How often this process built an Experiment and gathered a client's slice (what the
# caches above save; read by the tests and the deployment benchmark).
LOADS = {"experiment": 0, "client_data": 0}


def _config_key(cfg: Config) -> str:
    import json

    return json.dumps(config_to_dict(cfg), sort_keys=True)


def _experiment(cfg: Config) -> Experiment:
    """One Experiment per config and process (a SuperNode loads the data once)."""
    key = _config_key(cfg)
    if key not in _EXPERIMENTS:
        _EXPERIMENTS[key] = Experiment(cfg)
        LOADS["experiment"] += 1
    return _EXPERIMENTS[key]


def _client_data(cfg: Config, exp: Experiment, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client k's training inputs and labels, gathered once per config and process."""
    key = (_config_key(cfg), k)
    if key not in _CLIENT_DATA:
        idx = torch.from_numpy(exp.fed.train[k])
        _CLIENT_DATA[key] = (exp.x[idx], exp.y[idx])
        LOADS["client_data"] += 1
    return _CLIENT_DATA[key]


# ------------------------------------------------------------------ client mod
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
            layout = self._layout or _experiment(self.cfg).layout
            c = self.cfg.compression
            comp = make_compressor(c.name, layout=layout, **c.options)
            fb = feedback_from_config(c, layout)
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
        w = from_arrays(layout, msg.content["arrays"])
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
        if bool(torch.isfinite(up.sent).all()) and all(
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
            rec = context.state[STATE_KEY].to_torch_state_dict()
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
        k, r, lr = _round_settings(msg, context, self.cfg)
        if not 0 <= k < exp.fed.num_clients:
            raise ValueError(f"client-id: {k} is not a client of this config "
                             f"(0..{exp.fed.num_clients - 1})")
        w = from_arrays(exp.layout, msg.content["arrays"]).to(exp.dtype)
        x_k, y_k = _client_data(self.cfg, exp, k)
        # The feedback policy's rows live in Context.state (kept by FedloomMod);
        # its hooks on local training (FLARE / EC+prox's penalty) come with the
        # job, built as the engine builds it. The mod already shifted the model
        # handed over to its start point (SA-PEF), so the job starts from it.
        state = (FedloomMod._load_state(context, exp.feedback, exp.layout.size, w.dtype)
                 if exp.fields.has(FEEDBACK) else {})
        bufs = self._start_buffers(exp, msg, context)
        job = client_job(exp.feedback, seed=self.cfg.seed, client=k, round=r, w=w, lr=lr,
                         x=x_k, y=y_k, fb_state=state, fb_server={}, alpha=0.0,
                         buffers=bufs, shifted_here=False)
        # The prox anchor is the model received (SA-PEF's start point when shifted).
        w_k, loss, steps, _ = exp.trainer.train(job)
        content = RecordDict({
            "arrays": to_arrays(exp.layout, w_k),
            "metrics": MetricRecord({"num-examples": len(y_k), "num-steps": steps,
                                     "train-loss": float(loss)}),
        })
        if bufs:
            trained = exp.trainer._trained_buffers()
            content[BUFFERS_KEY] = buffers_to_arrays(trained)
            # FedBN: the client keeps what it trained to, unless its reply is not
            # finite (the server rejects it, and the engine keeps the old row).
            if (self.cfg.model.buffers == "local" and bool(torch.isfinite(w_k).all())
                    and all(bool(torch.isfinite(v).all()) for v in trained.values())):
                context.state[BUFFER_STATE_KEY] = ArrayRecord(OrderedDict(
                    own=flatten_buffers(trained, self.state_dtype).cpu()))
        return Message(content, reply_to=msg)

    def _start_buffers(self, exp: Experiment, msg: Message, context: Context
                       ) -> dict[str, torch.Tensor] | None:
        """The buffers local training starts from: ``None`` for a model without
        any; the client's own under ``model.buffers: local`` once it has them;
        else the message's."""
        if not exp.buffer_template:
            return None
        if self.cfg.model.buffers == "local" and BUFFER_STATE_KEY in context.state:
            row = context.state[BUFFER_STATE_KEY].to_torch_state_dict()["own"]
            return unflatten_buffers(row.to(exp.device, exp.dtype), exp.buffer_template)
        if BUFFERS_KEY not in msg.content:
            raise ValueError("buffers: the model has buffers and the message carries none "
                             f"(a {BUFFERS_KEY!r} ArrayRecord beside 'arrays')")
        return buffers_from_arrays(exp.buffer_template, msg.content[BUFFERS_KEY])


def client_app(config: ConfigSource, overrides: Sequence[str] = ()) -> ClientApp:
    """A ClientApp that trains with fedloom's local SGD and uplinks through :class:`FedloomMod`."""
    cfg = load_config(config, overrides)
    _check_scope(cfg)
    app = ClientApp(mods=[FedloomMod(cfg)])
    app.train()(FedloomTrainer(cfg))
    return app


# -------------------------------------------------------------------- strategy
class FedloomStrategy(Strategy):
    """fedloom's server half of a round as a Flower strategy (see module doc).

    After (or during) a run: :attr:`state` is the engine's
    :class:`~fedloom.engine.runstate.RunState` (the global buffers included),
    :attr:`history` the per-round metrics (the engine's, plus ``flower_bytes``:
    the serialized size of the replies' content), :meth:`model_sha256` and
    :meth:`buffers_sha256` the final model's hashes (those of the engine's
    ``summary.json``).
    """

    def __init__(self, config: ConfigSource, overrides: Sequence[str] = (), *,
                 experiment: Experiment | None = None, node_timeout: float = 120.0) -> None:
        # fedloom's warnings (rejected clients, skipped steps) in Flower's log too
        from fedloom.integrations.flower.strategies import bridge_logs_to_flower

        bridge_logs_to_flower()
        self.exp = experiment or Experiment(load_config(config, overrides))
        cfg = self.exp.cfg
        _check_scope(cfg)
        if "start_losses" in self.exp.requires:
            raise ConfigError(f"aggregator.name: {cfg.aggregator.name} needs the clients' "
                              "start losses, which the Flower path does not send")
        self.state: RunState = self.exp.initial_state()
        self.nodes: dict[int, int] = {}
        self.history: list[dict[str, Any]] = []
        self.node_timeout = node_timeout
        self._plan: Any = None
        self._t0 = 0.0

    def initial_arrays(self) -> ArrayRecord:
        return to_arrays(self.exp.layout, self.state.w)

    def model_sha256(self) -> str:
        """SHA-256 of the model's parameters ``w`` (the engine's ``model_sha256``)."""
        return model_sha256(self.state.w)

    def buffers_sha256(self) -> str | None:
        """SHA-256 of the global module buffers (the engine's ``buffers_sha256``);
        ``None`` for a model without buffers (the engine's summary has no entry)."""
        return buffers_sha256(self.state.buffers) if self.state.buffers else None

    def summary(self) -> None:
        c = self.exp.cfg
        log.info("fedloom strategy: aggregator %s, compression %s + %s, %d clients, %d/round",
                 c.aggregator.name, c.compression.name, c.compression.feedback,
                 self.exp.fed.num_clients, c.cohort.size)

    def _discover(self, grid: Grid) -> None:
        n = self.exp.fed.num_clients
        deadline = time.monotonic() + self.node_timeout
        while len(ids := list(grid.get_node_ids())) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"flower: {len(ids)} of {n} SuperNodes connected after "
                                   f"{self.node_timeout:g} s")
            time.sleep(0.2)
        hello = [Message(RecordDict({HELLO_KEY: ConfigRecord({"ask": "client-id"})}),
                         dst_node_id=i, message_type=MessageType.TRAIN) for i in ids]
        for rep in grid.send_and_receive(hello, timeout=self.node_timeout):
            if rep.has_error():
                log.warning("flower: node %d did not say its client id: %s",
                            rep.metadata.src_node_id, rep.error.reason)
                continue
            k = int(rep.content[HELLO_KEY]["client-id"])
            if k in self.nodes:
                raise RuntimeError(f"flower: two SuperNodes claim client {k}")
            self.nodes[k] = rep.metadata.src_node_id
        missing = sorted(set(range(n)) - set(self.nodes))
        if missing:
            # A stock ClientApp cannot answer the hello (it fails on the missing
            # "arrays"): say where such an app's strategies are.
            raise RuntimeError(f"flower: no SuperNode for clients {missing[:10]} (this "
                               "strategy needs fedloom's client_app or FedloomMod on every "
                               "node; for a stock Flower ClientApp use "
                               "fedloom.integrations.flower.strategies)")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if not self.nodes:
            self._discover(grid)
        if server_round - 1 != self.state.next_round:
            raise RuntimeError(f"flower: server round {server_round} does not follow fedloom "
                               f"round {self.state.next_round}")
        self._t0 = time.perf_counter()
        plan = self._plan = self.exp.plan_round(self.state)
        rec = to_arrays(self.exp.layout, self.state.w)
        # The global buffers ride beside the model when it has any (every policy: a
        # client trains from them, under `local` until it has its own).
        bufs = buffers_to_arrays(self.state.buffers) if self.exp.buffer_template else None
        out = []
        for k in plan.cohort.tolist():
            conf = ConfigRecord({"server-round": server_round, "fedloom-round": plan.round,
                                 "client-id": int(k), "lr": float(plan.lr)})
            content = RecordDict({"arrays": rec, "config": conf})
            if bufs is not None:
                content[BUFFERS_KEY] = bufs
            out.append(Message(content, dst_node_id=self.nodes[int(k)],
                               message_type=MessageType.TRAIN))
        return out

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        exp, plan = self.exp, self._plan
        d = exp.layout.size
        t_train = time.perf_counter() - self._t0
        got: dict[int, tuple[ClientResult, UplinkResult]] = {}
        # Cohort clients whose reply arrived but could not be read: rejected and
        # counted like an undecodable update in the engine, not dropped as absent.
        bad: dict[int, str] = {}
        cohort = set(plan.cohort.tolist())
        moved = 0
        for rep in replies:
            if rep.has_error():
                log.warning("flower: round %d: node %d failed: %s", server_round,
                            rep.metadata.src_node_id, rep.error.reason)
                continue
            moved += content_bytes(rep.content)
            k = None
            try:
                c = rep.content[REPLY_KEY]
                k = int(c["client-id"])
                payload = bytes(c["payload"])
                sent = exp.uplink.decode(payload, d).to(exp.device, exp.dtype)
                met = rep.content["metrics"]
                bufs: dict[str, torch.Tensor] = {}
                if exp.buffer_template:  # checked here; finish_round rejects non-finite ones
                    if BUFFERS_KEY not in rep.content:
                        raise ValueError("buffers: the model has buffers and the reply "
                                         "carries none")
                    bufs = buffers_from_arrays(exp.buffer_template, rep.content[BUFFERS_KEY])
                res = ClientResult(k, torch.empty(0), int(met["num-examples"]),
                                   float(met.get("train-loss", float("nan"))),
                                   int(met.get("num-steps", 1)), buffers=bufs)
            except (KeyError, ValueError, OverflowError, PayloadError) as e:  # int(inf) overflows
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                log.warning("flower: round %d: rejected a malformed reply from node %d: %s",
                            server_round, rep.metadata.src_node_id, why)
                if k is not None and k in cohort:
                    bad[k] = f"reply could not be decoded ({why})"
                continue
            got[k] = (res, UplinkResult(payload, sent, {}, float(c["residual-norm"])))
        raw: list[tuple[ClientResult, UplinkResult] | None] = []
        for k in plan.cohort.tolist():
            if k in got:
                raw.append(got[k])
            elif k in bad:  # a placeholder that finish_round rejects (plan.refused)
                raw.append((ClientResult(k, torch.empty(0), 0, float("nan"), 1),
                            UplinkResult(b"", torch.empty(0, dtype=exp.dtype), {},
                                         float("nan"))))
            else:
                raw.append(None)
        kept = [i for i, x in enumerate(raw) if x is not None]
        plan.keep(kept)
        results = [raw[i][0] for i in kept]  # type: ignore[index]
        ups = [raw[i][1] for i in kept]      # type: ignore[index]
        plan.refused = {j: bad[res.client] for j, res in enumerate(results)
                        if res.client in bad and res.client not in got}
        self.state, metrics = exp.finish_round(self.state, plan, results, ups, t0=self._t0,
                                               t_train=t_train, client_state=False,
                                               client_buffers=True)
        metrics["flower_bytes"] = moved
        self.history.append(metrics)
        scalars = {k: v for k, v in metrics.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and v == v}
        return to_arrays(exp.layout, self.state.w), MetricRecord(scalars)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return []  # evaluation is the server's (the engine's metrics, on its schedule)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> MetricRecord | None:
        return None


def poll_replies(grid: Grid, interval: float = 0.1) -> Grid:
    """``grid``, whose ``send_and_receive`` asks for the replies every ``interval`` s.

    Flower's deployment grid (``HttpGrid``, flwr 1.42) pulls the replies of a round
    every 3 s, so a deployed round lasts a multiple of 3 s however fast its clients
    answer (docs/deploy.md has the measured round times). This is the same loop —
    push, then pull until every message has its reply or ``timeout`` passes — with a
    shorter wait; each pull is one small request to the SuperLink. Replaces the
    method on this grid object only; Flower's simulation grid already polls at 0.1 s.
    """
    if not interval > 0:
        raise ValueError(f"interval: must be > 0 seconds, got {interval}")

    def send_and_receive(messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        pending = set(grid.push_messages(messages))
        end = time.monotonic() + (timeout or 0.0)
        out: list[Message] = []
        while timeout is None or time.monotonic() < end:
            got = list(grid.pull_messages(pending))
            out.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if not pending:
                break
            time.sleep(interval)
        return out

    grid.send_and_receive = send_and_receive  # type: ignore[method-assign]
    return grid


def server_app(strategy: FedloomStrategy, num_rounds: int | None = None, *,
               poll_s: float = 0.1) -> ServerApp:
    """A ServerApp that runs ``strategy`` for ``num_rounds`` (default: the config's rounds),
    asking for the replies every ``poll_s`` s (:func:`poll_replies`; 0: Flower's own wait)."""
    app = ServerApp()
    rounds = num_rounds or strategy.exp.cfg.rounds

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        if poll_s:
            poll_replies(grid, poll_s)
        strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(), num_rounds=rounds)

    return app
