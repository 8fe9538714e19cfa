"""Training augmentation, per batch, on the training device.

The standard augmentation of the papers' CIFAR code (He et al. 2016; the CRAFT,
SA-PEF and FLARE repositories all use torchvision's ``RandomCrop(32,
padding=4)`` then ``RandomHorizontalFlip()``): each image is zero-padded by 4
pixels on every side, a window of the original size is cut at a uniformly
drawn offset (0…8 in each direction), and the result is mirrored left-right
with probability ½. Tiny-ImageNet gets the same at 64 × 64 (the SA-PEF code's
choice). FEMNIST, MNIST and the others get none.

Departure, stated: torchvision pads the raw image with black pixels before it
is normalised; fedloom's images are normalised once when loaded, so the pad
value here is the normalised value of black, ``(0 − μ_c)/σ_c`` per channel —
the same numbers reach the model.

Randomness: every draw comes from the generator the caller passes, which the
trainer derives from ``(seed, round, client, "augment")`` and advances step by
step, so reruns and resumes see the same crops and flips.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Augment", "make_augment"]

# Per-channel training-set statistics of the sources that have a standard augmentation
# (the same values fedloom.data.disk normalises with).
_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "tiny-imagenet": ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)),
}


@dataclass(frozen=True)
class Augment:
    """Random crop with ``padding`` and a horizontal flip with probability ``flip``.

    ``fill`` is the per-channel pad value (the normalised value of a black pixel).
    """

    padding: int = 4
    flip: float = 0.5
    fill: tuple[float, ...] = (0.0,)

    def __call__(self, x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Augment a batch ``[b, c, h, w]``; draws ``2b`` offsets then ``b`` flips from ``gen``."""
        b, c, h, w = x.shape
        p = self.padding
        # Draws on the CPU generator (same numbers on every device), then moved.
        off = torch.randint(0, 2 * p + 1, (2, b), generator=gen)
        flips = torch.rand(b, generator=gen) < self.flip
        fill = torch.tensor(self.fill if len(self.fill) == c else self.fill[:1] * c,
                            dtype=x.dtype, device=x.device).view(1, c, 1, 1)
        padded = fill.expand(b, c, h + 2 * p, w + 2 * p).clone()
        padded[:, :, p:p + h, p:p + w] = x
        dev = x.device
        rows = off[0].to(dev)[:, None] + torch.arange(h, device=dev)[None, :]      # [b, h]
        cols = off[1].to(dev)[:, None] + torch.arange(w, device=dev)[None, :]      # [b, w]
        cols = torch.where(flips.to(dev)[:, None], cols.flip(1), cols)             # mirror
        bi = torch.arange(b, device=dev)[:, None, None]
        out = padded.permute(0, 2, 3, 1)[bi, rows[:, :, None], cols[:, None, :]]  # [b,h,w,c]
        return out.permute(0, 3, 1, 2).contiguous()


def make_augment(source: str, mode: str) -> Augment | None:
    """The augmentation for a dataset's ``augment`` tag under ``data.augment``.

    ``auto``: the source's standard augmentation, or none; ``standard``: the same,
    but a source without one is refused (one line); ``none``: none.
    """
    if mode == "none":
        return None
    if source not in _STATS:
        if mode == "standard":
            raise ValueError(f"data.augment: the source has no standard augmentation "
                             f"({'tag ' + repr(source) if source else 'none defined'}); "
                             "use none or auto")
        return None
    mean, std = _STATS[source]
    return Augment(padding=4, flip=0.5, fill=tuple(-m / s for m, s in zip(mean, std, strict=True)))
