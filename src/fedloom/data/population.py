"""Populations: clients whose data is generated on demand from ``(seed, user)``.

A population of ``N`` users costs what its cohort costs: nothing of a user exists
until the user is sampled, and then only for the round. User ``k``'s samples come
from its own generator ``(seed, -1, k, "population")`` and its sample count from the
block of 4,096 users it belongs to (``(seed, -1, k // 4096, "population-size")``), so
a user's data is the same whatever ``N``, whichever users were drawn before it and
in any process. The global test set is the data of ``test_users`` held-out users of
the same distribution (their own stream ``"population-test"``); per-client test
splits are not kept (each user's samples are all training samples).

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
  ``powerlaw`` (Pareto: ``⌊min_size·(1 + Pareto(size_exponent))⌋``), clipped to
  ``[min_size, max_size]``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal, overload

import numpy as np
import torch

from fedloom.config import ConfigError, DataConfig
from fedloom.data.sources import Dataset, _source
from fedloom.registry import Range
from fedloom.rng import Purpose, numpy_gen

__all__ = ["BLOCK", "ClientParts", "ImagePopulation", "LeafSynthetic", "Population"]

BLOCK = 4096  # users per block of sample counts
_CACHE_BLOCKS = 64  # size blocks kept (2 MB)


class Population:
    """``num_clients`` users, each generated on demand (see the module docstring).

    Subclasses define :meth:`_draw_sizes` (a block's sample counts from its
    generator) and :meth:`_draw_user` (a user's samples from its generator)."""

    name = ""

    def __init__(self, num_clients: int, seed: int, num_classes: int,
                 input_shape: tuple[int, ...], test_users: int) -> None:
        self.num_clients, self.seed = num_clients, seed
        self.num_classes, self.input_shape = num_classes, input_shape
        self.test_users = test_users
        self._blocks: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()

    # ----------------------------------------------------------------- subclass
    def _draw_sizes(self, gen: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError

    def _draw_user(self, gen: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        """What the population is (the data's fingerprint holds it)."""
        return {"name": self.name, "num_clients": self.num_clients,
                "test_users": self.test_users}

    # --------------------------------------------------------------------- sizes
    def _block(self, purpose: str, b: int) -> np.ndarray:
        key = (purpose, b)
        got = self._blocks.get(key)
        if got is None:
            got = self._draw_sizes(numpy_gen(self.seed, -1, b, purpose), BLOCK)
            got = np.asarray(got, dtype=np.int64)
            self._blocks[key] = got
            if len(self._blocks) > _CACHE_BLOCKS:
                self._blocks.popitem(last=False)
        else:
            self._blocks.move_to_end(key)
        return got

    def size(self, k: int) -> int:
        """User ``k``'s sample count."""
        self._check(k)
        return int(self._block(Purpose.POPULATION_SIZE, k // BLOCK)[k % BLOCK])

    def sizes(self) -> np.ndarray:
        """Every user's sample count, in id order (``8·N`` bytes: for checks made once)."""
        nb = (self.num_clients + BLOCK - 1) // BLOCK
        out = np.concatenate([self._draw_sizes(
            numpy_gen(self.seed, -1, b, Purpose.POPULATION_SIZE), BLOCK) for b in range(nb)])
        return np.asarray(out[: self.num_clients], dtype=np.int64)

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
            n = int(self._block(Purpose.POPULATION_TEST_SIZE, j // BLOCK)[j % BLOCK])
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

    def _draw_sizes(self, gen: np.random.Generator, n: int) -> np.ndarray:
        sizes = gen.lognormal(4, 2, n).astype(np.int64) + 50
        return np.minimum(sizes, self.max_size) if self.max_size else sizes

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

    def _draw_sizes(self, gen: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "lognormal":
            raw = np.floor(gen.lognormal(self.mu, self.sigma, n))
        else:
            raw = np.floor(self.min_size * (1.0 + gen.pareto(self.exponent, n)))
        return np.clip(raw, self.min_size, self.max_size).astype(np.int64)

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
