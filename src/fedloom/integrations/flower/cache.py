"""What a ClientApp process keeps between messages: one Experiment per config, client slices.

A SuperNode's process builds the config's Experiment (data, model, partition) once
(``_experiment``) and gathers client ``k``'s training slice once (``_client_data``);
:data:`LOADS` counts how often each happened (read by the tests, the deployment
benchmark and :mod:`fedloom.integrations.warm`'s stats). Tests that want a fresh
process replace ``_EXPERIMENTS``, ``_CLIENT_DATA`` and ``LOADS`` here.
"""

from __future__ import annotations

import torch

from fedloom.config import Config, config_to_dict
from fedloom.engine.experiment import Experiment
from fedloom.engine.inputs import ClientData

_EXPERIMENTS: dict[str, Experiment] = {}
# Client k's training slice, keyed by (config, k): a ClientApp process that gets a
# second message (Flower's simulation runtime, or any runtime that keeps the process)
# neither reloads the data nor gathers the slice again. Flower's deployment runtime
# (flwr 1.42, both isolation modes) starts a fresh process per message, so there the
# cache lives for one message; docs/deploy.md has the measured costs.
_CLIENT_DATA: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
# How often this process built an Experiment and gathered a client's slice (what the
# caches above save; read by the tests and the deployment benchmark).
LOADS = {"experiment": 0, "client_data": 0}


def _config_key(cfg: Config) -> str:
    import json

    return json.dumps(config_to_dict(cfg), sort_keys=True)


def _experiment(cfg: Config) -> Experiment:
    """One Experiment per config and process (a SuperNode loads the data once)."""
    key = _config_key(cfg)
    if key not in _EXPERIMENTS:
        _EXPERIMENTS[key] = Experiment.from_config(cfg)
        LOADS["experiment"] += 1
    return _EXPERIMENTS[key]


def _client_data(cfg: Config, clients: ClientData, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client k's training inputs and labels (of ``clients``, the clients of ``cfg``'s
    experiment), gathered once per config and process."""
    key = (_config_key(cfg), k)
    if key not in _CLIENT_DATA:
        idx = torch.from_numpy(clients.fed.train[k])
        _CLIENT_DATA[key] = (clients.x[idx], clients.y[idx])
        LOADS["client_data"] += 1
    return _CLIENT_DATA[key]
