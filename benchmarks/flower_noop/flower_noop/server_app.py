"""Sends every node a model-sized ArrayRecord per round and times each round (from
sending to the last reply), the same span as fedloom's ``wall_s`` on Flower."""

import json
import time

import numpy as np
from flwr.app import ArrayRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedloom.integrations.flower import poll_replies

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    rounds, nodes, d = int(rc["rounds"]), int(rc["nodes"]), int(rc["params"])
    if float(rc["poll-s"]) > 0:
        poll_replies(grid, float(rc["poll-s"]))
    deadline = time.monotonic() + 300
    while len(ids := list(grid.get_node_ids())) < nodes:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(ids)} of {nodes} SuperNodes connected")
        time.sleep(0.2)
    arrays = ArrayRecord(numpy_ndarrays=[np.zeros(d, dtype=np.float32)])
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        msgs = [Message(RecordDict({"arrays": arrays}), dst_node_id=i,
                        message_type=MessageType.TRAIN) for i in ids]
        replies = list(grid.send_and_receive(msgs, timeout=600))
        if len(replies) != len(ids) or any(r.has_error() for r in replies):
            raise RuntimeError("a node did not answer")
        times.append(round(time.perf_counter() - t0, 3))
    print(json.dumps({"rounds": rounds, "round_s": times}))
