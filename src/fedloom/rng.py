"""Explicit, derived randomness.

Every random choice in fedloom comes from a generator derived from the tuple
``(seed, round, client, purpose)``. The derived
seed is a BLAKE2b hash of that tuple, so streams are independent of one
another and of the order in which they are requested: the same config and seed
give the same bits whatever the backend, the order of clients, or a
stop-and-resume in between. There is no global RNG anywhere in fedloom:
code that draws from torch's global generator — a user's model factory,
dropout in a train-mode forward — runs under :func:`seeded_global_rng` or
:func:`forked_rng`, seeded from a derived seed, and leaves the global state as
it found it.

``round`` and ``client`` are ``-1`` where they do not apply (the partition is
drawn once, before round 0, for no particular client).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum

import numpy as np
import torch

__all__ = ["Purpose", "derive_seed", "forked_rng", "numpy_gen", "reseed", "seeded_global_rng",
           "torch_gen"]


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
    DP_NOISE = "dp-noise"    # Gaussian noise of differential privacy (fedloom.privacy)
    DP_COUNT = "dp-count"    # noise of the clipped-count estimate (adaptive clipping)
    DP_TREE = "dp-tree"      # the noise of a tree node of DP-FTRL (fedloom.ftrl)
    SYSTEM = "system"              # a client's simulated device and links (fedloom.system)
    AVAILABILITY = "availability"  # whether a client can be sampled in a round, its phase
    CLIENT_DROPOUT = "client-dropout"  # whether a sampled client drops out mid-round
    DROPOUT = "dropout"      # randomness inside a train-mode forward (dropout masks)
    AUGMENT = "augment"      # training augmentation (random crops and flips)
    FEATURE = "feature"      # a client's feature skew (fedloom.data.feature)
    PROBE = "probe"          # the synthetic inputs plug-ins are checked on before round 1
    AUDIT_MEMBERSHIP = "audit-membership"  # whether an audit's canary is in the run
    AUDIT_CANARY = "audit-canary"          # the direction an audit's canary sends
    BUCKETING = "bucketing"  # the server's shuffle of a round's rows into buckets
    FLAME_NOISE = "flame-noise"  # the Gaussian noise FLAME adds to its aggregate
    ROOT = "root"            # the server's root samples (a reference update's data)
    REFERENCE = "reference"  # the batch order of the server's reference update
    POPULATION = "population"              # a population user's samples (data.population)
    POPULATION_SIZE = "population-size"    # a block of population users' sample counts
    POPULATION_TEST = "population-test"    # a held-out user's samples (the global test set)
    POPULATION_TEST_SIZE = "population-test-size"  # a block of held-out users' counts


def derive_seed(seed: int, round: int = -1, client: int = -1, purpose: str = "") -> int:
    """A 63-bit seed that depends on every field of ``(seed, round, client, purpose)``.

    The same fields give the same seed on every machine and in every version (a
    BLAKE2b digest), so reruns and resumed runs draw the same numbers:

    >>> derive_seed(0, round=3, client=7, purpose="cohort")
    2485192879032364992
    >>> derive_seed(0, 3, 7, "cohort") == derive_seed(0, 3, 7, "batch")
    False
    >>> 0 <= derive_seed(12345) < 2**63
    True
    """
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
    """A NumPy ``Generator`` (PCG64) seeded from the derived seed.

    >>> a = numpy_gen(1, round=0, client=2, purpose="batch").integers(0, 100, 5)
    >>> b = numpy_gen(1, round=0, client=2, purpose="batch").integers(0, 100, 5)
    >>> a.tolist() == b.tolist()
    True
    """
    return np.random.default_rng(derive_seed(seed, round, client, purpose))


@contextmanager
def forked_rng(seed: int, device: torch.device | None = None) -> Iterator[None]:
    """Run a block whose code draws from torch's *global* generator (``nn.Dropout``,
    ``torch.randn`` in a user's forward) from ``seed``, leaving that generator as
    it was.

    The CPU generator, and the default generator of ``device`` when it is a CUDA
    device (where a CUDA tensor's dropout draws), are saved, seeded with ``seed``
    and restored on exit (:func:`torch.random.fork_rng`); other devices'
    generators are not touched. Inside, :func:`reseed` moves to another stream
    without another save/restore.
    """
    devices = []
    if device is not None and device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices, device_type="cuda"):
        reseed(seed, device)
        yield


def reseed(seed: int, device: torch.device | None = None) -> None:
    """Seed the global generator(s) that :func:`forked_rng` forked (call inside it)."""
    torch.default_generator.manual_seed(seed)
    if device is not None and device.type == "cuda":
        idx = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.default_generators[idx].manual_seed(seed)


@contextmanager
def seeded_global_rng(seed: int) -> Iterator[None]:
    """Run a user's code (a model factory) with every global generator it may draw
    from — torch's (CPU and every initialised CUDA device), NumPy's legacy one and
    Python's ``random`` — seeded from ``seed``, and each restored on exit."""
    # The legacy NumPy calls are the point here: they save, seed and restore the
    # global state that a user's code may draw from.
    np_state, py_state = np.random.get_state(), random.getstate()  # noqa: NPY002
    # Only initialised CUDA devices: torch.manual_seed would queue a seed for the
    # others, to be applied (unrestored) when CUDA starts later.
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    devices = list(range(torch.cuda.device_count())) if cuda else []
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.default_generator.manual_seed(seed)
            for i in devices:
                torch.cuda.default_generators[i].manual_seed(seed)
            np.random.seed(seed % (1 << 32))  # noqa: NPY002
            random.seed(seed)
            yield
    finally:
        np.random.set_state(np_state)  # noqa: NPY002
        random.setstate(py_state)
