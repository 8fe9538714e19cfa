"""Partitioners: labels → one index array per client.

Every partitioner returns disjoint index arrays that cover all samples (except
``dirichlet``/``shards`` drop nothing either), is a pure function of its
generator, and raises :class:`PartitionError` with a clear message when its
constraints cannot be met, instead of looping forever.

- ``iid``: a random permutation cut into near-equal parts.
- ``contiguous``: consecutive blocks in the source's order.
- ``dirichlet``: per class, proportions over clients ``~ Dir(α·1)`` (Hsu et al. 2019;
  Yurochkin et al. 2019 — the sampler of CRAFT's and FedLab's code, with the balancing rule
  that a client already holding ``n/N`` samples receives no more); redrawn until every client
  has at least ``min_samples``, at most ``max_tries`` times.
- ``shards``: McMahan et al. 2017: sort by label, cut into ``N·s`` shards,
  give each client ``s`` random shards.
- ``natural``: one client per group id (writer, user, role).
- ``classes``: label-quantity skew, exactly ``k`` classes per client (Li et al. 2022's
  ``#C=k``; flwr-datasets' ``PathologicalPartitioner``).
- ``sizes``: quantity skew, client sizes from a power law, a lognormal or a list; labels
  IID or client-wise Dirichlet (``then: dirichlet``).
- ``mixed``: a fraction of the clients IID, the others from another partitioner.
- ``flwr:NAME``: any flwr-datasets partitioner by name (:mod:`fedloom.data.flwr_partition`).

Feature skew is not a split: it is a per-client transform of the inputs
(:mod:`fedloom.data.feature`), so it composes with every partitioner here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, Protocol

import numpy as np

from fedloom.registry import Range, accepted_options, get, register

__all__ = ["PartitionError", "Partitioner", "classes", "contiguous", "dirichlet", "iid",
           "mixed", "natural", "shards", "sizes"]


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


# The options' types and bounds (data.partition.options, checked when a config loads):
# a concentration above 0 (one, or one per class), counts of at least 1.
_Alpha = Annotated[float | list[float], Range(gt=0)]
_Count = Annotated[int, Range(ge=1)]


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
    alpha: _Alpha = 0.5,
    min_samples: _Count = 10,
    max_tries: _Count = 1000,
    min_policy: Literal["resample", "move"] = "resample",
    balance: bool = False,
) -> list[np.ndarray]:
    """Label-skewed split with ``p_c ~ Dir(α_c · 1_N)`` over the N clients, per class ``c``.

    Args:
        alpha: concentration; small α → each client sees few classes. A list gives
            one ``α_c`` per class (in the order of the sorted class labels): a class
            with a small ``α_c`` is held by few clients, one with a large ``α_c`` is
            spread evenly. (flwr-datasets' ``DirichletPartitioner`` takes a list of
            one α per *client* instead — the concentration vector of one draw; here
            the list is per class, as the issue of heterogeneity settings asks.)
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
    classes = np.unique(labels)
    alphas = _class_alphas(alpha, len(classes), "dirichlet")
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
    by_class = [np.flatnonzero(labels == c) for c in classes]
    best = 0
    best_parts: list[np.ndarray] | None = None
    for _ in range(max_tries):
        parts, sizes = _dirichlet_draw(by_class, alphas, num_clients, n, rng)
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


def _dirichlet_draw(
    by_class: list[np.ndarray], alphas: np.ndarray, num_clients: int, n: int,
    rng: np.random.Generator,
) -> tuple[list[list[np.ndarray]], np.ndarray]:
    """One draw of ``dirichlet``: each client's chunks per class, and its size."""
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    for a_c, idx in zip(alphas, by_class, strict=True):
        idx = rng.permutation(idx)
        p = rng.dirichlet(np.full(num_clients, a_c))
        # Balancing rule: clients that already hold n/N samples get no more.
        p = p * (sizes < n / num_clients)
        total = p.sum()
        p = p / total if total > 0 else np.full(num_clients, 1.0 / num_clients)
        cuts = (np.cumsum(p) * len(idx)).astype(np.int64)[:-1]
        for k, chunk in enumerate(np.split(idx, cuts)):
            parts[k].append(chunk)
            sizes[k] += len(chunk)
    return parts, sizes


