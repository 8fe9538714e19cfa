"""The server side: :class:`FedloomStrategy`, :func:`poll_replies` and :func:`server_app`.

The strategy finds which SuperNode is which client (the discovery query), sends each
sampled client the model and its round settings, decodes and checks the replies and
runs the engine's :meth:`~fedloom.engine.experiment.Experiment.finish_round`;
:func:`server_app` runs it, asking for the replies every 0.1 s (:func:`poll_replies`)
instead of Flower's 3 s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
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
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Strategy

from fedloom.buffers import buffers_sha256
from fedloom.client.sgd import ClientResult
from fedloom.compress.base import PayloadError
from fedloom.compress.feedback import UplinkResult
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment
from fedloom.engine.runs.stepped import stop_if_never_stepped
from fedloom.engine.runstate import RoundOutcome, RunState, model_sha256
from fedloom.integrations.flower.discovery import discover_clients
from fedloom.integrations.flower.messages import (
    BUFFERS_KEY,
    REPLY_KEY,
    ConfigSource,
    _check_scope,
    buffers_from_arrays,
    buffers_to_arrays,
    content_bytes,
    to_arrays,
)
from fedloom.integrations.flower.records import MetricValue, rec_bytes, rec_float, rec_int

log = logging.getLogger("fedloom")


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
        self.exp = experiment or Experiment.from_config(load_config(config, overrides))
        cfg = self.exp.cfg
        _check_scope(cfg)
        if "start_losses" in self.exp.algorithm.requires:
            raise ConfigError(f"aggregator.name: {cfg.aggregator.name} needs the clients' "
                              "start losses, which the Flower path does not send")
        self.state: RunState = self.exp.init()
        self.nodes: dict[int, int] = {}
        self.history: list[dict[str, Any]] = []
        self.node_timeout = node_timeout
        self._plan: Any = None
        self._t0 = 0.0

    def initial_arrays(self) -> ArrayRecord:
        return to_arrays(self.exp.space.layout, self.state.w)

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
                 c.aggregator.name, c.compression.name, c.compression.feedback.name,
                 self.exp.clients.num_clients, c.cohort.size)

    def _discover(self, grid: Grid) -> None:
        self.nodes = discover_clients(
            grid, self.exp.clients.num_clients, self.node_timeout, who="flower",
            needs="this strategy needs fedloom's client_app or FedloomMod on every node; for "
                  "a stock Flower ClientApp use fedloom.integrations.flower.strategies")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if not self.nodes:
            self._discover(grid)
        if server_round - 1 != self.state.next_round:
            raise RuntimeError(f"flower: server round {server_round} does not follow fedloom "
                               f"round {self.state.next_round}")
        self._t0 = time.perf_counter()
        plan = self._plan = self.exp.plan_round(self.state)
        rec = to_arrays(self.exp.space.layout, self.state.w)
        # The global buffers ride beside the model when it has any (every policy: a
        # client trains from them, under `local` until it has its own).
        bufs = (buffers_to_arrays(self.state.buffers) if self.exp.space.buffer_template
                else None)
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
        space = exp.space
        d = space.layout.size
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
                k = rec_int(c["client-id"])
                payload = rec_bytes(c["payload"])
                sent = exp.algorithm.compressor.decode(payload, d).to(space.device, space.dtype)
                met = rep.content["metrics"]
                bufs: dict[str, torch.Tensor] = {}
                if space.buffer_template:  # checked here; finish_round rejects non-finite
                    if BUFFERS_KEY not in rep.content:
                        raise ValueError("buffers: the model has buffers and the reply "
                                         "carries none")
                    bufs = buffers_from_arrays(space.buffer_template,
                                               rep.content[BUFFERS_KEY])
                res = ClientResult(k, torch.empty(0), rec_int(met["num-examples"]),
                                   rec_float(met.get("train-loss", float("nan"))),
                                   rec_int(met.get("num-steps", 1)), buffers=bufs)
            except (KeyError, ValueError, OverflowError, PayloadError) as e:  # int(inf) overflows
                why = str(e).splitlines()[0] if str(e) else type(e).__name__
                log.warning("flower: round %d: rejected a malformed reply from node %d: %s",
                            server_round, rep.metadata.src_node_id, why)
                if k is not None and k in cohort:
                    bad[k] = f"reply could not be decoded ({why})"
                continue
            got[k] = (res, UplinkResult(payload, sent, {}, rec_float(c["residual-norm"])))
        raw: list[tuple[ClientResult, UplinkResult] | None] = []
        for k in plan.cohort.tolist():
            if k in got:
                raw.append(got[k])
            elif k in bad:  # a placeholder that finish_round rejects (refused)
                raw.append((ClientResult(k, torch.empty(0), 0, float("nan"), 1),
                            UplinkResult(b"", torch.empty(0, dtype=space.dtype), {},
                                         float("nan"))))
            else:
                raw.append(None)
        kept = [i for i, x in enumerate(raw) if x is not None]
        plan, dropped = plan.keep(kept)
        results = [raw[i][0] for i in kept]  # type: ignore[index]
        ups = [raw[i][1] for i in kept]      # type: ignore[index]
        refused = {j: bad[res.client] for j, res in enumerate(results)
                   if res.client in bad and res.client not in got}
        outcome = RoundOutcome(results, ups, dropped, refused)
        self.state, metrics = exp.finish_round(self.state, plan, outcome, t0=self._t0,
                                               t_train=t_train, client_state=False,
                                               client_buffers=True)
        metrics["flower_bytes"] = moved
        self.history.append(metrics)
        # the engine's rule: the first rounds all skipped is an error, not a result
        stop_if_never_stepped(self.history, exp.cfg)
        scalars: dict[str, MetricValue] = {k: v for k, v in metrics.items()
                   if isinstance(v, int | float) and not isinstance(v, bool) and v == v}
        return to_arrays(space.layout, self.state.w), MetricRecord(scalars)

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
