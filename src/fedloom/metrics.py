"""Metrics: per-client accuracy statistics, fairness, conflicts, evaluation."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedloom.params import Layout, functional_forward, training_mode

__all__ = ["accuracy_stats", "conflict_rate", "evaluate", "evaluate_clients",
           "evaluate_clients_lm", "evaluate_pooled_and_clients", "perplexity_stats"]


def accuracy_stats(acc: np.ndarray, prefix: str = "client_acc") -> dict[str, float]:
    """Statistics of per-client accuracies over **all** clients (CRAFT's metrics).

    - ``mean``; ``std``: population std (``ddof=0``);
    - ``worst10`` / ``best10``: mean of the lowest / highest ``⌈0.1 N⌉`` values;
    - ``jain``: Jain's fairness index ``(Σa)² / (N Σa²)`` (1 = perfectly even;
      defined as 1 when every accuracy is 0).
    """
    a = np.asarray(acc, dtype=np.float64)
    a = a[~np.isnan(a)]  # clients without a test split do not count
    if a.size == 0:
        return {}
    k = max(1, math.ceil(0.1 * a.size))
    s = np.sort(a)
    sq = float((a * a).sum())
    return {
        f"{prefix}_mean": float(a.mean()),
        f"{prefix}_std": float(a.std()),
        f"{prefix}_worst10": float(s[:k].mean()),
        f"{prefix}_best10": float(s[-k:].mean()),
        f"{prefix}_jain": float(a.sum() ** 2 / (a.size * sq)) if sq > 0 else 1.0,
    }


def perplexity_stats(ppl: np.ndarray, prefix: str = "client_ppl") -> dict[str, float]:
    """Statistics of per-client test perplexities (a causal LM's): ``mean``, ``std``
    (``ddof=0``), ``worst10`` / ``best10`` the mean of the highest / lowest ``⌈0.1 N⌉``
    (the worst clients have the *highest* perplexity)."""
    a = np.asarray(ppl, dtype=np.float64)
    a = a[~np.isnan(a)]
    if a.size == 0:
        return {}
    k = max(1, math.ceil(0.1 * a.size))
    s = np.sort(a)
    return {f"{prefix}_mean": float(a.mean()), f"{prefix}_std": float(a.std()),
            f"{prefix}_worst10": float(s[-k:].mean()), f"{prefix}_best10": float(s[:k].mean())}


def conflict_rate(updates: torch.Tensor, agg: torch.Tensor) -> float:
    """Fraction of rows ``g_i`` with ``⟨g_i, agg⟩ < 0``."""
    if updates.shape[0] == 0:
        return 0.0
    # A sign test: the updates' own dtype is enough (no float64 copy of [m, d]).
    dots = updates @ agg.to(updates.dtype)
    return float((dots < 0).double().mean())


@torch.no_grad()
def _predict(
    module: nn.Module, layout: Layout, w: torch.Tensor, x: torch.Tensor, batch_size: int,
    buffers: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss-ready logits, in batches: returns (logits argmax, per-sample CE).
    The module runs in eval mode (no dropout; BatchNorm with ``buffers``' statistics)."""
    preds, logits_all = [], []
    with training_mode(module, False):
        for s in range(0, x.shape[0], batch_size):
            logits = functional_forward(module, layout, w, x[s : s + batch_size],
                                        buffers=buffers)
            logits_all.append(logits)
            preds.append(logits.argmax(1))
    return torch.cat(preds), torch.cat(logits_all)


@torch.no_grad()
def _per_sequence(
    module: nn.Module, layout: Layout, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
    batch_size: int, buffers: dict[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels ``[N, T]`` (a causal LM's next tokens, logits ``[B, V, T]``): each sample's
    token accuracy and mean token cross-entropy (float64), ``[N]`` each. Batch by batch:
    a vocabulary's logits over the whole test set are never held at once."""
    hits, losses = [], []
    with training_mode(module, False):
        for s in range(0, x.shape[0], batch_size):
            logits = functional_forward(module, layout, w, x[s : s + batch_size],
                                        buffers=buffers)
            yb = y[s : s + batch_size]
            hits.append((logits.argmax(1) == yb).double().flatten(1).mean(1))
            ce = F.cross_entropy(logits.to(torch.float64), yb, reduction="none")
            losses.append(ce.flatten(1).mean(1))
    return torch.cat(hits), torch.cat(losses)


def _pooled_lm(hit: torch.Tensor, ce: torch.Tensor) -> tuple[float, float]:
    # token accuracy and mean token cross-entropy of every window together
    return float(hit.mean()), float(ce.mean())


def _per_client_lm(hit: torch.Tensor, ce: torch.Tensor, owner: torch.Tensor,
                   num_clients: int) -> tuple[np.ndarray, np.ndarray]:
    total = torch.bincount(owner, minlength=num_clients).double()
    acc = torch.bincount(owner, weights=hit, minlength=num_clients) / total
    loss = torch.bincount(owner, weights=ce, minlength=num_clients) / total
    return acc.cpu().numpy(), torch.exp(loss).cpu().numpy()


def _pooled_classes(pred: torch.Tensor, logits: torch.Tensor, y: torch.Tensor
                    ) -> tuple[float, float]:
    loss = F.cross_entropy(logits.to(torch.float64), y, reduction="mean")
    return float((pred == y).double().mean()), float(loss)


def _per_client_classes(pred: torch.Tensor, y: torch.Tensor, owner: torch.Tensor,
                        num_clients: int) -> np.ndarray:
    correct = torch.bincount(owner, weights=(pred == y).double(), minlength=num_clients)
    total = torch.bincount(owner, minlength=num_clients).double()
    return (correct / total).cpu().numpy()


@torch.no_grad()
def evaluate(
    module: nn.Module, layout: Layout, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
    batch_size: int = 2048, buffers: dict[str, torch.Tensor] | None = None,
) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of the model ``w`` (with module ``buffers``;
    default: the module's own) on ``(x, y)``, in eval mode."""
    if x.shape[0] == 0:
        return float("nan"), float("nan")
    if y.ndim > 1:  # next tokens: token accuracy and mean token cross-entropy
        return _pooled_lm(*_per_sequence(module, layout, w, x, y, batch_size, buffers))
    pred, logits = _predict(module, layout, w, x, batch_size, buffers)
    return _pooled_classes(pred, logits, y)


@torch.no_grad()
def evaluate_clients(
    module: nn.Module, layout: Layout, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
    owner: torch.Tensor, num_clients: int, batch_size: int = 2048,
    buffers: dict[str, torch.Tensor] | None = None,
) -> np.ndarray:
    """Per-client accuracy of one model on every client's own test split.

    ``x, y`` hold all clients' test samples, ``owner`` the client of each, so the
    model runs once over all of them. A client with no test sample gets NaN.
    """
    if y.ndim > 1:
        return evaluate_clients_lm(module, layout, w, x, y, owner, num_clients, batch_size,
                                   buffers)[0]
    pred, _ = _predict(module, layout, w, x, batch_size, buffers)
    return _per_client_classes(pred, y, owner, num_clients)


@torch.no_grad()
def evaluate_clients_lm(
    module: nn.Module, layout: Layout, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
    owner: torch.Tensor, num_clients: int, batch_size: int = 2048,
    buffers: dict[str, torch.Tensor] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Per-client token accuracy and test perplexity of a causal LM (labels ``[N, T]``).

    Every window has ``T`` tokens, so a client's mean over its windows is its mean over
    tokens; perplexity is ``exp`` of the client's mean token cross-entropy. A client
    with no test window gets NaN in both.
    """
    hit, ce = _per_sequence(module, layout, w, x, y, batch_size, buffers)
    return _per_client_lm(hit, ce, owner, num_clients)


@torch.no_grad()
def evaluate_pooled_and_clients(
    module: nn.Module, layout: Layout, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
    owner: torch.Tensor, num_clients: int, batch_size: int = 2048,
    buffers: dict[str, torch.Tensor] | None = None,
) -> tuple[tuple[float, float], np.ndarray, np.ndarray | None]:
    """:func:`evaluate` and the per-client metrics of :func:`evaluate_clients` (a
    causal LM: of :func:`evaluate_clients_lm`) on the same samples, from one forward
    pass: ``((accuracy, loss), per-client accuracy, per-client perplexity or None)``.

    For a test set that is the union of the clients' splits (``owner`` the client of
    each sample). Each number is the one the separate functions give on these
    samples, bit for bit: the same batches go through the model once, and each
    statistic is the same reduction of the same per-sample values.
    """
    if x.shape[0] == 0:
        nan = np.full(num_clients, np.nan)
        return (float("nan"), float("nan")), nan, (nan.copy() if y.ndim > 1 else None)
    if y.ndim > 1:
        hit, ce = _per_sequence(module, layout, w, x, y, batch_size, buffers)
        acc, ppl = _per_client_lm(hit, ce, owner, num_clients)
        return _pooled_lm(hit, ce), acc, ppl
    pred, logits = _predict(module, layout, w, x, batch_size, buffers)
    return (_pooled_classes(pred, logits, y),
            _per_client_classes(pred, y, owner, num_clients), None)
