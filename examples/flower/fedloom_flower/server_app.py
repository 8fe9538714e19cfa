"""ServerApp: fedloom's server half of each round (sampling, decoding, CRAFT, server step)."""

import json
import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedloom.integrations.flower import FedloomStrategy
from fedloom_flower import fedloom_config

app = ServerApp()
log = logging.getLogger("fedloom")


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = fedloom_config(context)
    strategy = FedloomStrategy(cfg)
    strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(), num_rounds=cfg.rounds)
    last = strategy.history[-1]
    print(json.dumps({"rounds": len(strategy.history), "model_sha256": strategy.model_sha256(),
                      "test_acc": last.get("test_acc"),
                      "uplink_bytes_total": last.get("uplink_bytes_total")}))
