"""fedloom's aggregation rules as drop-in Flower strategies for stock apps.

A Flower app whose ClientApp trains the model it receives under ``"arrays"``
and replies with ``ArrayRecord(model.state_dict())`` and a ``MetricRecord``
holding ``num-examples`` (the way Flower's PyTorch examples are written) adopts
CRAFT, Krum or any other fedloom rule by changing the strategy it constructs::

    strategy = FedAvg(fraction_train=0.5)          # before
    strategy = CRAFT(fraction_train=0.5)           # after

Everything else is Flower's: node sampling (``fraction_train``,
``min_train_nodes``, ``min_available_nodes``), the train config it sends,
client-side evaluation (``configure_evaluate`` / ``aggregate_evaluate`` are
:class:`flwr.serverapp.strategy.FedAvg`'s), ``start(..., evaluate_fn=...)``
and its :class:`Result`. What fedloom adds happens in :meth:`FedloomRule.aggregate_train`:

1. **Pseudo-gradients** ``g_k = w − w_k`` of the parameters, against the arrays
   this round sent (kept by :meth:`~FedloomRule.configure_train`), in
   ``dtype``; the record's buffers (BatchNorm statistics) are not part of ``w``
   (:class:`~fedloom.integrations.flower.records.StateLayout`). A reply from
   :class:`~fedloom.integrations.flower.stock.CompressionMod` carries the
   encoded ``g_k`` instead, decoded with ``compression=`` (the same compressor
   and options as the mod; a payload of another codec, size or checksum is
   undecodable).
2. **Screening** as the engine's (:mod:`fedloom.engine.screen`): a reply that
   cannot be read (no arrays, other keys or shapes, a missing metric the rule
   needs) or that reports a number no client has (a ``num-examples`` that is
   not a finite number in ``(0, 2**53]`` or is above ``max_num_examples``, a
   ``num-steps`` that is not a whole number in ``[1, 2**53]``, a non-finite
   ``start-loss``, an integer buffer sent as a float its dtype cannot hold) is
   rejected as undecodable; a non-finite ``g_k`` or buffer is rejected; then
   ``‖g_k‖ > max_update_norm`` or ``> max_norm_ratio ×`` the lower median norm
   is rejected, and ``clip_norm`` bounds the rest. Rejected replies are counted
   (``fedloom-rejected`` in the round's metrics, :attr:`~FedloomRule.history`
   with the reasons; the client named by its ``partition-id`` where the reply
   says it), never averaged, and one of them never fails the round for the
   others. A round whose every reply is rejected for one reason of the app's
   making (:class:`ReplyFormatError`: a metric it does not send, a codec the
   strategy was not given) raises :class:`IncompatibleReplies` with the fix.
3. **The rule**: the registered aggregator ``aggregator`` with its options by
   name, on the accepted rows and their ``num-examples``; its state is kept
   across rounds (:attr:`~FedloomRule.agg_state`); CRAFT's layer groups are the
   record's (state-dict names; ``model=`` for a module's exact groups).
4. **The server step** ``w ← w − η_g·opt(direction)`` (``server_optimizer``:
   sgd, momentum, adam, yogi, adagrad; ``server_lr="auto"``: the rule's public
   step, 0.1 for CRAFT). A rule that fails on an ill-posed cohort, a direction
   that is not finite or not of the model's size, or a step or new state that
   is not finite skips the round's step (``fedloom-step-skipped`` = 1): the
   arrays it returns are the ones it sent and no state changes. A bad aggregate
   is never applied.
5. **Buffers**: the ``num-examples``-weighted mean of the accepted replies'
   floating buffers, the maximum of integer ones (``num_batches_tracked``),
   as the engine's ``model.buffers: average``; ``buffers_policy="keep_global"``
   keeps the server's.

Each round's metrics also hold ``fedloom-uplink-bytes`` (what the replies carried
for the parameters: payloads, or dense arrays) and ``fedloom-dense-bytes`` (the
same replies' parameters dense); fedloom's log records reach Flower's log
handlers (:func:`bridge_logs_to_flower`).

The cohort's rows are ordered by node id (Flower returns replies in arrival
order), so the same replies give the same model whatever order they came in.
Flower's node ids are numbered 0, 1, … in the order they are first sampled
(sorted within a round) for the rules that keep per-client state (AFL's λ).

What a rule needs from the replies beyond the arrays: ``fednova`` the local
step count (metric ``num-steps``), ``qfedavg``, ``afl``, ``fedfv``, ``fedlf``
the loss of the received model on the client's data before training (metric
``start-loss``, the ``F_k(w)`` of q-FFL), and ``qfedavg`` the client learning
rate (``client_lr=``, or ``"lr"`` in the train config). A reply without such a
metric is rejected (named); a stock app opts in by adding the metric. The
training loss ``train-loss`` is used where present (round metrics only).

Checked (tests/test_flower_strategies.py): for the same replies, the new arrays
equal fedloom's aggregator and server optimizer applied to the same rows, max
difference 0 in float64 (CRAFT with SGD and with Adam, Krum, FedAvg with
momentum; two rounds of near-collinear rows of a BatchNorm MLP, d = 292); a
3-round run of a stock ClientApp with :class:`CRAFT` (fedloom's ``mlp``, 5
nodes, every node every round) ends at the model fedloom's engine
(``Experiment.finish_round``) reaches from the recorded replies, max difference
0 in float64.

Departures from the engine: the cohort is Flower's sample, not fedloom's; the
server never learns a client's data size but from ``num-examples`` (hence
``max_num_examples``); under a robust rule the buffers are still the mean of
every accepted reply, as in the engine (``buffers_policy="keep_global"`` keeps
a Byzantine client from moving BatchNorm statistics).

The package: :mod:`fedloom.integrations.flower.strategies.rule` (:class:`FedloomRule`:
a round, from the arrays sent to the step),
:mod:`fedloom.integrations.flower.strategies.replies` (what a reply carries, the
errors of an app's making) and :mod:`fedloom.integrations.flower.strategies.logs`
(fedloom's log in Flower's); the rules by name (:class:`CRAFT`, :class:`Krum`, …)
are defined here.
"""

