"""A dataset named by ``module:attr``: ``data.name=fedloom_example_plugin.data:blobs``.

A loader is called as the built-ins' are, ``(data, seed, **options) -> Dataset``
(``data``: the data section; its keyword arguments are ``data.options``, checked against
this signature); its randomness comes from fedloom's derived generators
(``fedloom.rng``), so a run is reproducible from its seed like any other.
"""

from __future__ import annotations

import torch

from fedloom.data.sources import Dataset
from fedloom.rng import Purpose, numpy_gen


def blobs(data, seed: int, *, samples: int = 600) -> Dataset:
    """Four Gaussian blobs in 2-D (unit spread, centres at (±3, ±3)), ``samples`` of them."""
    gen = numpy_gen(seed, -1, -1, Purpose.DATA)
    centres = torch.tensor([[3.0, 3.0], [3.0, -3.0], [-3.0, 3.0], [-3.0, -3.0]])
    y = torch.from_numpy(gen.integers(0, 4, size=samples)).long()
    x = centres[y] + torch.from_numpy(gen.standard_normal((samples, 2))).float()
    return Dataset("blobs", x, y, num_classes=4)
