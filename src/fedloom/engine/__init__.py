"""Round orchestration, backends, checkpoints."""

from fedloom.engine.experiment import Experiment
from fedloom.engine.runs.loop import run
from fedloom.engine.runstate import Result, RunState, model_sha256
from fedloom.engine.trainers.backends import Backend, SequentialBackend

__all__ = ["Backend", "Experiment", "Result", "RunState", "SequentialBackend", "model_sha256",
           "run"]