def _class_alphas(alpha: float | Sequence[float], num_classes: int, who: str) -> np.ndarray:
    """``α`` as one value per class: a number for every class, or a list of ``C``."""
    if isinstance(alpha, int | float):
        a = np.full(num_classes, float(alpha))
    else:
        a = np.asarray(list(alpha), dtype=np.float64)
        if a.shape != (num_classes,):
            raise PartitionError(f"{who}: alpha: a list needs one value per class "
                                 f"({num_classes} classes in the data), got {len(a)}")
    if not (np.all(np.isfinite(a)) and np.all(a > 0)):
        raise PartitionError(f"{who}: alpha must be > 0, got {alpha}")
    return a


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
    labels: np.ndarray, num_clients: int, *, rng: np.random.Generator,
    shards_per_client: _Count = 2
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


# ------------------------------------------------------------ label-quantity skew
@register("partitioner", "classes")
def classes(
    labels: np.ndarray,
    num_clients: int,
    *,
    rng: np.random.Generator,
    k: _Count = 2,
    assign: Literal["random", "round_robin"] = "random",
    split: Literal["even", "dirichlet"] = "even",
    alpha: _Alpha = 0.5,
    min_samples: _Count = 10,
    max_tries: _Count = 1000,
) -> list[np.ndarray]:
    """Label-quantity skew: every client holds exactly ``k`` distinct classes.

    Assignment (``assign``): ``random`` gives each client ``k`` distinct classes drawn
    uniformly without replacement, redrawn (at most ``max_tries`` times) until every
    class has a holder; ``round_robin`` gives client ``i`` the classes
    ``{(i·k + j) mod C : j < k}``, which uses every class once ``N·k ≥ C``.
    Split (``split``): the ``h_c`` holders of class ``c`` share its shuffled samples
    ``even`` (near-equal parts, ``np.array_split``), or by proportions
    ``q ~ Dir(α_c · 1_{h_c})`` (``dirichlet``; ``alpha`` a number or one per class)
    after one sample each, so that every holder really holds the class.

    Constraints, each refused with :class:`PartitionError` naming it: ``1 ≤ k ≤ C``;
    ``N·k ≥ C`` (else some class has no holder and the split could not cover the
    data); every class has at least as many samples as holders; every client ends
    with ``min_samples``. Random draws that miss a constraint are redrawn at most
    ``max_tries`` times, never without end.

    Reference:
        paper: Li, Diao, Chen & He, "Federated Learning on Non-IID Data Silos: An
            Experimental Study", ICDE 2022 (label-quantity skew ``#C=k``); McMahan et
            al., AISTATS 2017 (two shards of sorted labels per client, ``k≈2``).
        code: flwr-datasets ``PathologicalPartitioner`` (``class_assignment_mode``
            ``random``/``deterministic``, an even split among a class's holders).
        departures: NIID-Bench (Li et al.'s code) leaves samples of a class nobody drew
            unused; here such draws are redrawn so that the split covers the data.
            The ``dirichlet`` split among holders is fedloom's option (flwr-datasets
            splits evenly).
    """
    _check(labels, num_clients)
    cls = np.unique(labels)
    c_n = len(cls)
    _check_classes_options(num_clients, c_n, k, assign, split)
    alphas = _class_alphas(alpha, c_n, "classes")
    by_class = [np.flatnonzero(labels == c) for c in cls]
    if num_clients * min_samples > len(labels):
        raise PartitionError(
            f"classes: {num_clients} clients x min_samples {min_samples} exceeds the "
            f"{len(labels)} samples")
    why = ""
    for _ in range(max_tries if assign == "random" or split == "dirichlet" else 1):
        if assign == "round_robin":
            held = (np.arange(num_clients)[:, None] * k + np.arange(k)[None, :]) % c_n
        else:
            held = np.stack([rng.choice(c_n, size=k, replace=False)
                             for _ in range(num_clients)])
        holders = [np.flatnonzero((held == c).any(axis=1)) for c in range(c_n)]
        counts = np.array([len(h) for h in holders])
        if counts.min() == 0:
            why = f"class {cls[int(np.argmin(counts))].item()!r} has no holder"
            continue
        short = [c for c in range(c_n) if len(by_class[c]) < counts[c]]
        if short:
            c = short[0]
            why = (f"class {cls[c].item()!r} has {len(by_class[c])} samples for "
                   f"{counts[c]} holders")
            continue
        out = _split_among_holders(by_class, holders, num_clients, split, alphas, rng)
        small = min(range(num_clients), key=lambda j: len(out[j]))
        if len(out[small]) >= min_samples:
            return out
        why = f"client {small} has {len(out[small])} samples, fewer than min_samples " \
              f"{min_samples}"
    raise PartitionError(f"classes(k={k}, assign={assign}, split={split}): {why}"
                         + (f" in every one of {max_tries} draws" if assign == "random"
                            or split == "dirichlet" else "")
                         + "; raise num_clients·k, lower min_samples or change assign")


