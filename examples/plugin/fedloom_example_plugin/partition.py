"""A partitioner named by ``module:attr`` (no entry point):
``data.partition.name=fedloom_example_plugin.partition:round_robin``."""

from __future__ import annotations

import numpy as np


def round_robin(labels: np.ndarray, num_clients: int, *,
                rng: np.random.Generator) -> list[np.ndarray]:
    """Sample ``i`` (in source order) goes to client ``i mod num_clients``."""
    if len(labels) < num_clients:
        raise ValueError(f"round_robin: {num_clients} clients need a sample each; "
                         f"the data has {len(labels)}")
    idx = np.arange(len(labels))
    return [idx[k::num_clients] for k in range(num_clients)]
