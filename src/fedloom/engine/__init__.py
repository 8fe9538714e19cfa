"""Round orchestration, backends, checkpoints."""

from fedloom.engine.backends import Backend, SequentialBackend
from fedloom.engine.experiment import Experiment
from fedloom.engine.loop import run
from fedloom.engine.runstate import Result, RunState, model_sha256

__all__ = ["Backend", "Experiment", "Result", "RunState", "SequentialBackend", "model_sha256",
           "run"]