def _check_classes_options(num_clients: int, c_n: int, k: int, assign: str, split: str) -> None:
    """Refuse a ``classes`` setting that no draw can meet, naming the constraint."""
    if not 1 <= k <= c_n:
        raise PartitionError(f"classes: k must be between 1 and the {c_n} classes of the "
                             f"data, got {k}")
    if num_clients * k < c_n:
        raise PartitionError(f"classes: {num_clients} clients x k={k} classes = "
                             f"{num_clients * k} holders cannot cover the {c_n} classes")
    if assign not in ("random", "round_robin"):
        raise PartitionError(f"classes: assign must be 'random' or 'round_robin', "
                             f"got {assign!r}")
    if split not in ("even", "dirichlet"):
        raise PartitionError(f"classes: split must be 'even' or 'dirichlet', got {split!r}")


def _split_among_holders(
    by_class: list[np.ndarray], holders: list[np.ndarray], num_clients: int, split: str,
    alphas: np.ndarray, rng: np.random.Generator,
) -> list[np.ndarray]:
    """Share each class's shuffled samples among its holders; each client's sorted indices."""
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(len(by_class)):
        idx = rng.permutation(by_class[c])
        h = holders[c]
        if split == "even":
            chunks = np.array_split(idx, len(h))
        else:  # one sample each, the rest by Dirichlet proportions
            q = rng.dirichlet(np.full(len(h), alphas[c]))
            extra = _cut_sizes(q, len(idx) - len(h))
            cuts = np.cumsum(1 + extra)[:-1]
            chunks = np.split(idx, cuts)
        for j, chunk in zip(h, chunks, strict=True):
            parts[j].append(chunk)
    return [np.sort(np.concatenate(p)) for p in parts]


def _cut_sizes(p: np.ndarray, total: int) -> np.ndarray:
    """Integer sizes ``≈ p·total`` summing to ``total`` (largest remainders get the rest)."""
    raw = p / p.sum() * total
    base = np.floor(raw).astype(np.int64)
    rest = total - int(base.sum())
    if rest > 0:
        base[np.argsort(-(raw - base), kind="stable")[:rest]] += 1
    return base


