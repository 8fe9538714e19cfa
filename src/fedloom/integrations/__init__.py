"""Integrations with other FL runtimes (imported on demand: each needs its extra).

- :mod:`fedloom.integrations.flower`: a Flower strategy, client mod and app builders.
"""
