"""Server optimizers: ``w ← w − η_g · opt(agg)``, each a chain of transforms.

Reddi et al., "Adaptive Federated Optimization" (ICLR 2021), Algorithm 2, in
the pseudo-gradient sign (``agg`` points like a gradient):

- sgd:      ``w ← w − η agg``
- momentum: ``v ← β v + agg``, ``w ← w − η v``  (FedAvgM, Hsu et al. 2019)
- adam:     ``m ← β₁m + (1−β₁)agg``, ``v ← β₂v + (1−β₂)agg²``,
            ``w ← w − η m / (√v + τ)``
- yogi:     as adam with ``v ← v − (1−β₂) agg² sign(v − agg²)``
- adagrad:  ``v ← v + agg²``, ``w ← w − η agg / (√v + τ)``  (FedAdagrad; no β₁)

As in the paper there is no bias correction, ``τ`` (``eps``) is the
adaptivity floor (default 1e-3) and the second moment starts at ``τ²``.

Each named optimizer (:mod:`fedloom.server_opt.optimizers`, the registered
``server.optimizer`` names) is a chain of the transforms of
:mod:`fedloom.server_opt.transforms` (``scale``, ``momentum``, ``adam``,
``yogi``, ``adagrad``) ending in ``scale(η)``. A chain of one's own is a server
optimizer too: ``fedloom.run(cfg, server=chain(momentum(0.9), scale(0.5)))``.
The names exported here are the transforms'; the registered factories of the
same names (which take ``lr``) are :mod:`fedloom.server_opt.optimizers`'.
"""

from fedloom.server_opt.optimizers import ServerOptimizer, make_server_optimizer
from fedloom.server_opt.transforms import (
    Adagrad,
    Adam,
    Chain,
    Momentum,
    Preconditioner,
    Scale,
    ServerTransform,
    State,
    Yogi,
    adagrad,
    adam,
    chain,
    momentum,
    scale,
    yogi,
)

__all__ = ["Adagrad", "Adam", "Chain", "Momentum", "Preconditioner", "Scale",
           "ServerOptimizer", "ServerTransform", "State", "Yogi", "adagrad", "adam",
           "chain", "make_server_optimizer", "momentum", "scale", "yogi"]