# --------------------------------------------------------------- quantity skew
@register("partitioner", "sizes")
def sizes(
    labels: np.ndarray,
    num_clients: int,
    *,
    rng: np.random.Generator,
    distribution: Literal["powerlaw", "lognormal", "list"] = "powerlaw",
    exponent: Annotated[float, Range(gt=0)] = 1.5,
    sigma: Annotated[float, Range(ge=0)] = 1.0,
    counts: Annotated[Sequence[float], Range(ge=0)] = (),
    then: Literal["iid", "dirichlet"] = "iid",
    alpha: _Alpha = 0.5,
    min_samples: _Count = 10,
) -> list[np.ndarray]:
    """Quantity skew: client ``k`` gets ``n_k`` samples with ``n_k`` drawn, labels after.

    Sizes: weights ``w_k`` are drawn — ``powerlaw``: ``w_k ~ Pareto(a)``, the density
    ``a / w^{a+1}`` on ``w ≥ 1`` (``a = exponent``; smaller ``a``, heavier tail);
    ``lognormal``: ``w_k = exp(σ·z_k)``, ``z_k ~ N(0, 1)`` (``sigma``); ``list``: the
    given ``counts`` (one per client, relative sizes) — and
    ``n_k = min_samples + round(w_k / Σw · (n − N·min_samples))`` (largest remainders,
    so ``Σ n_k = n`` exactly and the split covers the data).
    Labels (``then``): ``iid`` cuts a random permutation at those sizes;
    ``dirichlet`` gives client ``k`` class proportions ``q_k ~ Dir(α·1_C)`` and fills its
    ``n_k`` slots class by class from what is left: ``m ~ Multinomial(need, q_k)``
    restricted to the classes with samples left, capped by them, repeated until full
    (flwr-datasets' ``InnerDirichletPartitioner``). Each pass takes at least one sample,
    so it ends.

    Reference:
        paper: Li et al., ICDE 2022 (quantity skew: sizes ~ Dir(β), labels IID);
            Li et al., "Federated Optimization in Heterogeneous Networks" (FedProx),
            MLSys 2020 (power-law and lognormal client sizes of its data).
        code: flwr-datasets ``InnerDirichletPartitioner`` (fixed sizes, per-client
            Dirichlet), ``SizePartitioner``/``LinearPartitioner`` (sizes given).
        departures: Li et al. draw the proportions from a Dirichlet; here a power law or
            a lognormal (the FedProx/LEAF shapes) or a list, plus a floor of
            ``min_samples``. flwr-datasets' inner Dirichlet draws sample by sample;
            here in multinomial batches (the same distribution of counts per pass).
    """
    _check(labels, num_clients)
    n = len(labels)
    if num_clients * min_samples > n:
        raise PartitionError(f"sizes: {num_clients} clients x min_samples {min_samples} = "
                             f"{num_clients * min_samples} exceeds the {n} samples")
    w = _size_weights(distribution, exponent, sigma, counts, num_clients, rng)
    if counts and distribution != "list":
        raise PartitionError(f"sizes: counts is used by distribution list only "
                             f"(distribution is {distribution})")
    n_k = min_samples + _cut_sizes(w, n - num_clients * min_samples)
    if then == "iid":
        perm = rng.permutation(n)
        return [np.sort(p) for p in np.split(perm, np.cumsum(n_k)[:-1])]
    if then != "dirichlet":
        raise PartitionError(f"sizes: then must be 'iid' or 'dirichlet', got {then!r}")
    cls = np.unique(labels)
    alphas = _class_alphas(alpha, len(cls), "sizes")
    return _fill_by_dirichlet(labels, cls, n_k, alphas, rng)


def _size_weights(
    distribution: str, exponent: float, sigma: float, counts: Sequence[float],
    num_clients: int, rng: np.random.Generator,
) -> np.ndarray:
    """The relative client sizes ``w_k`` of ``sizes``: drawn, or the given ``counts``."""
    if distribution == "powerlaw":
        if exponent <= 0:
            raise PartitionError(f"sizes: exponent must be > 0, got {exponent}")
        return rng.pareto(exponent, num_clients) + 1.0
    if distribution == "lognormal":
        if sigma < 0:
            raise PartitionError(f"sizes: sigma must be >= 0, got {sigma}")
        return np.exp(sigma * rng.standard_normal(num_clients))
    if distribution == "list":
        w = np.asarray(list(counts), dtype=np.float64)
        if w.shape != (num_clients,):
            raise PartitionError(f"sizes: counts needs one value per client "
                                 f"({num_clients}), got {len(w)}")
        if not (np.all(np.isfinite(w)) and np.all(w >= 0) and w.sum() > 0):
            raise PartitionError("sizes: counts must be >= 0 with a positive sum")
        return w
    raise PartitionError(f"sizes: distribution must be powerlaw, lognormal or list, "
                         f"got {distribution!r}")


