"""Data-poisoning attacks: label flipping and a pixel-pattern backdoor.

The attackers' training samples are changed once, in the run's data, before any
backend gets it (:meth:`fedloom.attack.base.Attack.poison`), so the local training of
every backend (sequential, vmap, lock-step, process and Ray workers, which are sent
the data once) trains the attackers on their poisoned samples; the samples must be
theirs alone (a partition that shares a sample with an honest client is refused).
Both see their own update only.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from fedloom.attack.base import RoundView, number
from fedloom.attack.simple import check_scale, replacement_scale
from fedloom.registry import register
from fedloom.rng import numpy_gen

__all__ = ["Backdoor", "LabelFlip", "stamp"]

POISON = "attack-poison"  # the purpose of the stream that picks the backdoored samples


def _classes(y: torch.Tensor, name: str) -> None:
    if y.ndim != 1 or y.is_floating_point():
        raise ValueError(f"attack.name: {name} needs one class label per sample "
                         f"(labels of shape {tuple(y.shape)}, {y.dtype})")


class LabelFlip:
    """The attackers train on ``y ↦ C − 1 − y`` (``C`` the data's classes) and send the
    update that makes, unchanged.

    Reference:
        paper: Tolpegin et al., "Data Poisoning Attacks Against Federated Learning
            Systems", ESORICS 2020; ByzFL's ``LabelFlipping`` (the same map, C − 1 − y).
        code: ByzFL 0.0.11 flips the labels in its client (``byzfl.fed_framework``,
            ``-(y − (C − 1))``): the same map (tests/test_attack_stage.py checks it on
            every attacker's label of digits).
        departures: ByzFL's Byzantine vector is the mean of the honest clients' flipped
            gradients (an omniscient attacker); here each attacker trains on its own
            flipped samples, as in Tolpegin et al.
    """

    sees = "own"

    def poison(self, x: torch.Tensor, y: torch.Tensor, parts: Mapping[int, np.ndarray],
               num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        _classes(y, "label_flip")
        y = y.clone()
        for idx in parts.values():
            t = torch.from_numpy(np.asarray(idx, dtype=np.int64)).to(y.device)
            y[t] = num_classes - 1 - y[t]
        return x, y

    def test_sets(self, x: torch.Tensor, y: torch.Tensor
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {}

    def __call__(self, view: RoundView) -> torch.Tensor:
        return view.own.clone()


register("attack", "label_flip")(LabelFlip)


def stamp(x: torch.Tensor, size: int, high: float, low: float) -> torch.Tensor:
    """``x`` with the trigger: a ``size × size`` checkerboard (``high`` where ``i + j`` is
    even, ``low`` elsewhere) in the top-left corner of each image (the last two axes,
    every channel), or in the first ``size²`` features of a flat sample."""
    out = x.clone()
    ii, jj = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    board = torch.from_numpy((ii + jj) % 2 == 0).to(x.device)
    pattern = torch.where(board, torch.tensor(high, dtype=x.dtype, device=x.device),
                          torch.tensor(low, dtype=x.dtype, device=x.device))
    if x.ndim >= 3:
        out[..., :size, :size] = pattern
    else:
        out[:, : size * size] = pattern.reshape(-1)
    return out


class Backdoor:
    """Pixel-pattern backdoor with model replacement: a fraction ``fraction`` of each
    attacker's training samples, drawn once from ``(seed, client, "attack-poison")``,
    carry the trigger (:func:`stamp`, ``size``, ``high``/``low``: the data's maximum and
    minimum when left out) and the label ``target``; the update its training makes is
    sent scaled by ``scale`` (``replace``: ``m / (b η)``, η = ``server_lr``). Its test
    set ``attack_success_rate``: the triggered test samples whose class is not
    ``target``, labelled ``target`` (the accuracy on it is the attack success rate).

    Reference:
        paper: Bagdasaryan et al., "How To Backdoor Federated Learning", AISTATS 2020
            (pixel-pattern backdoor, §4; model replacement γ = n/η, §3.2).
        code: ebagdasa/backdoor_federated_learning (utils/params.yaml read: its default
            backdoor is semantic, ``poisoning_per_batch`` samples of each batch relabelled,
            updates scaled by ``scale_weights``); the pixel-pattern triggers of public
            follow-ups set listed pixels to the maximum in every channel. Checked by hand:
            the trigger's pixels and the labels (tests/test_attack_view.py).
        departures: a fixed poisoned subset per attacker, not per batch; the trigger is
            a checkerboard corner of the maximum and minimum, not a pixel list; no
            anomaly-evasion loss.
    """

    sees = "own"

    def __init__(self, target: int = 0, fraction: float = 0.5, size: int = 3,
                 high: float | None = None, low: float | None = None,
                 scale: float | str = "replace", server_lr: float = 1.0) -> None:
        if isinstance(target, bool) or not isinstance(target, int) or target < 0:
            raise ValueError(f"attack.options.target: must be a class ≥ 0, got {target!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"attack.options.size: must be an integer ≥ 1, got {size!r}")
        self.target, self.size = target, size
        self.fraction = number("fraction", fraction, low=0, strict=True, high=1)
        self.high = None if high is None else number("high", high)
        self.low = None if low is None else number("low", low)
        self.scale = check_scale(scale)
        self.server_lr = number("server_lr", server_lr, low=0, strict=True)
        self._range: tuple[float, float] = (1.0, 0.0)

    def _trigger(self, x: torch.Tensor) -> torch.Tensor:
        return stamp(x, self.size, *self._range)

    def poison(self, x: torch.Tensor, y: torch.Tensor, parts: Mapping[int, np.ndarray],
               num_classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        _classes(y, "backdoor")
        if not self.target < num_classes:
            raise ValueError(f"attack.options.target: must be a class below {num_classes}, "
                             f"got {self.target}")
        if not x.is_floating_point():
            raise ValueError("attack.name: backdoor needs real-valued inputs (images, "
                             "features)")
        if (x.ndim >= 3 and min(x.shape[-2:]) < self.size) or (
                x.ndim == 2 and x.shape[1] < self.size ** 2):
            raise ValueError(f"attack.options.size: the trigger ({self.size}×{self.size}) "
                             f"does not fit samples of shape {tuple(x.shape[1:])}")
        self._range = (float(x.max()) if self.high is None else self.high,
                       float(x.min()) if self.low is None else self.low)
        x, y = x.clone(), y.clone()
        for k, idx in parts.items():
            idx = np.asarray(idx, dtype=np.int64)
            n = round(self.fraction * len(idx))
            pick = numpy_gen(seed, -1, k, POISON).choice(idx, n, replace=False) if n else idx[:0]
            t = torch.from_numpy(np.sort(pick)).to(x.device)
            x[t] = self._trigger(x[t])
            y[t] = self.target
        return x, y

    def test_sets(self, x: torch.Tensor, y: torch.Tensor
                  ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        keep = y != self.target
        xs = self._trigger(x[keep])
        return {"attack_success_rate": (xs, torch.full_like(y[keep], self.target))}

    def __call__(self, view: RoundView) -> torch.Tensor:
        return view.own * replacement_scale(self.scale, self.server_lr, view)


register("attack", "backdoor")(Backdoor)
