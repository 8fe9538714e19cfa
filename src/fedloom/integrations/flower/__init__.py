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

The package: :mod:`fedloom.integrations.flower.messages` (what fedloom's messages
carry: the records' keys, a model and its buffers as ArrayRecords, a node's client id
and round settings, the scope check), :mod:`fedloom.integrations.flower.cache` (the
Experiment and the client slices a ClientApp process keeps between messages),
:mod:`fedloom.integrations.flower.client` (:class:`FedloomMod`,
:class:`FedloomTrainer`, :func:`client_app`) and
:mod:`fedloom.integrations.flower.server` (:class:`FedloomStrategy`,
:func:`poll_replies`, :func:`server_app`). Every name is importable from here.
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
