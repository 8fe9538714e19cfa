"""ServerApp: fedloom's server half of each round (sampling, decoding, CRAFT, server step)."""

import json
import logging

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedloom.integrations.flower import FedloomStrategy, poll_replies
from fedloom_flower import fedloom_config

app = ServerApp()
log = logging.getLogger("fedloom")


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = fedloom_config(context)
    # at most node-timeout s for the SuperNodes to connect and say which client they are
    node_timeout = float(context.run_config.get("node-timeout", 120.0))
    strategy = FedloomStrategy(cfg, node_timeout=node_timeout)
    # Flower's deployment grid waits 3 s between pulls for replies; 0 keeps that.
    poll = float(context.run_config.get("poll-s", 0.1))
    if poll > 0:
        poll_replies(grid, poll)
    strategy.start(grid=grid, initial_arrays=strategy.initial_arrays(), num_rounds=cfg.rounds)
    last = strategy.history[-1]
    print(json.dumps({"rounds": len(strategy.history), "model_sha256": strategy.model_sha256(),
                      "test_acc": last.get("test_acc"),
                      "uplink_bytes_total": last.get("uplink_bytes_total"),
                      # seconds from sending a round's messages to its aggregate
                      "round_s": [round(m["wall_s"], 3) for m in strategy.history]}))
