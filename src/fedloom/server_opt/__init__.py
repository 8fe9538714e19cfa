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
``server.optimizer`` names, which take ``lr``) is a chain of the transforms of
:mod:`fedloom.server_opt.transforms` (``scale``, ``heavy_ball``,
``scale_by_adam``, ``scale_by_yogi``, ``scale_by_adagrad``), composed by the one
``chain`` of :mod:`fedloom.transforms` that the local step uses too. A chain of
one's own is a server optimizer too:
``fedloom.run(cfg, server=chain(heavy_ball(0.9), scale(0.5)))``.
"""

from fedloom.server_opt.optimizers import ServerOptimizer, make_server_optimizer
from fedloom.server_opt.transforms import (
    Adagrad,
    Adam,
    Chain,
    HeavyBall,
    Scale,
    ServerTransform,
    State,
    Yogi,
    adagrad,
    adam,
    chain,
    heavy_ball,
    momentum,
    scale,
    scale_by_adagrad,
    scale_by_adam,
    scale_by_yogi,
    yogi,
)

__all__ = ["Adagrad", "Adam", "Chain", "HeavyBall", "Scale", "ServerOptimizer",
           "ServerTransform", "State", "Yogi", "adagrad", "adam", "chain", "heavy_ball",
           "make_server_optimizer", "momentum", "scale", "scale_by_adagrad", "scale_by_adam",
           "scale_by_yogi", "yogi"]
