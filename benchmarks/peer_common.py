"""What every framework's driver of the peers section shares (torch and numpy only).

Each framework runs in its own interpreter (a peer's own virtualenv), so this
file imports nothing of fedloom. :mod:`peers` writes a *spec* folder:

- ``x.npy`` (float32 ``[clients·n, …]``) and ``y.npy`` (int64): client ``k``
  owns rows ``k·n … (k+1)·n − 1``;
- ``spec.pt``: the model (``mlp`` 784-200-10 or ``pfl_cnn``), the training
  settings, fedloom's initial parameters (a list in the model's
  ``parameters()`` order), the cohort of every round (fedloom's
  ``sample_cohort``) and every cohort client's sample order in that round
  (fedloom's batch-order permutation), so every framework trains the same
  clients on the same batches from the same start.

A driver runs round 1 at once (launch → end of round 1 is that round's end
stamp against the launch stamp the parent passes), then waits for a ``go`` line
on standard input before each further round and prints one JSON line per
round: ``{"round": r, "end": monotonic seconds, "s": seconds since its go}``.
The parent sends ``go`` to the frameworks in turn, so their rounds interleave
and a change in the machine's load falls on all of them. After the last round
it writes the final parameters (``--final``) for the equivalence check.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


def arg_parser() -> argparse.ArgumentParser:
    """The arguments every driver takes; a driver adds its own."""
    p = argparse.ArgumentParser()
    p.add_argument("--spec", required=True)
    p.add_argument("--final", default=None)
    p.add_argument("--rounds", type=int, default=None, help="the first N rounds of the spec")
    p.add_argument("--no-dropout", action="store_true")
    return p


def mlp(spec: dict[str, Any]) -> nn.Module:
    """The reference MLP 784-200-10 (fedloom's ``mlp`` with ``hidden: [200]``)."""
    dim = int(np.prod(spec["in_shape"]))
    return nn.Sequential(nn.Flatten(), nn.Linear(dim, spec["hidden"]), nn.ReLU(),
                         nn.Linear(spec["hidden"], spec["classes"]))


def pfl_cnn(spec: dict[str, Any], dropout: bool = True) -> nn.Module:
    """pfl-research's CIFAR-10 benchmark CNN on channels-first images (fedloom's
    ``pfl_cnn``): conv3×3(32) → ReLU → conv3×3(64) → ReLU → max-pool 2 →
    Dropout(0.25) → Dense(128) → ReLU → Dropout(0.5) → Dense(classes)."""
    c, h, w = spec["in_shape"]
    p1, p2 = (0.25, 0.5) if dropout else (0.0, 0.0)
    return nn.Sequential(
        nn.Conv2d(c, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Dropout(p1), nn.Flatten(), nn.Linear(64 * ((h - 4) // 2) * ((w - 4) // 2), 128),
        nn.ReLU(), nn.Dropout(p2), nn.Linear(128, spec["classes"]))


def build_model(spec: dict[str, Any], dropout: bool = True) -> nn.Module:
    """The spec's model with fedloom's initial parameters loaded."""
    model = mlp(spec) if spec["model"] == "mlp" else pfl_cnn(spec, dropout)
    load_flat(model, spec["init"])
    return model


@torch.no_grad()
def load_flat(model: nn.Module, params: list[torch.Tensor]) -> None:
    """Copy ``params`` (``parameters()`` order) into ``model``, shapes checked."""
    own = list(model.parameters())
    if len(own) != len(params) or any(a.shape != b.shape for a, b in zip(own, params,
                                                                          strict=True)):
        raise ValueError("spec.pt: the initial parameters do not fit the model")
    for a, b in zip(own, params, strict=True):
        a.copy_(b)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def load_spec(folder: str | Path) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """``(spec, x, y)``: the arrays as tensors in memory (as every framework holds them)."""
    folder = Path(folder)
    spec = torch.load(folder / "spec.pt", weights_only=True)
    x = torch.from_numpy(np.load(folder / "x.npy"))
    y = torch.from_numpy(np.load(folder / "y.npy"))
    return spec, x, y


def client_rows(spec: dict[str, Any], client: int) -> slice:
    n = spec["samples"]
    return slice(client * n, (client + 1) * n)


def ordered(spec: dict[str, Any], x: torch.Tensor, y: torch.Tensor, rnd: int, pos: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``cohorts[rnd][pos]``'s samples in fedloom's order for round ``rnd``:
    consecutive batches of this are fedloom's batches."""
    k = int(spec["cohorts"][rnd][pos])
    rows = client_rows(spec, k)
    perm = spec["perms"][rnd][pos]
    return x[rows][perm], y[rows][perm]


class Pacer:
    """The round protocol of the drivers (see the module docstring)."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.done = 0
        self.t_go = time.monotonic()

    def round_done(self) -> bool:
        """Report the round that just ended; wait for ``go`` unless it was the last.
        Returns whether another round follows."""
        now = time.monotonic()
        self.done += 1
        print(json.dumps({"round": self.done, "end": now, "s": now - self.t_go}), flush=True)
        if self.done >= self.rounds:
            return False
        line = sys.stdin.readline().strip()
        if line != "go":
            raise SystemExit(f"driver: expected 'go' on stdin, got {line!r}")
        self.t_go = time.monotonic()
        return True


def pfl_methods(net: nn.Module, weighted: Any) -> nn.Module:
    """``net`` with the ``loss`` and ``metrics`` methods pfl's ``PyTorchModel`` asks a
    module for (cross-entropy; ``weighted`` is pfl's ``Weighted``, imported by the caller
    in pfl's venv)."""
    import types

    def loss(self: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
             eval: bool = False) -> torch.Tensor:  # pfl's keyword
        self.eval() if eval else self.train()
        return torch.nn.functional.cross_entropy(self(inputs), targets)

    @torch.no_grad()
    def metrics(self: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                eval: bool = True) -> dict[str, Any]:
        self.eval() if eval else self.train()
        summed = torch.nn.functional.cross_entropy(self(inputs), targets, reduction="sum")
        return {"loss": weighted(summed.item(), len(targets))}

    net.loss = types.MethodType(loss, net)  # type: ignore[assignment]
    net.metrics = types.MethodType(metrics, net)  # type: ignore[assignment]
    return net


def save_final(path: str | None, model_or_flat: nn.Module | torch.Tensor) -> None:
    if not path:
        return
    w = model_or_flat if isinstance(model_or_flat, torch.Tensor) else flat(model_or_flat)
    torch.save(w.detach().cpu().clone(), path)
