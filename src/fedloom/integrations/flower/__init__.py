"""Deploying fedloom on Flower (Message API, ``flwr >= 1.21``; extra ``[flower]``).

- :class:`FedloomStrategy`: a Flower strategy that runs fedloom's server half
  of a round (cohort from fedloom's generator, payloads decoded, malformed or
  non-finite updates rejected, any aggregator and server optimizer: the same
  :meth:`~fedloom.engine.experiment.Experiment.finish_round` as the engine);
- :class:`FedloomMod`: a ClientApp mod that applies a compressor and
  error-feedback policy to ``g = w − w_k``, its residual in ``Context.state``;
- :func:`client_app` / :func:`server_app`: both apps from one fedloom config,
  so a Flower run reproduces ``fedloom run`` on the same config;
- for a stock Flower app, drop-in strategies instead
  (:mod:`fedloom.integrations.flower.strategies`).

Checked (tests/test_flower_buffers.py, Flower's simulation, float64): the model,
the BatchNorm buffers and every evaluation equal ``fedloom run``'s bit for bit
under each ``model.buffers`` policy. Departure: a client does not learn that the
server rejected a finite reply, so it keeps its new residual and buffers where
the engine keeps the old row. Scope: feedback ``none``, ``ef``, ``saef``,
``sapef`` (constant α), ``flare``, ``ec_prox``; method ``sgd``; aggregators
without start losses; others refused with one line naming the field.

Buffers, client ids, the scope and the package's modules in detail:
docs/deploy.md (The pieces in detail).
"""

from __future__ import annotations

try:
    from flwr.app import (  # noqa: F401  (kept: the package's names as before)
        ArrayRecord,
        ConfigRecord,
        Context,
        Message,
        MessageType,
        MetricRecord,
        RecordDict,
    )
    from flwr.clientapp import ClientApp  # noqa: F401
    from flwr.serverapp import Grid, ServerApp  # noqa: F401
    from flwr.serverapp.strategy import Strategy  # noqa: F401
except ImportError as e:  # pragma: no cover (the extra is missing)
    raise ImportError("fedloom.integrations.flower needs Flower: pip install 'fedloom[flower]'"
                      ) from e

from fedloom.integrations.flower.cache import LOADS  # noqa: F401  (re-exported)
from fedloom.integrations.flower.client import FedloomMod, FedloomTrainer, client_app
from fedloom.integrations.flower.messages import (  # noqa: F401  (re-exported)
    BUFFER_STATE_KEY,
    BUFFERS_KEY,
    HELLO_KEY,
    REPLY_KEY,
    STATE_KEY,
    SUPPORTED_FEEDBACK,
    ConfigSource,
    buffers_from_arrays,
    buffers_to_arrays,
    content_bytes,
    from_arrays,
    to_arrays,
)
from fedloom.integrations.flower.server import FedloomStrategy, poll_replies, server_app

__all__ = ["FedloomMod", "FedloomStrategy", "FedloomTrainer", "client_app", "from_arrays",
           "poll_replies", "server_app", "to_arrays"]
