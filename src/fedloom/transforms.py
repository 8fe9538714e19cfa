"""One transform protocol for the client's local step and the server's step.

In optax's shape: a transform holds its settings; ``init(w)`` gives its state
and ``update(d, state, ctx)`` returns the new direction and the new state.
:func:`chain` composes transforms: its state is the tuple of theirs, one entry a
transform in order, so two transforms of a kind keep their states apart and
nothing in a chain depends on which transforms it holds. The two sides differ
only in what ``ctx`` is:

- the local step (:mod:`fedloom.client.transforms`): a
  :class:`~fedloom.client.transforms.StepContext` (the step, the parameters
  ``W``, the anchor ``W0``, which rows still step), ``d`` of shape ``[d]`` or
  ``[m, d]`` with one row a client; a transform may update ``d`` and its state
  in place;
- the server step (:mod:`fedloom.server_opt.transforms`): the parameters ``w``
  themselves (optax's ``params``); a transform never modifies ``d`` or its state
  in place (the engine keeps the old state when a step is not finite, and reads
  the aggregate after the step). :meth:`Chain.step` is the server optimizer's
  ``w ← w − chain(agg)``.

A stateless transform's state is ``None``. :class:`Scale` reads no context and
serves both sides. :func:`probe_transform` runs a plug-in's transform once on a
synthetic direction before round 1 (the checks at the door, with :func:`returned`,
:func:`check_vector` and :func:`called` that the aggregator's check shares).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, is_dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

import torch

__all__ = ["Chain", "Scale", "Transform", "called", "chain", "check_mapping", "check_rows",
           "check_vector", "from_fedloom", "is_transform", "probe_transform", "returned", "scale",
           "shown", "what"]

Ctx = TypeVar("Ctx", contravariant=True)
C = TypeVar("C")


class Transform(Protocol[Ctx]):
    """A term of a step: ``init(w)`` → its state; ``update(d, state, ctx)`` →
    the new direction and the new state."""

    def init(self, w: torch.Tensor) -> Any: ...

    def update(self, d: torch.Tensor, state: Any, ctx: Ctx) -> tuple[torch.Tensor, Any]: ...


@dataclass(frozen=True)
class Chain(Generic[C]):
    """The transforms in order; its state is the tuple of theirs."""

    transforms: tuple[Transform[C], ...]

    def init(self, w: torch.Tensor) -> tuple[Any, ...]:
        return tuple(t.init(w) for t in self.transforms)

    def update(self, d: torch.Tensor, state: tuple[Any, ...], ctx: C
               ) -> tuple[torch.Tensor, tuple[Any, ...]]:
        new = []
        for t, s in zip(self.transforms, state, strict=True):
            d, s = t.update(d, s, ctx)
            new.append(s)
        return d, tuple(new)

    def step(self: Chain[torch.Tensor], w: torch.Tensor, agg: torch.Tensor,
             state: tuple[Any, ...]) -> tuple[torch.Tensor, tuple[Any, ...]]:
        """``w − chain(agg)`` and the new state, the parameters ``w`` the context
        (a chain of server transforms as a server optimizer: ``init``, ``step``)."""
        d, new = self.update(agg, state, w)
        return w - d, new


def chain(*transforms: Transform[C]) -> Chain[C]:
    """The transforms applied one after the other (an empty chain is the identity)."""
    return Chain(tuple(transforms))


@dataclass(frozen=True)
class Scale:
    """``d ← factor·d`` (a step size: the last term of a server optimizer)."""

    factor: float

    def init(self, w: torch.Tensor) -> None:
        return None

    def update(self, d: torch.Tensor, state: None, ctx: object) -> tuple[torch.Tensor, None]:
        return self.factor * d, None


def scale(factor: float) -> Scale:
    """``d ← factor·d`` (:class:`Scale`)."""
    return Scale(factor)


# ------------------------------------------------------- the checks at the door
# A plug-in runs once, before round 1, on a synthetic input of the run's shapes;
# each violation is one ValueError line (the binding makes it a ConfigError) naming
# the config field, the class and method, the protocol and what came back. Without
# these, a wrong arity or shape only showed as a skipped step every round (the
# engine's guard for ill-posed cohorts) or as a traceback deep in a round.

_TRANSFORM = ("the Transform protocol is init(w) -> state and "
              "update(d, state, ctx) -> (direction, state)")


def from_fedloom(obj: object) -> bool:
    """Whether ``obj``'s class is fedloom's own (tested by fedloom's suites: not probed)."""
    return type(obj).__module__.partition(".")[0] == "fedloom"


def is_transform(obj: object) -> bool:
    """Whether ``obj`` has a transform's ``init`` and ``update``."""
    return callable(getattr(obj, "init", None)) and callable(getattr(obj, "update", None))


def shown(obj: object) -> str:
    """``obj`` as a user would write it: a dataclass's repr, else ``Class(...)``."""
    return repr(obj) if is_dataclass(obj) else f"{type(obj).__name__}(...)"


def what(x: object) -> str:
    """What came back, in a few words."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    if isinstance(x, tuple):
        return f"{len(x)} value{'s' if len(x) != 1 else ''}"
    return "None" if x is None else f"a {type(x).__name__}"


def called(who: str, on: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)``; what it raises becomes one line naming ``who`` and ``on``
    (what it was given)."""
    try:
        return fn(*args, **kw)
    except Exception as e:  # the plug-in's own code: any error is its violation
        text = str(e).strip()
        msg = f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
        raise ValueError(f"{who} raised {msg} on {on}") from None


def returned(who: str, out: object, protocol: str, names: Sequence[str]) -> tuple[Any, ...]:
    """``out`` when it is a tuple of ``len(names)`` values, else one line."""
    if not isinstance(out, tuple) or len(out) != len(names):
        raise ValueError(f"{who} returned {what(out)}, the {protocol} protocol returns "
                         f"{len(names)} ({', '.join(names)})")
    return out


def check_vector(who: str, x: object, shape: tuple[int, ...], name: str = "direction"
                 ) -> torch.Tensor:
    """``x`` when it is a finite tensor of ``shape``, else one line."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{who} returned {what(x)} as its {name}, expected a tensor of "
                         f"shape {shape}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{who} returned a {name} of shape {tuple(x.shape)}, expected {shape}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{who} returned a {name} that is not finite for a finite input")
    return x


def check_mapping(who: str, x: object, name: str) -> Mapping[str, Any]:
    """``x`` when it is a mapping (a returned state or metrics), else one line."""
    if not isinstance(x, Mapping):
        raise ValueError(f"{who} returned {what(x)} as {name}, expected a dict")
    return x


def check_rows(who: str, state: object, sizes: Mapping[str, int]) -> dict[str, torch.Tensor]:
    """A plug-in's new state rows: one for each field it declared (name → size; the
    engine stacks the accepted clients'), each a finite vector of its size."""
    got = check_mapping(who, state, "its state rows")
    lost = [n for n in sizes if n not in got]
    if lost:
        raise ValueError(f"{who} returned state rows without "
                         f"{', '.join(map(repr, lost))}, a field its fields() declared")
    return {n: check_vector(who, got[n], (k,), f"state[{n!r}]") for n, k in sizes.items()}


def probe_transform(t: object, where: str, d: torch.Tensor, ctxs: tuple[Any, Any],
                    kind: str) -> None:
    """``t`` (config field ``where``) as a transform of ``kind`` (``local-step``,
    ``server``): ``init(w)``, then ``update`` on ``d`` with the first context and
    again, on the state it returned (the state round-trip), with the second;
    ``ctxs``' contexts hold the parameters the step is at."""
    cls = type(t).__name__
    if not is_transform(t):
        missing = " and ".join(m for m in ("init", "update")
                               if not callable(getattr(t, m, None)))
        raise ValueError(f"{where}: {cls} has no {missing}; {_TRANSFORM} "
                         f"(a {kind} transform, fedloom.transforms.Transform)")
    if from_fedloom(t):
        return
    tr = cast(Transform[Any], t)
    w = ctxs[0] if isinstance(ctxs[0], torch.Tensor) else ctxs[0].W
    state = called(f"{where}: {cls}.init", f"parameters of shape {tuple(w.shape)}",
                   tr.init, w.clone())
    on = f"a synthetic direction of shape {tuple(d.shape)}"
    for i, ctx in enumerate(ctxs):
        out = called(f"{where}: {cls}.update",
                     on if i == 0 else "the state its first call returned (state round-trip)",
                     tr.update, d.clone(), state, ctx)
        new_d, state = returned(f"{where}: {cls}.update", out, "Transform",
                                ("direction", "state"))
        check_vector(f"{where}: {cls}.update", new_d, tuple(d.shape))
