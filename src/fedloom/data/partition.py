"""Partitioners: labels → one index array per client.

Every partitioner returns disjoint index arrays that cover all samples (except
``dirichlet``/``shards`` drop nothing either), is a pure function of its
generator, and raises :class:`PartitionError` with a clear message when its
constraints cannot be met, instead of looping forever.

- ``iid``: a random permutation cut into near-equal parts.
- ``contiguous``: consecutive blocks in the source's order.
- ``dirichlet``: per class, proportions over clients ``~ Dir(α·1)``
  (Hsu et al. 2019; Yurochkin et al. 2019 — the sampler of CRAFT's and
  FedLab's code, with the balancing rule that a client already holding
  ``n/N`` samples receives no more); redrawn until every client has at least
  ``min_samples``, at most ``max_tries`` times.
- ``shards``: McMahan et al. 2017: sort by label, cut into ``N·s`` shards,
  give each client ``s`` random shards.
- ``natural``: one client per group id (writer, user, role).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from fedloom.registry import register

__all__ = ["PartitionError", "Partitioner", "contiguous", "dirichlet", "iid", "natural",
           "shards"]


class PartitionError(ValueError):
    """The partition's constraints cannot be met."""


class Partitioner(Protocol):
    def __call__(
        self, labels: np.ndarray, num_clients: int, *, rng: np.random.Generator
    ) -> list[np.ndarray]: ...


def _check(labels: np.ndarray, num_clients: int) -> None:
    if num_clients < 1:
        raise PartitionError(f"num_clients must be >= 1, got {num_clients}")
    if len(labels) < num_clients:
        raise PartitionError(
            f"cannot give {num_clients} clients at least one sample each from {len(labels)} samples"
        )


@register("partitioner", "iid")
def iid(labels: np.ndarray, num_clients: int, *, rng: np.random.Generator) -> list[np.ndarray]:
    """A random permutation cut into near-equal parts.

    Reference:
        paper: none (the IID baseline).
        code: none needed.
        departures: none.
    """
    _check(labels, num_clients)
    perm = rng.permutation(len(labels))
    return [np.sort(p) for p in np.array_split(perm, num_clients)]


@register("partitioner", "contiguous")
def contiguous(labels: np.ndarray, num_clients: int, *,
               rng: np.random.Generator) -> list[np.ndarray]:
    """Consecutive blocks in source order (FLARE's "first 600 images each").

    Reference:
        paper: FLARE's experiments (10 clients × the first 600 images each).
        code: RanGreidi/FLARE.
        departures: none.
    """
    _check(labels, num_clients)
    return [np.asarray(p) for p in np.array_split(np.arange(len(labels)), num_clients)]


