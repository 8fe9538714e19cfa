"""Round orchestration, backends, checkpoints."""

from fedloom.engine.backends import Backend, SequentialBackend
from fedloom.engine.loop import Experiment, Result, RunState, model_sha256, run

__all__ = ["Backend", "Experiment", "Result", "RunState", "SequentialBackend", "model_sha256",
           "run"]
