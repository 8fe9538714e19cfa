"""fedloom's aggregation rules as drop-in Flower strategies for stock apps.

A Flower app whose ClientApp trains the model it receives under ``"arrays"`` and replies
with ``ArrayRecord(model.state_dict())`` and a ``MetricRecord`` holding ``num-examples``
(the way Flower's PyTorch examples are written) adopts CRAFT, Krum or any other fedloom rule
by changing the strategy it constructs::

    strategy = FedAvg(fraction_train=0.5)          # before
    strategy = CRAFT(fraction_train=0.5)           # after

Everything else is Flower's (node sampling, the train config, client-side evaluation:
:class:`flwr.serverapp.strategy.FedAvg`'s). What fedloom adds, in
:meth:`FedloomRule.aggregate_train`: pseudo-gradients ``g_k = w − w_k`` against the arrays
sent (or decoded from a :class:`~fedloom.integrations.flower.stock.CompressionMod` payload),
the engine's screening (rejected replies counted, never averaged), the registered
aggregator, the server step ``w ← w − η_g·opt(direction)`` (skipped, never applied, when it
is not finite), and the ``num-examples``-weighted mean of the buffers.

Checked (tests/test_flower_strategies.py): the same replies give the arrays of fedloom's
aggregator and server optimizer, max difference 0 in float64 (CRAFT with SGD and Adam, Krum,
FedAvg with momentum; near-collinear rows of a BatchNorm MLP, d = 292); a 3-round stock
ClientApp run with :class:`CRAFT` ends at the engine's model, max difference 0. Departures
from the engine: the cohort is Flower's sample, and a client's data size is its
``num-examples``. Each step in detail, the metrics a rule needs from the replies and the
package's modules: docs/reference/api.md (What a strategy does in a round).
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
              "Options: groups, rtol, sv_floor, atol, precision, match_reference, step, "
              "step_up, step_down, step_min, step_max, targets, targets_q. The engine's "
              "default: step rprop, step_max 100 at server_lr auto = 1.0; step='fixed' is "
              "the paper's (server_lr auto = 0.1).")
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
