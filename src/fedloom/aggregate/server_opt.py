"""Moved to :mod:`fedloom.server_opt` (this path re-exports the named server optimizers)."""

from fedloom.server_opt.optimizers import (
    ServerOptimizer,
    adagrad,
    adam,
    make_server_optimizer,
    momentum,
    sgd,
    yogi,
)

__all__ = ["ServerOptimizer", "adagrad", "adam", "make_server_optimizer", "momentum", "sgd",
           "yogi"]