from __future__ import annotations

from typing import Any

try:
    from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: F401
    from flwr.common.logger import FLOWER_LOGGER  # noqa: F401
    from flwr.serverapp import Grid  # noqa: F401
    from flwr.serverapp.strategy import FedAvg  # noqa: F401
except ImportError as e:  # pragma: no cover (the extra is missing)
    raise ImportError("fedloom.integrations.flower needs Flower: pip install 'fedloom[flower]'"
                      ) from e

from fedloom.integrations.flower.strategies.logs import bridge_logs_to_flower
from fedloom.integrations.flower.strategies.replies import (  # noqa: F401  (re-exported)
    BUFFERS_KEY,
    METRIC_OF,
    NODE_KEY,
    PARTITION_FIELD,
    PAYLOAD_KEY,
    IncompatibleReplies,
    ReplyFormatError,
)
from fedloom.integrations.flower.strategies.rule import FedloomRule

__all__ = ["AFL", "CRAFT", "ConFIG", "CoordMean", "FedFV", "FedLF", "FedNova", "FedloomRule",
           "IncompatibleReplies", "Krum", "Median", "MultiKrum", "QFedAvg", "ReplyFormatError",
           "TrimmedMean", "bridge_logs_to_flower"]


# ------------------------------------------------------------------ the rules by name
def _rule(name: str, aggregator: str, doc: str) -> type[FedloomRule]:
    def __init__(self: FedloomRule, **kwargs: Any) -> None:
        FedloomRule.__init__(self, aggregator, **kwargs)

    cls = type(name, (FedloomRule,), {"__init__": __init__, "__doc__": doc,
                                      "__module__": __name__})
    return cls


CRAFT = _rule("CRAFT", "craft", "CRAFT (conflict-resolved aggregation; fedloom.aggregate.craft). "
              "Options: groups, rtol, sv_floor, atol, precision, match_reference.")
FedFV = _rule("FedFV", "fedfv", "FedFV (Wang et al. 2021); needs the 'start-loss' metric.")
ConFIG = _rule("ConFIG", "config", "ConFIG (Liu et al. 2025; fedloom.aggregate.conflict_free).")
FedLF = _rule("FedLF", "fedlf", "FedLF (Pan et al. 2024); needs the 'start-loss' metric.")
QFedAvg = _rule("QFedAvg", "qfedavg", "q-FedAvg (Li et al. 2020); needs 'start-loss' and "
                "client_lr.")
AFL = _rule("AFL", "afl", "Agnostic FL (Mohri et al. 2019); needs the 'start-loss' metric.")
FedNova = _rule("FedNova", "fednova", "FedNova (Wang et al. 2020); needs the 'num-steps' metric.")
Median = _rule("Median", "median", "Coordinate-wise median (Yin et al. 2018).")
TrimmedMean = _rule("TrimmedMean", "trimmed_mean", "Coordinate-wise trimmed mean "
                    "(Yin et al. 2018).")
Krum = _rule("Krum", "krum", "Krum (Blanchard et al. 2017); option f: the Byzantine count.")
CoordMean = _rule("CoordMean", "coordmean", "SA-PEF's coordinate-wise mean of the sent "
                  "coordinates (fedloom.aggregate.coordmean).")


class MultiKrum(FedloomRule):
    """Multi-Krum (Blanchard et al. 2017): the mean of the ``multi`` best-scored updates."""

    def __init__(self, *, f: int = 0, multi: int = 2, **kwargs: Any) -> None:
        super().__init__("krum", f=f, multi=multi, **kwargs)
