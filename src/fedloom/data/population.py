"""Populations: clients whose data is generated on demand from ``(seed, user)``.

A population of ``N`` users costs what its cohort costs: nothing of a user exists
until the user is sampled, and then only for the round. User ``k``'s samples come
from its own generator ``(seed, -1, k, "population")`` and its sample count from one
uniform ``u = derive_seed(seed, -1, k, "population-size")/2⁶³`` through the inverse
of the size law's CDF (no generator: a few µs), so a user's data is the same
whatever ``N``, whichever users were drawn before it and in any process. The global
test set is the data of ``test_users`` held-out users of the same distribution (their
own streams ``"population-test"``); users keep no test split of their own.

- ``synthetic-population``: LEAF's Synthetic(α, β) (Caldas et al., "LEAF", 2018;
  Li et al., FedProx, MLSys 2020, §5.1), per user as :func:`fedloom.data.sources.synthetic`
  draws it (``α``, ``β`` as standard deviations, as the public generator passes them;
  ``n_k = ⌊lognormal(4, 2)⌋ + 50``). Departure from ``synthetic``: each user has its
  own generator (the eager source draws all users from one stream), so the numbers
  differ from ``synthetic``'s for the same seed; ``max_size`` (0 = none) caps
  ``n_k``, which LEAF does not (its lognormal(4, 2) tail reaches 10⁶ samples among 10⁶
  users).
- ``image-population``: images of ``classes`` smooth class prototypes, each user with
  its own label mix (Dirichlet(``label_alpha``)), contrast and brightness, and a
  heterogeneous size: ``lognormal`` (``⌊exp(N(size_mu, size_sigma))⌋``) or
  ``powerlaw`` (Pareto: ``⌊min_size·(1 + Lomax(size_exponent))⌋``), clipped to
  ``[min_size, max_size]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from statistics import NormalDist
from typing import Annotated, Any, Literal, overload

import numpy as np
import torch

from fedloom.config import ConfigError, DataConfig
from fedloom.data.sources import Dataset, _source
from fedloom.registry import Range
from fedloom.rng import Purpose, derive_seed, numpy_gen

__all__ = ["ClientParts", "ImagePopulation", "LeafSynthetic", "Population"]

_NORMAL = NormalDist()


class Population:
    """``num_clients`` users, each generated on demand (see the module docstring).

    Subclasses define :meth:`_size_at` (a sample count from a uniform ``u`` in
    (0, 1): the size law's inverse CDF) and :meth:`_draw_user` (a user's samples
    from its generator)."""

    name = ""

    def __init__(self, num_clients: int, seed: int, num_classes: int,
                 input_shape: tuple[int, ...], test_users: int) -> None:
        self.num_clients, self.seed = num_clients, seed
        self.num_classes, self.input_shape = num_classes, input_shape
        self.test_users = test_users

    # ----------------------------------------------------------------- subclass
    def _size_at(self, u: float) -> int:
        raise NotImplementedError

    def _draw_user(self, gen: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What the population is (the data's fingerprint holds it)."""
        return {"name": self.name, "num_clients": self.num_clients,
                "test_users": self.test_users}

    # --------------------------------------------------------------------- sizes
    def _size(self, k: int, purpose: str) -> int:
        # the 63-bit derived seed as a uniform strictly inside (0, 1)
        return self._size_at((derive_seed(self.seed, -1, k, purpose) + 0.5) / float(1 << 63))

    def size(self, k: int) -> int:
        """User ``k``'s sample count."""
        self._check(k)
        return self._size(k, Purpose.POPULATION_SIZE)

    def sizes(self) -> Sequence[int]:
        """Every user's sample count, in id order, each made when read (iterating over
        them all is O(N): for a check that needs them, a BatchNorm model's)."""
        return _Sizes(self)

    def _check(self, k: int) -> None:
        if not 0 <= k < self.num_clients:
            raise IndexError(f"population: user {k} is not in [0, {self.num_clients})")

    # ---------------------------------------------------------------------- data
    def client(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """User ``k``'s samples ``(x float32, y int64)``, from ``(seed, -1, k, "population")``."""
        n = self.size(k)
        return self._draw_user(numpy_gen(self.seed, -1, k, Purpose.POPULATION), n)

    def held_out(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The ``test_users`` held-out users' samples, concatenated, and each one's
        class counts ``[test_users, C]``."""
        xs, ys, counts = [], [], []
        for j in range(self.test_users):
            n = self._size(j, Purpose.POPULATION_TEST_SIZE)
            x, y = self._draw_user(numpy_gen(self.seed, -1, j, Purpose.POPULATION_TEST), n)
            xs.append(x)
            ys.append(y)
            counts.append(np.bincount(y, minlength=self.num_classes))
        return np.concatenate(xs), np.concatenate(ys), np.stack(counts)

    def dataset(self) -> Dataset:
        """The source's :class:`Dataset`: the held-out users' samples serve as the
        samples the model is checked on and as the global test set."""
        x, y, counts = self.held_out()
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        ds = Dataset(self.name, xt, yt, self.num_classes, x_test=xt, y_test=yt, natural=True)
        ds.population = self
        self.sample_counts = counts
        return ds


class ClientParts(Sequence[np.ndarray]):
    """``parts[k]`` = ``arange(sizes(k))``: user ``k``'s sample positions within its own
    generated samples, made when asked for (no ``N`` arrays)."""

    def __init__(self, num_clients: int, size: Any) -> None:
        self._n, self._size = num_clients, size

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, k: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[np.ndarray]: ...

    def __getitem__(self, k: int | slice) -> np.ndarray | Sequence[np.ndarray]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self._n))]
        k = int(k)
        if k < 0:
            k += self._n
        if not 0 <= k < self._n:
            raise IndexError(f"population: user {k} is not in [0, {self._n})")
        return np.arange(self._size(k), dtype=np.int64)

    def __iter__(self) -> Iterator[np.ndarray]:
        for k in range(self._n):
            yield self[k]


class _Sizes(Sequence[int]):
    """``sizes[k]``: user ``k``'s sample count, made when read."""

    def __init__(self, pop: Population) -> None:
        self._pop = pop

    def __len__(self) -> int:
        return self._pop.num_clients

    @overload
    def __getitem__(self, k: int) -> int: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[int]: ...

    def __getitem__(self, k: int | slice) -> int | Sequence[int]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        return self._pop.size(int(k) + (len(self) if k < 0 else 0))


# ----------------------------------------------------------------- Synthetic(α, β)
class LeafSynthetic(Population):
    """Synthetic(α, β) per user (the module docstring)."""

    name = "synthetic-population"

    def __init__(self, num_clients: int, seed: int, *, alpha: float, beta: float, dim: int,
                 classes: int, max_size: int, test_users: int) -> None:
        super().__init__(num_clients, seed, classes, (dim,), test_users)
        self.alpha, self.beta, self.dim, self.max_size = alpha, beta, dim, max_size
        self._std = np.sqrt(np.arange(1, dim + 1, dtype=np.float64) ** -1.2)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "alpha": self.alpha, "beta": self.beta, "dim": self.dim,
                "classes": self.num_classes, "max_size": self.max_size}

    def _size_at(self, u: float) -> int:
        # ⌊lognormal(4, 2)⌋ + 50 by its inverse CDF (exp of N(4, 2²)'s quantile)
        n = int(math.exp(min(4.0 + 2.0 * _NORMAL.inv_cdf(u), 700.0))) + 50
        return min(n, self.max_size) if self.max_size else n

    def _draw_user(self, gen: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        c, d = self.num_classes, self.dim
        u = gen.normal(0, self.alpha)
        b_shift = gen.normal(0, self.beta)
        w = gen.normal(u, 1, (c, d))
        b = gen.normal(u, 1, c)
        v = gen.normal(b_shift, 1, d)
        x = v + gen.standard_normal((n, d)) * self._std
        y = np.argmax(x @ w.T + b, axis=1)
        return x.astype(np.float32), y.astype(np.int64)


# ------------------------------------------------------------------ image population
class ImagePopulation(Population):
    """Images of heterogeneous-size users (the module docstring)."""

    name = "image-population"

    def __init__(self, num_clients: int, seed: int, *, image_size: int, channels: int,
                 classes: int, sizes: str, size_mu: float, size_sigma: float,
                 size_exponent: float, min_size: int, max_size: int, label_alpha: float,
                 noise: float, test_users: int) -> None:
        super().__init__(num_clients, seed, classes, (channels, image_size, image_size),
                         test_users)
        self.kind, self.mu, self.sigma, self.exponent = sizes, size_mu, size_sigma, size_exponent
        self.min_size, self.max_size = min_size, max_size
        self.label_alpha, self.noise = label_alpha, noise
        # smooth prototypes: a coarse grid (a quarter of the side) of N(0, 1),
        # each cell repeated over its block of pixels
        gen = numpy_gen(seed, -1, -1, Purpose.POPULATION)
        coarse = max(1, image_size // 4)
        proto = gen.standard_normal((classes, channels, coarse, coarse))
        rep = -(-image_size // coarse)
        proto = np.repeat(np.repeat(proto, rep, axis=2), rep, axis=3)
        self._proto = proto[:, :, :image_size, :image_size]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "shape": list(self.input_shape),
                "classes": self.num_classes, "sizes": self.kind, "size_mu": self.mu,
                "size_sigma": self.sigma, "size_exponent": self.exponent,
                "min_size": self.min_size, "max_size": self.max_size,
                "label_alpha": self.label_alpha, "noise": self.noise}

    def _size_at(self, u: float) -> int:
        if self.kind == "lognormal":
            z = self.mu + self.sigma * _NORMAL.inv_cdf(u)
        else:  # Pareto (Lomax) of shape a: 1 + X has the quantile (1 − u)^(−1/a)
            z = math.log(self.min_size) - math.log1p(-u) / self.exponent
        return int(min(max(math.floor(math.exp(min(z, 700.0))), self.min_size), self.max_size))

    def _draw_user(self, gen: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        mix = gen.dirichlet(np.full(self.num_classes, self.label_alpha))
        contrast = gen.lognormal(0.0, 0.2)
        brightness = gen.normal(0.0, 0.3)
        y = gen.choice(self.num_classes, n, p=mix)
        x = contrast * self._proto[y] + brightness
        x = x + self.noise * gen.standard_normal(x.shape)
        return x.astype(np.float32), y.astype(np.int64)


# ------------------------------------------------------------------------- sources
def _refuse_pool(data: DataConfig) -> None:
    if data.max_samples:
        raise ConfigError("data.max_samples: a population has no pool of samples to cut; "
                          "set data.num_clients instead")
    if data.pool != "train":
        raise ConfigError("data.pool: a population's test set is its held-out users; "
                          "leave pool at train")


@_source("synthetic-population", "Synthetic(alpha, beta) of LEAF, each user generated on "
         "demand from (seed, user): populations of millions", lambda: True, "(built in)")
def synthetic_population(
        data: DataConfig, seed: int, *, alpha: Annotated[float, Range(ge=0)] = 1.0,
        beta: Annotated[float, Range(ge=0)] = 1.0, dim: Annotated[int, Range(ge=1)] = 60,
        classes: Annotated[int, Range(ge=2)] = 10, max_size: Annotated[int, Range(ge=0)] = 0,
        test_users: Annotated[int, Range(ge=1)] = 100) -> Dataset:
    """LEAF's Synthetic(α, β) over ``data.num_clients`` users generated on demand
    (:mod:`fedloom.data.population`); ``max_size`` caps a user's samples (0: no cap)."""
    _refuse_pool(data)
    return LeafSynthetic(data.num_clients, seed, alpha=alpha, beta=beta, dim=dim,
                         classes=classes, max_size=max_size, test_users=test_users).dataset()


@_source("image-population", "Images of users of heterogeneous sizes (lognormal or power "
         "law), each generated on demand from (seed, user)", lambda: True, "(built in)")
def image_population(
        data: DataConfig, seed: int, *, image_size: Annotated[int, Range(ge=1)] = 16,
        channels: Annotated[int, Range(ge=1)] = 1, classes: Annotated[int, Range(ge=2)] = 10,
        sizes: Literal["lognormal", "powerlaw"] = "lognormal",
        size_mu: float = 3.5, size_sigma: Annotated[float, Range(ge=0)] = 1.0,
        size_exponent: Annotated[float, Range(gt=0)] = 1.5,
        min_size: Annotated[int, Range(ge=1)] = 5, max_size: Annotated[int, Range(ge=1)] = 2000,
        label_alpha: Annotated[float, Range(gt=0)] = 0.5,
        noise: Annotated[float, Range(ge=0)] = 1.0,
        test_users: Annotated[int, Range(ge=1)] = 100) -> Dataset:
    """Images of ``data.num_clients`` users of heterogeneous sizes generated on demand
    (:mod:`fedloom.data.population`)."""
    _refuse_pool(data)
    if max_size < min_size:
        raise ConfigError(f"data.options.max_size: {max_size} is below min_size {min_size}")
    return ImagePopulation(data.num_clients, seed, image_size=image_size, channels=channels,
                           classes=classes, sizes=sizes, size_mu=size_mu, size_sigma=size_sigma,
                           size_exponent=size_exponent, min_size=min_size, max_size=max_size,
                           label_alpha=label_alpha, noise=noise,
                           test_users=test_users).dataset()
