"""Integrations with other FL runtimes (imported on demand: each needs its extra).

- :mod:`fedloom.integrations.flower`: a Flower strategy, client mod and app builders.
- :mod:`fedloom.integrations.secagg`: the same on Flower's SecAgg+ (sum-only server).
- :mod:`fedloom.integrations.warm`: a ClientApp relay that keeps the real ClientApp
  warm in one worker per SuperNode (Flower starts a process per message).
"""
