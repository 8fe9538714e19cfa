"""A ClientApp for tests/test_warm.py, run by the warm worker (imported there by
name): fedloom's trainer and mod on the config in ``run_config["fedloom"]`` (JSON),
plus two faults the tests ask for by run config."""

from __future__ import annotations

import json
import os
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from fedloom.config import load_config
from fedloom.integrations.flower import FedloomMod, FedloomTrainer

_PARTS: dict[str, tuple] = {}


def _parts(context: Context) -> tuple:
    key = str(context.run_config["fedloom"])
    if key not in _PARTS:
        cfg = load_config(json.loads(key))
        _PARTS[key] = (FedloomMod(cfg), FedloomTrainer(cfg))
    return _PARTS[key]


def _faults(context: Context) -> None:
    if context.run_config.get("raise"):
        raise ValueError("asked to fail")
    die = context.run_config.get("die-once", "")
    if die and Path(str(die)).exists():  # this process dies mid-message, once
        Path(str(die)).unlink()
        os._exit(3)


def _mod(msg: Message, context: Context, call_next) -> Message:
    _faults(context)
    return _parts(context)[0](msg, context, call_next)


app = ClientApp(mods=[_mod])


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _parts(context)[1](msg, context)
