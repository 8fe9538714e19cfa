""":class:`FedloomRule`: a fedloom aggregator as a Flower strategy for stock replies.

Its ``configure_train`` keeps the arrays it sends (and samples Flower's nodes under a
seeded generator); its ``aggregate_train`` reads each reply into a pseudo-gradient
row, screens the rows as the engine does, aggregates the accepted ones, takes the
server step (or skips it, changing nothing) and averages the buffers: the numbered
steps of the package docstring (:mod:`fedloom.integrations.flower.strategies`).
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import FLOWER_LOGGER
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fedloom.aggregate.base import (
    Aggregator,
    CohortInfo,
)
from fedloom.buffers import average_buffers
from fedloom.capabilities import aggregator_caps
from fedloom.compress import make_compressor
from fedloom.compress.base import PayloadError
from fedloom.engine.objects import object_name
from fedloom.engine.stages.screen import (
    all_finite,
    clip_rows,
    count_reason,
    first_line,
    loss_reason,
    non_finite_reason,
    row_norms,
    screen_updates,
)
from fedloom.integrations.flower.records import MetricValue, StateLayout, rec_float
from fedloom.integrations.flower.strategies.logs import bridge_logs_to_flower, log
from fedloom.integrations.flower.strategies.options import (
    RecordFormat,
    Screening,
    check_number,
    make_rule_aggregator,
    make_server_optimizer,
)
from fedloom.integrations.flower.strategies.replies import (
    _METRIC_FIX,
    METRIC_OF,
    PAYLOAD_KEY,
    IncompatibleReplies,
    ReplyFormatError,
    _buffers_of,
    _only_metric_record,
    _partition_of,
)
from fedloom.rng import Purpose, derive_seed, seeded_global_rng
from fedloom.server_opt import ServerOptimizer


@dataclasses.dataclass
class _ServerState:
    """Built from the first arrays the strategy sees (configure_train): their layout,
    the reply decoder, the aggregator's and the server optimizer's state."""

    layout: StateLayout | None = None
    compressor: Any = None
    agg_state: Any = None
    opt_state: Any = None


@dataclasses.dataclass
class _Round:
    """The round in progress: what configure_train sent (the record, its parameters and
    buffers), the clients' learning rate, and each node's fix of its ReplyFormatError."""

    sent: tuple[ArrayRecord, torch.Tensor, OrderedDict[str, torch.Tensor]] | None = None
    lr: float | None = None
    fixes: dict[int, str] = dataclasses.field(default_factory=dict)


class FedloomRule(FedAvg):
    """A fedloom aggregator as a Flower strategy for stock replies (module doc).

    Args:
        aggregator: a registered fedloom aggregator (``fedloom algorithms``), or an
            aggregator object (``fedloom.aggregate.craft.CRAFT(step="rprop")``, a
            rule of your own), which holds its own options.
        server_lr: ``η_g``; ``"auto"``: the rule's public default (a registered rule
            only: give a number with an aggregator object).
        server_optimizer: ``sgd``, ``momentum``, ``adam``, ``yogi``, ``adagrad``, or a
            server optimizer object (its own ``lr`` and settings).
        server_options: the optimizer's options by name (``momentum``, ``beta1``, …).
        max_update_norm, max_norm_ratio, clip_norm: the engine's screening
            (``server.*`` of a fedloom config; same defaults).
        max_num_examples: reject a reply claiming more examples (``None``: no bound).
        compression, compression_options: the compressor of
            :class:`~fedloom.integrations.flower.stock.CompressionMod` replies
            (``None``: every reply must carry its arrays).
        client_lr: the clients' learning rate, for rules that need it (q-FedAvg).
        dtype: ``"float32"`` or ``"float64"``, the precision of ``g_k`` and the step.
        model: the module the arrays belong to (exact parameters and layer groups).
        buffers: names (or a predicate) of record keys that are buffers, beside
            BatchNorm's (without ``model``).
        buffers_policy: ``"average"`` or ``"keep_global"``.
        seed: Flower's node sampling (``random.sample``, Python's global generator)
            runs under that generator seeded from (seed, round, cohort) and restored
            after, so a run samples the same nodes again; ``None``: Flower's own draw.
        fraction_train, …, evaluate_metrics_aggr_fn: Flower's ``FedAvg`` arguments.
        **options: the aggregator's options by name (CRAFT's ``groups``, ``rtol``,
            Krum's ``f`` and ``multi``, …); an unknown one raises ``ValueError``.
    """

    def __init__(self, aggregator: str | Aggregator = "fedavg", *,
                 server_lr: float | str = "auto", server_optimizer: str | Any = "sgd",
                 server_options: Mapping[str, float] | None = None,
                 max_update_norm: float | None = None, max_norm_ratio: float | None = 1e4,
                 clip_norm: float | None = None, max_num_examples: float | None = None,
                 compression: str | None = None,
                 compression_options: Mapping[str, Any] | None = None,
                 client_lr: float | None = None, dtype: str = "float32",
                 model: nn.Module | None = None,
                 buffers: Iterable[str] | Callable[[str], bool] | None = None,
                 buffers_policy: str = "average", seed: int | None = 0,
                 fraction_train: float = 1.0, fraction_evaluate: float = 1.0,
                 min_train_nodes: int = 2, min_evaluate_nodes: int = 2,
                 min_available_nodes: int = 2, weighted_by_key: str = "num-examples",
                 arrayrecord_key: str = "arrays", configrecord_key: str = "config",
                 train_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord]
                 | None = None,
                 evaluate_metrics_aggr_fn: Callable[[list[RecordDict], str], MetricRecord]
                 | None = None,
                 **options: Any) -> None:
        super().__init__(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
                         min_train_nodes=min_train_nodes, min_evaluate_nodes=min_evaluate_nodes,
                         min_available_nodes=min_available_nodes,
                         weighted_by_key=weighted_by_key, arrayrecord_key=arrayrecord_key,
                         configrecord_key=configrecord_key,
                         train_metrics_aggr_fn=train_metrics_aggr_fn,
                         evaluate_metrics_aggr_fn=evaluate_metrics_aggr_fn)
        self.aggregator_name, self.aggregator = make_rule_aggregator(
            aggregator, server_lr, server_optimizer, options)
        self.requires = aggregator_caps(self.aggregator).requires
        self.server = make_server_optimizer(self.aggregator_name, server_optimizer,
                                            server_lr, server_options, options)
        self.screening = Screening(max_update_norm, max_norm_ratio, clip_norm,
                                   max_num_examples)
        self.records = RecordFormat.checked(dtype, model, buffers, buffers_policy,
                                            compression, compression_options)
        if "lr" in self.requires and client_lr is not None:
            check_number("client_lr", client_lr, low=0.0)
        self.client_lr = client_lr
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                                 or seed < 0):
            raise ValueError(f"seed: must be an integer >= 0 or None, got {seed!r}")
        self.seed = seed
        self._state = _ServerState()
        self.node_index: dict[int, int] = {}
        self.history: list[dict[str, Any]] = []
        self.totals = {"accepted": 0, "rejected": 0, "failed": 0, "skipped_rounds": 0}
        self.partitions: dict[int, int] = {}   # node id → partition-id, where replies say
        bridge_logs_to_flower()
        self._round = _Round()

    @property
    def state_layout(self) -> StateLayout | None:
        """The layout of the arrays (None before the first configure_train)."""
        return self._state.layout

    @property
    def agg_state(self) -> Any:
        """The aggregator's state, kept across rounds."""
        return self._state.agg_state

    @property
    def opt_state(self) -> Any:
        """The server optimizer's state, kept across rounds."""
        return self._state.opt_state

    # ------------------------------------------------------------------ setup
    def _setup(self, arrays: ArrayRecord) -> StateLayout:
        st, fmt = self._state, self.records
        if st.layout is None:
            sl = StateLayout.from_arrays(arrays, model=fmt.model, buffers=fmt.buffers)
            w, _ = sl.split(arrays, fmt.dtype)
            if fmt.compression is not None:
                st.compressor = make_compressor(fmt.compression, layout=sl.layout,
                                                **fmt.compression_options)
            st.agg_state = self.aggregator.init(sl.layout)
            st.opt_state = self.server.init(w)
            st.layout = sl
        return st.layout

    def summary(self) -> None:
        super().summary()
        # a named optimizer by its kind and step; any other (a chain) by its class
        server = (f"{self.server.kind} at lr {self.server.lr:g}"
                  if isinstance(self.server, ServerOptimizer) else object_name(self.server))
        decoding = self.records.compression
        FLOWER_LOGGER.info("fedloom rule: %s, server %s%s", self.aggregator_name, server,
                           f", decoding {decoding}" if decoding else "")

    # ------------------------------------------------------------------ round
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        sl = self._setup(arrays)
        w, bufs = sl.split(arrays, self.records.dtype)
        self._round.sent = (arrays, w, bufs)
        lr = config.get("lr", self.client_lr) if config is not None else self.client_lr
        if "lr" in self.requires and lr is None:
            raise ValueError(f"client_lr: aggregator {self.aggregator_name!r} needs the "
                             "clients' learning rate (client_lr= or 'lr' in the train config)")
        self._round.lr = None if lr is None else rec_float(lr)
        if self.seed is None:
            messages = list(super().configure_train(server_round, arrays, config, grid))
        else:  # Flower samples with Python's global generator: fork and seed it
            with seeded_global_rng(derive_seed(self.seed, server_round - 1, -1,
                                               Purpose.COHORT)):
                messages = list(super().configure_train(server_round, arrays, config, grid))
        for node in sorted({m.metadata.dst_node_id for m in messages}):
            self.node_index.setdefault(node, len(self.node_index))
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Screen, aggregate and step (module doc). Raises :class:`IncompatibleReplies`
        when every reply that came back was rejected for one reason of the app's making."""
        if self._round.sent is None:
            raise RuntimeError("aggregate_train: configure_train has not run this round")
        sent_rec, w, bufs = self._round.sent
        self._round.sent = None
        replies = sorted(replies, key=lambda m: m.metadata.src_node_id)
        failed = [m for m in replies if m.has_error()]
        # Flower's FedAvg says this line; a strategy in its place says it too.
        FLOWER_LOGGER.info("aggregate_train: Received %s results and %s failures",
                           len(replies) - len(failed), len(failed))
        for m in failed:
            log.warning("flower: round %d: %s failed: %s", server_round,
                        self._who(m.metadata.src_node_id), m.error.reason)
        read = [m for m in replies if not m.has_error()]
        self._round.fixes = {}
        rows, kept, reasons = self._read(server_round, read, w)
        ok, clipped = self._screen(server_round, rows, kept, reasons)
        accepted = [kept[i] for i in range(len(kept)) if ok[i]]
        up_bytes, dense_bytes = self._bytes(read)
        record: dict[str, Any] = {"round": server_round, "failed": len(failed),
                                  "accepted": len(accepted),
                                  "rejected": dict(sorted(reasons.items())),
                                  "clipped": clipped, "uplink_bytes": up_bytes,
                                  "dense_bytes": dense_bytes}
        if read:
            FLOWER_LOGGER.info("fedloom: round %d: %d replies carried %d bytes of model "
                               "updates (%.2f %% of %d bytes dense)", server_round, len(read),
                               up_bytes, 100.0 * up_bytes / max(dense_bytes, 1), dense_bytes)
        agg_metrics: Mapping[str, float] = {}
        new_w, new_bufs, skipped = w, bufs, None
        if accepted:
            sel = torch.tensor(ok, dtype=torch.bool)
            step = self._step(server_round, w, rows[sel] if not bool(sel.all()) else rows,
                              accepted)
            if isinstance(step, str):
                skipped = step
            else:
                new_w, agg_metrics = step
                if self.records.buffers_policy == "average" and bufs:
                    new_bufs = OrderedDict(average_buffers(
                        [r["buffers"] for r in accepted], [r["n"] for r in accepted]))
        else:
            skipped = "no update accepted"
        record["skipped"] = skipped
        record.update(agg_metrics)
        self.history.append(record)
        self.totals["accepted"] += len(accepted)
        self.totals["rejected"] += len(reasons)
        self.totals["failed"] += len(failed)
        self.totals["skipped_rounds"] += skipped is not None
        fixes = set(self._round.fixes.values())
        if read and not accepted and len(self._round.fixes) == len(read) and len(fixes) == 1:
            # Not a bad client but an app that cannot work with this strategy: every
            # round would end the same way, with the untrained model. Stop and say why.
            node = next(iter(self._round.fixes))
            raise IncompatibleReplies(
                f"flower: round {server_round}: all {len(read)} replies were rejected: "
                f"{reasons[node]}; fix: {fixes.pop()}")
        if skipped is not None:
            log.warning("flower: round %d: step skipped, model and state unchanged: %s",
                        server_round, skipped)
        metrics = self._metrics(accepted, len(reasons), len(failed), skipped, agg_metrics,
                                up_bytes, dense_bytes)
        if skipped is not None:
            return sent_rec, metrics
        assert self.state_layout is not None
        return self.state_layout.join(new_w, new_bufs), metrics

    # ---------------------------------------------------------------- helpers
    def _who(self, node: int) -> str:
        """A node as the app's user knows it: its partition-id when its replies say it
        (CompressionMod, partition_id_mod), with Flower's node id."""
        pid = self.partitions.get(node)
        return f"node {node}" if pid is None else f"partition-id {pid} (node {node})"

    def _bytes(self, replies: list[Message]) -> tuple[int, int]:
        """(what the replies carried for the parameters, what that is dense): a
        compressed reply's payload, a plain reply's parameters in the record's dtypes."""
        sl = self.state_layout
        assert sl is not None
        dense = sum(t.numel * torch.empty(0, dtype=sl.dtypes[t.name]).element_size()
                    for t in sl.layout.tensors)
        up = 0
        for m in replies:
            fields = m.content.config_records.get(PAYLOAD_KEY)
            payload = fields.get("payload") if fields is not None else None
            if isinstance(payload, bytes):
                up += len(payload)
            elif self.arrayrecord_key in m.content.array_records:
                up += dense
        return up, dense * len(replies)

    def _read(self, server_round: int, replies: list[Message], w: torch.Tensor
              ) -> tuple[torch.Tensor, list[dict[str, Any]], dict[int, str]]:
        """Decode each reply into its row ``g_k``; the unreadable ones get a reason
        (keyed by node id)."""
        sl = self.state_layout
        assert sl is not None
        rows: list[torch.Tensor] = []
        kept: list[dict[str, Any]] = []
        reasons: dict[int, str] = {}
        for m in replies:
            node = m.metadata.src_node_id
            pid = _partition_of(m.content)
            if pid is not None:
                self.partitions[node] = pid
            try:
                kept.append(self._decode(m, w))
                rows.append(kept[-1].pop("row"))
            except (KeyError, ValueError, TypeError, PayloadError) as e:
                if isinstance(e, ReplyFormatError):
                    self._round.fixes[node] = e.fix
                why = reasons[node] = f"reply could not be decoded ({first_line(e)})"
                log.warning("flower: round %d: rejected the reply of %s: %s",
                            server_round, self._who(node), why)
        d = sl.layout.size
        stacked = torch.stack(rows) if rows else torch.empty((0, d), dtype=self.records.dtype)
        return stacked, kept, reasons

    def _decode(self, m: Message, w: torch.Tensor) -> dict[str, Any]:
        """The reply's row and numbers; a ``ValueError`` for a bad value of this client
        (a count or loss that is not finite or absurd: rejected, the round goes on), a
        :class:`ReplyFormatError` for what the app or the settings must fix."""
        sl = self.state_layout
        assert sl is not None
        content = m.content
        metrics = _only_metric_record(content)
        key = self.weighted_by_key
        if key not in metrics:
            raise ReplyFormatError(f"{key}: not in the reply's metrics",
                                   f"send '{key}' (the client's training examples) in the "
                                   "reply's MetricRecord")
        why = count_reason(key, metrics[key], low=0.0, strict=True)
        if why is not None:
            raise ValueError(why)
        n = float(metrics[key])  # type: ignore[arg-type]
        most = self.screening.max_num_examples
        if most is not None and n > most:
            raise ValueError(f"{key}: {n:g} above max_num_examples={most:g}")
        if PAYLOAD_KEY in content.config_records:
            if self._state.compressor is None:
                raise ReplyFormatError(
                    "a compressed reply, and the strategy has no compression=",
                    "give the strategy the mod's compressor: compression=, "
                    "compression_options= as CompressionMod's")
            fields = content.config_records[PAYLOAD_KEY]
            payload = fields["payload"]
            if not isinstance(payload, bytes):
                raise ValueError("payload: not bytes")
            try:
                row = self._state.compressor.decode(payload, sl.layout.size).to(self.records.dtype)
            except PayloadError as e:
                raise ReplyFormatError(
                    f"payload: {first_line(e)}", "the strategy's compression= and "
                    "compression_options= must be CompressionMod's") from None
            bufs = _buffers_of(sl, fields)
        else:
            if self.arrayrecord_key not in content.array_records:
                raise ReplyFormatError(
                    f"no ArrayRecord {self.arrayrecord_key!r} in the reply",
                    f"reply with ArrayRecord(model.state_dict()) under "
                    f"{self.arrayrecord_key!r} (or wrap the ClientApp in CompressionMod and "
                    "give the strategy compression=)")
            try:
                w_k, bufs = sl.split(content.array_records[self.arrayrecord_key],
                                     self.records.dtype)
            except ValueError as e:
                raise ReplyFormatError(
                    str(e), "reply with the state dict of the model the strategy sends "
                    "(its keys, shapes and floating-point parameters)") from None
            bufs = sl.cast_buffers(bufs)  # a value no buffer of the model holds: ValueError
            row = w - w_k
        loss = metrics.get("train-loss", float("nan"))
        out: dict[str, Any] = {"row": row, "n": n, "buffers": bufs, "node": m.metadata.src_node_id,
                               "content": content,
                               # round metrics only: a bad one is not the update's fault
                               "loss": rec_float(loss) if loss_reason("", loss) is None
                               else float("nan")}
        for field, mkey in METRIC_OF.items():
            if field in self.requires:
                if mkey not in metrics:
                    raise ReplyFormatError(f"{mkey}: aggregator {self.aggregator_name!r} needs "
                                           "this metric in the reply", _METRIC_FIX[mkey])
                v = metrics[mkey]
                why = (count_reason(mkey, v, low=1.0, whole=True) if field == "steps"
                       else loss_reason(mkey, v))
                if why is not None:
                    raise ValueError(why)
                out[field] = int(v) if field == "steps" else float(v)  # type: ignore[arg-type]
        return out

    def _screen(self, server_round: int, rows: torch.Tensor, kept: list[dict[str, Any]],
                reasons: dict[int, str]) -> tuple[list[bool], int]:
        """The engine's screening (fedloom.engine.stages.receive): non-finite rows or buffers,
        then the norm rules, then clipping."""
        if not kept:
            return [], 0
        norms = row_norms(rows)
        finite = torch.isfinite(norms)
        why: dict[int, str] = {}
        for i, r in enumerate(kept):
            if not bool(finite[i]):
                why[i] = non_finite_reason(rows[i])
            elif not all_finite(dict(r["buffers"])):
                finite[i] = False
                why[i] = "non-finite buffers"
        big = screen_updates(norms, finite, max_norm=self.screening.max_update_norm,
                             max_ratio=self.screening.max_norm_ratio)
        for i, reason in big.items():
            finite[i] = False
            why[i] = reason
        clip = self.screening.clip_norm
        clipped = clip_rows(rows, norms, finite, clip) if (
            clip is not None and bool(finite.any())) else 0
        for i, reason in sorted(why.items()):
            log.warning("flower: round %d: rejected the update of %s: %s", server_round,
                        self._who(kept[i]["node"]), reason)
            reasons[kept[i]["node"]] = reason
        return finite.tolist(), clipped

    def _step(self, server_round: int, w: torch.Tensor, rows: torch.Tensor,
              accepted: list[dict[str, Any]]) -> tuple[torch.Tensor, dict[str, float]] | str:
        """Aggregate and step, or why the step is skipped (nothing changes then)."""
        sl = self.state_layout
        assert sl is not None
        info = self._info(server_round, accepted)
        if "w" in self.requires:  # the model the rows are relative to (row = w − w_k)
            info = dataclasses.replace(info, w=w)
        weights = torch.tensor([r["n"] for r in accepted], dtype=self.records.dtype)
        try:
            agg, cand_state, metrics = self.aggregator(rows, weights, self._state.agg_state,
                                                       info=info)
        except (NotImplementedError, RecursionError):
            raise  # a missing feature or a bug, not a bad cohort
        except (RuntimeError, ValueError, ArithmeticError) as e:
            return f"the aggregator failed ({first_line(e)})"
        d = sl.layout.size
        if not isinstance(agg, torch.Tensor) or tuple(agg.shape) != (d,):
            return f"the aggregate has shape {getattr(agg, 'shape', type(agg))}, expected ({d},)"
        if not all_finite(agg):
            return "the aggregate is not finite"
        cand_w, cand_opt = self.server.step(w, agg.to(w.dtype), self._state.opt_state)
        if not (all_finite(cand_w) and all_finite(cand_opt)):
            return "the server optimizer's step is not finite"
        if not all_finite(cand_state):
            return "the new aggregator state is not finite"
        self._state.agg_state, self._state.opt_state = cand_state, cand_opt
        scalars = {k: float(v) for k, v in dict(metrics).items()
                   if isinstance(v, int | float) and not isinstance(v, bool)}
        return cand_w, scalars

    def _info(self, server_round: int, accepted: list[dict[str, Any]]) -> CohortInfo:
        ids = [self.node_index.setdefault(r["node"], len(self.node_index)) for r in accepted]

        def col(field: str) -> torch.Tensor | None:
            if field not in self.requires:
                return None
            dtype = torch.int64 if field == "steps" else torch.float64
            return torch.tensor([r[field] for r in accepted], dtype=dtype)

        return CohortInfo(clients=torch.tensor(ids, dtype=torch.int64), round=server_round - 1,
                          num_clients=len(self.node_index),
                          losses=torch.tensor([r["loss"] for r in accepted], dtype=torch.float64),
                          steps=col("steps"), lr=self._round.lr,
                          start_losses=col("start_losses"))

    def _metrics(self, accepted: list[dict[str, Any]], rejected: int, failed: int,
                 skipped: str | None, agg_metrics: Mapping[str, float], up_bytes: int,
                 dense_bytes: int) -> MetricRecord:
        out: dict[str, MetricValue] = {}
        if accepted:
            try:
                out.update(self.train_metrics_aggr_fn([r["content"] for r in accepted],
                                                      self.weighted_by_key))
            except (KeyError, ValueError, TypeError) as e:  # a user function's business
                log.warning("flower: train_metrics_aggr_fn failed: %s", first_line(e))
        out.update({"fedloom-accepted": len(accepted), "fedloom-rejected": rejected,
                    "fedloom-failed": failed, "fedloom-step-skipped": int(skipped is not None),
                    # what the round's replies carried for the model, and the same dense
                    "fedloom-uplink-bytes": up_bytes, "fedloom-dense-bytes": dense_bytes})
        out.update({k: v for k, v in agg_metrics.items() if math.isfinite(v)})
        return MetricRecord(out)
