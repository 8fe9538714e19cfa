"""The ClientApp that trains: fedloom's local SGD on this SuperNode's client, then
compressor + error feedback (the mod). Flower loads :mod:`fedloom_flower.client_app`,
which runs this app in a worker that stays up between messages (``warm = true``,
the default) or in Flower's own process per message (``warm = false``).

The SuperNode says which client it is with ``--node-config "partition-id=K"``.
"""

import json

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedloom.config import config_to_dict
from fedloom.integrations.flower import FedloomMod, FedloomTrainer
from fedloom_flower import fedloom_config

_APPS: dict[str, tuple] = {}


def _parts(context: Context) -> tuple:
    # Keyed by the config's content, not the run config: a warm worker that serves
    # a second run after the file was edited builds the new config.
    cfg = fedloom_config(context)
    key = json.dumps(config_to_dict(cfg), sort_keys=True)
    if key not in _APPS:
        _APPS[key] = (FedloomMod(cfg), FedloomTrainer(cfg))
    return _APPS[key]


def _mod(msg: Message, context: Context, call_next) -> Message:
    return _parts(context)[0](msg, context, call_next)


app = ClientApp(mods=[_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _parts(context)[1](msg, context)
