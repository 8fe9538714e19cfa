"""fedloom's log records in Flower's log: :func:`bridge_logs_to_flower`.

Every strategy of the package calls it when it is built (and so does
:class:`~fedloom.integrations.flower.FedloomStrategy`): fedloom's warnings (rejected
clients, skipped steps) then appear where Flower's own lines do, in its console,
its log file and ``flwr log``.
"""

from __future__ import annotations

import logging
import time

from flwr.common.logger import FLOWER_LOGGER

log = logging.getLogger("fedloom")


class _FlowerLogBridge(logging.Handler):
    """Hands fedloom's log records to the handlers of Flower's logger (its console,
    its log file, the uploader behind ``flwr log``), so they appear where Flower's
    own lines do, with Flower's level and fedloom's name and time in the text.
    Flower's handlers are looked up at each record: a deployment adds its uploader
    after the strategy is built. Only Flower's own handlers are called (not the
    root's), so a process that also logs ``fedloom`` to the root sees each line
    once there."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            rec = logging.makeLogRecord(record.__dict__)
            stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
            rec.msg = f"[fedloom {stamp}.{int(record.msecs):03d}] {record.getMessage()}"
            rec.args = None
            for h in FLOWER_LOGGER.handlers:
                if rec.levelno >= h.level:
                    h.handle(rec)
        except Exception:  # logging never breaks a round
            self.handleError(record)


def bridge_logs_to_flower() -> None:
    """Route the ``fedloom`` logger's records to Flower's log as well (idempotent;
    done by every strategy here when it is built)."""
    if not any(isinstance(h, _FlowerLogBridge) for h in log.handlers):
        log.addHandler(_FlowerLogBridge())
