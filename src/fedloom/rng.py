"""Explicit, derived randomness.

Every random choice in fedloom comes from a generator derived from the tuple
``(seed, round, client, purpose)``. The derived
seed is a BLAKE2b hash of that tuple, so streams are independent of one
another and of the order in which they are requested: the same config and seed
give the same bits whatever the backend, the order of clients, or a
stop-and-resume in between. There is no global RNG anywhere in fedloom.

``round`` and ``client`` are ``-1`` where they do not apply (the partition is
drawn once, before round 0, for no particular client).
"""

from __future__ import annotations

import hashlib
from enum import StrEnum

import numpy as np
import torch

__all__ = ["Purpose", "derive_seed", "numpy_gen", "torch_gen"]


class Purpose(StrEnum):
    """What a random stream is used for. Each purpose is its own stream."""

    PARTITION = "partition"
    SPLIT = "split"          # per-client train/test split
    DATA = "data"            # synthetic data generation
    INIT = "init"            # model initialisation
    COHORT = "cohort"        # which clients take part in a round
    BATCH = "batch"          # batch order of local training
    COMPRESS = "compress"    # stochastic compressors (rand-k, QSGD)
    EVAL = "eval"


def derive_seed(seed: int, round: int = -1, client: int = -1, purpose: str = "") -> int:
    """A 63-bit seed that depends on every field of ``(seed, round, client, purpose)``."""
    msg = f"fedloom/{int(seed)}/{int(round)}/{int(client)}/{purpose}".encode()
    digest = hashlib.blake2b(msg, digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def torch_gen(seed: int, round: int = -1, client: int = -1, purpose: str = "") -> torch.Generator:
    """A CPU ``torch.Generator`` seeded from the derived seed."""
    g = torch.Generator()
    g.manual_seed(derive_seed(seed, round, client, purpose))
    return g


def numpy_gen(
    seed: int, round: int = -1, client: int = -1, purpose: str = ""
) -> np.random.Generator:
    """A NumPy ``Generator`` (PCG64) seeded from the derived seed."""
    return np.random.default_rng(derive_seed(seed, round, client, purpose))