def _fill_by_dirichlet(
    labels: np.ndarray, cls: np.ndarray, n_k: np.ndarray, alphas: np.ndarray,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """Fill client ``k``'s ``n_k`` slots class by class with proportions ``q_k ~ Dir(α)``."""
    pools = [list(rng.permutation(np.flatnonzero(labels == c))) for c in cls]
    left = np.array([len(p) for p in pools], dtype=np.int64)
    out = []
    for j in range(len(n_k)):
        q = rng.dirichlet(alphas)
        need = int(n_k[j])
        mine: list[int] = []
        while need > 0:
            avail = left > 0
            p = q * avail
            p = p / p.sum() if p.sum() > 0 else avail / avail.sum()
            m = np.minimum(rng.multinomial(need, p), left)
            for c in np.flatnonzero(m):
                take = int(m[c])
                mine.extend(pools[c][-take:])
                del pools[c][-take:]
            left -= m
            need -= int(m.sum())
        out.append(np.sort(np.asarray(mine, dtype=np.int64)))
    return out


# ------------------------------------------------------------------ mixed IID
@register("partitioner", "mixed")
def mixed(
    labels: np.ndarray,
    num_clients: int,
    *,
    rng: np.random.Generator,
    iid_fraction: Annotated[float, Range(ge=0, le=1)] = 0.5,
    then: str = "dirichlet",
    **then_options: object,
) -> list[np.ndarray]:
    """A fraction of the clients IID, the rest split by another partitioner.

    ``m = round(f·N)`` clients (the first ``m``) receive a uniformly random subset of
    ``round(m/N · n)`` samples cut into near-equal parts — a share of the data as
    large as their share of the clients, with the global label distribution in
    expectation; the other ``N − m`` clients split the remaining samples with
    ``then`` (a registered partitioner name) and the options given for it.

    Reference:
        paper: none; FL-bench's partial-IID splits (``--iid`` below 1).
        code: KarhouTam/FL-bench ``generate_data.py`` (a ratio of IID data, the rest
            by the non-IID method).
        departures: FL-bench mixes a fraction of the *data* into every client; here,
            as the heterogeneity issue asks, a fraction of the *clients* is IID and the
            others non-IID, so the population has two kinds of client.
    """
    _check(labels, num_clients)
    if not 0 <= iid_fraction <= 1:
        raise PartitionError(f"mixed: iid_fraction must be in [0, 1], got {iid_fraction}")
    if then == "mixed":
        raise PartitionError("mixed: then cannot be mixed itself")
    m = round(iid_fraction * num_clients)
    n = len(labels)
    perm = rng.permutation(n)
    n_iid = round(m / num_clients * n)
    # the non-IID clients need at least one sample each
    n_iid = min(n_iid, n - (num_clients - m))
    if m and n_iid < m:
        raise PartitionError(f"mixed: {m} IID clients need a sample each; only {n_iid} go to "
                             "them")
    iid_parts = [np.sort(p) for p in np.array_split(perm[:n_iid], m)] if m else []
    if m == num_clients:
        return iid_parts
    rest = perm[n_iid:]
    try:
        fn = get("partitioner", then)
    except KeyError as e:
        raise PartitionError(f"mixed: then: {e.args[0] if e.args else e}") from None
    sub = fn(labels[rest], num_clients - m, rng=rng, **accepted_options(fn, dict(then_options)))
    return iid_parts + [np.sort(rest[p]) for p in sub]
