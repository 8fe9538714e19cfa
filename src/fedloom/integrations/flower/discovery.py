"""Which SuperNode is which fedloom client: the client-id ask before round 1.

:func:`discover_clients` waits until the federation has its nodes, asks each
which client it is and tells the ways this can fail apart, each with its own
line: a node that answered with an error (an app that cannot answer the ask: a
stock ClientApp) and a node that did not answer within ``node_timeout`` (a slow
or still-starting node) call for different fixes.
"""

from __future__ import annotations

import logging
import time

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from fedloom.integrations.flower.messages import HELLO_KEY
from fedloom.integrations.flower.records import rec_int

log = logging.getLogger("fedloom")

ASKS = 3  # a node that answers with an error is asked again, within node_timeout


def _hello(nodes: list[int]) -> list[Message]:
    return [Message(RecordDict({HELLO_KEY: ConfigRecord({"ask": "client-id"})}),
                    dst_node_id=i, message_type=MessageType.TRAIN) for i in nodes]


def _reason(text: str) -> str:
    """An error's reason on one line (Flower's span several), at most 200 characters."""
    one = " ".join(text.split())
    return one if len(one) <= 200 else one[:197] + "..."


def _answer(rep: Message) -> int | str:
    """The client id a hello reply gives, or why it gives none."""
    if rep.has_error():
        return _reason(rep.error.reason or "an error without a reason")
    try:
        return rec_int(rep.content[HELLO_KEY]["client-id"])
    except (KeyError, TypeError, ValueError) as e:
        return f"no client id in its reply ({type(e).__name__}: {e})"


def discover_clients(grid: Grid, num_clients: int, node_timeout: float, *, who: str,
                     needs: str) -> dict[int, int]:
    """``{client id: node id}`` for clients ``0 .. num_clients-1``, or one line saying why not.

    Waits (up to ``node_timeout`` s in all) until ``grid`` has ``num_clients`` nodes,
    then asks each for its client id. A node that answers with an error is asked
    again (:data:`ASKS` asks) while time is left: on a loaded machine a simulated
    node's first reply can be an error, while an app that cannot answer fails each
    ask at once. ``who`` starts each message (``"flower"``); ``needs`` says, for a
    node that answered with an error, which app the strategy needs on every node.
    """
    start = time.monotonic()
    deadline = start + node_timeout
    n = num_clients
    while len(ids := list(grid.get_node_ids())) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{who}: {len(ids)} of {n} SuperNodes connected within "
                               f"node_timeout={node_timeout:g} s (waited "
                               f"{time.monotonic() - start:.1f} s)")
        time.sleep(0.2)
    nodes: dict[int, int] = {}
    failed: dict[int, str | None] = {}  # node → its last ask's error; None: no reply to it
    asked = list(ids)
    for attempt in range(ASKS):
        left = deadline - time.monotonic()
        if not asked or left <= 0:
            break
        failed.update(dict.fromkeys(asked))
        for rep in grid.send_and_receive(_hello(asked), timeout=left):
            node, k = rep.metadata.src_node_id, _answer(rep)
            if isinstance(k, str):
                failed[node] = k
                log.warning("%s: node %d did not say its client id (ask %d of %d): %s",
                            who, node, attempt + 1, ASKS, k)
                continue
            if nodes.get(k, node) != node:
                raise RuntimeError(f"{who}: two SuperNodes claim client {k}")
            nodes[k] = node
            failed.pop(node, None)
        asked = [i for i in asked if i in failed]
    missing = sorted(set(range(n)) - set(nodes))
    if missing:
        raise RuntimeError(_why_missing(who, needs, missing, len(ids), sorted(nodes), failed,
                                        node_timeout, time.monotonic() - start))
    log.info("%s: %d SuperNodes said which client they are in %.1f s (node_timeout %g s)",
             who, len(nodes), time.monotonic() - start, node_timeout)
    return nodes


def _why_missing(who: str, needs: str, missing: list[int], num_nodes: int, found: list[int],
                 failed: dict[int, str | None], node_timeout: float, waited: float) -> str:
    """The one line for clients no node claimed: the nodes that answered with an
    error (the app), else those that did not answer in time (``node_timeout``)."""
    errors = {node: why for node, why in failed.items() if why is not None}
    silent = sorted(node for node, why in failed.items() if why is None)
    if errors:
        node, why = next(iter(sorted(errors.items())))
        late = (f"; {len(silent)} more did not answer within node_timeout="
                f"{node_timeout:g} s" if silent else "")
        return (f"{who}: {len(errors)} of {num_nodes} SuperNodes answered the client-id ask "
                f"with an error (node {node}: {why}){late}; {needs}")
    if silent:
        return (f"{who}: {len(silent)} of {num_nodes} SuperNodes did not answer the client-id "
                f"ask within node_timeout={node_timeout:g} s (waited {waited:.1f} s; nodes "
                f"{silent[:10]}): a node still starting (a loaded machine, a simulation "
                "starting its Ray actors) needs a longer node_timeout")
    return (f"{who}: no SuperNode said it is client {missing[:10]} (the {num_nodes} "
            f"SuperNodes answered for clients {found[:10]})")
