"""What a stock app's reply carries, as the strategy reads it, and the errors of an app's making.

The record keys of a :class:`~fedloom.integrations.flower.stock.CompressionMod` reply
and of ``partition_id_mod``'s, the metrics a rule reads (:data:`METRIC_OF`) and the
fix for a missing one; :class:`ReplyFormatError` (a reply the strategy cannot read
for a reason the app or the settings must fix) and :class:`IncompatibleReplies`
(every reply of a round rejected for one such reason); the helpers that take a
reply's one MetricRecord, its partition-id and a compressed reply's buffers.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedloom.integrations.flower.records import StateLayout, unpack_buffers

PAYLOAD_KEY = "fedloom"      # the ConfigRecord of a CompressionMod reply
BUFFERS_KEY = "buffers"      # its field of the trained buffers' bytes (absent: none)
NODE_KEY = "fedloom.node"    # the ConfigRecord partition_id_mod adds to a plain reply
PARTITION_FIELD = "partition-id"  # its field (and the CompressionMod record's)
# What a rule's CohortInfo field is read from in a reply's MetricRecord.
METRIC_OF = {"steps": "num-steps", "start_losses": "start-loss"}


# What the app changes when every reply lacks a metric a rule needs.
_METRIC_FIX = {
    "start-loss": "send 'start-loss' in the reply's MetricRecord: the loss of the received "
                  "model on the client's training data, computed before training "
                  "(docs/deploy.md, 'Metrics a rule needs')",
    "num-steps": "send 'num-steps' in the reply's MetricRecord: the local optimizer steps "
                 "the client took this round",
}


class ReplyFormatError(ValueError):
    """A reply the strategy cannot read for a reason of the app's making (a metric it
    does not send, a payload of another codec, the arrays of another model): the
    same for every client until the app or the strategy's settings change. ``fix``
    says what to change."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


class IncompatibleReplies(RuntimeError):
    """Every reply of a round was rejected for the same reason of the app's making
    (:class:`ReplyFormatError`): the run cannot train, so it stops, naming the
    reason and the fix, instead of returning the untrained model."""


def _only_metric_record(content: RecordDict) -> MetricRecord:
    recs = list(content.metric_records.values())
    if len(recs) != 1:
        raise ReplyFormatError(f"metrics: the reply holds {len(recs)} MetricRecords, "
                               "expected one", "reply with exactly one MetricRecord")
    return recs[0]


def _partition_of(content: RecordDict) -> int | None:
    """The partition-id a reply says it comes from (CompressionMod's record, or
    partition_id_mod's), else ``None``."""
    for key in (PAYLOAD_KEY, NODE_KEY):
        rec = content.config_records.get(key)
        v = rec.get(PARTITION_FIELD) if rec is not None else None
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _buffers_of(sl: StateLayout, fields: ConfigRecord) -> OrderedDict[str, torch.Tensor]:
    """The trained buffers of a compressed reply (raw bytes; records.pack_buffers)."""
    if not sl.buffers:
        return OrderedDict()
    if BUFFERS_KEY not in fields:
        raise ValueError("buffers: the model has buffers and the reply carries none")
    return unpack_buffers(sl, fields[BUFFERS_KEY])
