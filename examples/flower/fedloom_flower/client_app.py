"""ClientApp: fedloom's local SGD on this SuperNode's client, then compressor + EF (the mod).

The SuperNode says which client it is with ``--node-config "partition-id=K"``.
"""

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedloom.integrations.flower import FedloomMod, FedloomTrainer
from fedloom_flower import fedloom_config

_APPS: dict[str, tuple] = {}


def _parts(context: Context) -> tuple:
    key = repr(sorted(context.run_config.items()))
    if key not in _APPS:
        cfg = fedloom_config(context)
        _APPS[key] = (FedloomMod(cfg), FedloomTrainer(cfg))
    return _APPS[key]


def _mod(msg: Message, context: Context, call_next) -> Message:
    return _parts(context)[0](msg, context, call_next)


app = ClientApp(mods=[_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _parts(context)[1](msg, context)