@register("partitioner", "dirichlet")
def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    *,
    rng: np.random.Generator,
    alpha: float = 0.5,
    min_samples: int = 10,
    max_tries: int = 1000,
    min_policy: str = "resample",
    balance: bool = False,
) -> list[np.ndarray]:
    """Label-skewed split with ``p_c ~ Dir(α)`` per class ``c``.

    Args:
        alpha: concentration; small α → each client sees few classes.
        min_samples: every client must end with at least this many samples.
        max_tries: redraws before giving up (``resample``) or keeping the best
            draw (``move``).
        min_policy: ``resample`` redraws until the minimum holds and raises
            :class:`PartitionError` after ``max_tries``; ``move`` keeps the draw
            with the largest minimum and then moves samples from the largest
            clients to the small ones (CRAFT's code), which always succeeds
            when ``N · min_samples <= n``.
        balance: afterwards trim every client to ``⌊n/N⌋`` samples and hand the
            surplus to clients below it (CRAFT's code, ``balance=True``): equal
            sizes, with the label skew of the draw diluted by the surplus.

    Reference:
        paper: Hsu, Qi & Brown, "Measuring the Effects of Non-Identical Data Distribution for
            Federated Visual Classification", 2019; Yurochkin et al., ICML 2019.
        code: tum-pbs/CRAFT and FedLab (the sampler with the balancing rule).
        departures: redrawn until every client has ``min_samples`` (``min_policy: move`` moves
            samples instead).
    """
    _check(labels, num_clients)
    if alpha <= 0:
        raise PartitionError(f"dirichlet alpha must be > 0, got {alpha}")
    n = len(labels)
    if num_clients * min_samples > n:
        raise PartitionError(
            f"dirichlet: {num_clients} clients x min_samples {min_samples} = "
            f"{num_clients * min_samples} exceeds the {n} samples"
        )
    if min_policy not in ("resample", "move"):
        raise PartitionError(
            f"dirichlet: min_policy must be 'resample' or 'move', got {min_policy!r}"
        )
    classes = np.unique(labels)
    by_class = [np.flatnonzero(labels == c) for c in classes]
    best = 0
    best_parts: list[np.ndarray] | None = None
    for _ in range(max_tries):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        sizes = np.zeros(num_clients, dtype=np.int64)
        for idx in by_class:
            idx = rng.permutation(idx)
            p = rng.dirichlet(np.full(num_clients, alpha))
            # Balancing rule: clients that already hold n/N samples get no more.
            p = p * (sizes < n / num_clients)
            total = p.sum()
            p = p / total if total > 0 else np.full(num_clients, 1.0 / num_clients)
            cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].append(chunk)
                sizes[k] += len(chunk)
        if best_parts is None or int(sizes.min()) > best:
            best = int(sizes.min())
            best_parts = [np.concatenate(p) for p in parts]
        if sizes.min() >= min_samples:
            break
    assert best_parts is not None
    if best >= min_samples or min_policy == "move":
        out = best_parts if best >= min_samples else _move_to_minimum(best_parts, min_samples, rng)
        if balance:
            out = _balance(out, n // num_clients, rng)
        return [np.sort(p) for p in out]
    raise PartitionError(
        f"dirichlet(alpha={alpha}): no split in {max_tries} tries gives every one of "
        f"{num_clients} clients >= {min_samples} samples (best minimum: {best}); "
        "lower min_samples or num_clients, or raise alpha"
    )


def _move_to_minimum(
    parts: list[np.ndarray], min_samples: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Give every client ``min_samples`` by taking samples from the largest clients."""
    buckets = [list(rng.permutation(p)) for p in parts]
    for k in range(len(buckets)):
        while len(buckets[k]) < min_samples:
            donor = max(range(len(buckets)), key=lambda j: len(buckets[j]))
            take = min(min_samples - len(buckets[k]), len(buckets[donor]) - min_samples)
            if take <= 0:  # pragma: no cover (excluded by the N·min <= n check)
                raise PartitionError("dirichlet: cannot move samples to meet min_samples")
            buckets[k].extend(buckets[donor][-take:])
            del buckets[donor][-take:]
    return [np.asarray(b, dtype=np.int64) for b in buckets]


def _balance(parts: list[np.ndarray], target: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Trim clients above ``target``; hand the surplus to those below, then one each."""
    kept, surplus = [], []
    for p in parts:
        p = rng.permutation(p)
        kept.append(list(p[:target]))
        surplus.extend(p[target:].tolist())
    surplus = list(rng.permutation(np.asarray(surplus, dtype=np.int64)))
    for k in range(len(kept)):
        need = target - len(kept[k])
        if need > 0:
            kept[k].extend(surplus[:need])
            surplus = surplus[need:]
    for k in range(len(kept)):
        if not surplus:
            break
        kept[k].append(surplus.pop())
    return [np.asarray(b, dtype=np.int64) for b in kept]


@register("partitioner", "shards")
def shards(
    labels: np.ndarray, num_clients: int, *, rng: np.random.Generator, shards_per_client: int = 2
) -> list[np.ndarray]:
    """McMahan et al. (2017), §3: sorted-label shards, ``s`` per client.

    Reference:
        paper: McMahan et al., AISTATS 2017, §3.
        code: none needed.
        departures: none.
    """
    _check(labels, num_clients)
    n_shards = num_clients * shards_per_client
    if n_shards > len(labels):
        raise PartitionError(
            f"shards: {n_shards} shards ({num_clients} clients x {shards_per_client}) "
            f"exceed the {len(labels)} samples"
        )
    order = np.argsort(labels, kind="stable")
    pieces = np.array_split(order, n_shards)
    assign = rng.permutation(n_shards).reshape(num_clients, shards_per_client)
    return [np.sort(np.concatenate([pieces[s] for s in row])) for row in assign]


@register("partitioner", "natural")
def natural(
    labels: np.ndarray,
    num_clients: int,
    *,
    rng: np.random.Generator,
    groups: np.ndarray | None = None,
) -> list[np.ndarray]:
    """One client per natural group; ``num_clients`` must equal the number of groups.

    Reference:
        paper: Caldas et al., "LEAF: A Benchmark for Federated Settings", 2018 (one client per
            writer, user or role).
        code: none needed.
        departures: none.
    """
    if groups is None:
        raise PartitionError("natural: this dataset has no natural client ids")
    if len(groups) != len(labels):
        raise PartitionError(
            f"natural: {len(groups)} group ids for {len(labels)} samples"
        )
    ids = np.unique(groups)
    if len(ids) != num_clients:
        raise PartitionError(
            f"natural: the data has {len(ids)} natural clients but num_clients is {num_clients}"
        )
    return [np.flatnonzero(groups == g) for g in ids]
