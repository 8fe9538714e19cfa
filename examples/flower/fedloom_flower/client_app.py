"""The ClientApp Flower loads: a relay that hands each message to a worker which
keeps torch, the client's data and the model loaded between messages
(:mod:`fedloom.integrations.warm`); the worker runs :mod:`fedloom_flower.trainer_app`.

This module imports Flower and the standard library only, so the process Flower
starts for every message is ready in about the time of a ClientApp that does
nothing. ``flwr run --run-config 'warm=false'`` runs the trainer in that process
instead (Flower's own behaviour: torch and the data are loaded per message).
"""

from fedloom.integrations.warm import warm_client_app

app = warm_client_app("fedloom_flower.trainer_app:app")
