"""Metrics: per-client accuracy statistics, fairness, conflicts, evaluation."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedloom.params import Layout, functional_forward, training_mode

IGNORE = -100  # a padded next-token target: F.cross_entropy's default ignore_index

__all__ = ["IGNORE", "accuracy_stats", "averaged_precision", "conflict_rate", "evaluate",
           "evaluate_clients", "evaluate_clients_lm", "evaluate_multilabel",
           "evaluate_pooled_and_clients", "perplexity_stats"]


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
    token accuracy and mean token cross-entropy (float64), ``[N]`` each, over its tokens
    whose label is not ``IGNORE`` (-100, a padded target; cross-entropy's default
    ``ignore_index``; a window of padding only gives NaN). Batch by batch:
    a vocabulary's logits over the whole test set are never held at once."""
    hits, losses = [], []
    with training_mode(module, False):
        for s in range(0, x.shape[0], batch_size):
            logits = functional_forward(module, layout, w, x[s : s + batch_size],
                                        buffers=buffers)
            yb = y[s : s + batch_size]
            hit = (logits.argmax(1) == yb).double().flatten(1)
            ce = F.cross_entropy(logits.to(torch.float64), yb, reduction="none").flatten(1)
            real = (yb != IGNORE).flatten(1)
            if bool(real.all()):
                hits.append(hit.mean(1))
                losses.append(ce.mean(1))
            else:  # padded targets (stackoverflow, reddit): a window's mean over its real tokens
                n = real.sum(1).double()
                hits.append(hit.sum(1) / n)
                losses.append(ce.sum(1) / n)
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


def averaged_precision(scores: np.ndarray, targets: np.ndarray, thresholds: int = 200
                       ) -> tuple[np.ndarray, float, float]:
    """Averaged precision of multi-label ``scores`` (probabilities, ``[N, C]``) against
    multi-hot ``targets``: ``(per-class AP [C], macro AP, micro AP)``, as pfl-research
    reports FLAIR's (``benchmarks/model/numpy/metrics.py``, ``AveragedPrecision``).

    ``AP = Σ_i (R_i − R_{i+1}) P_i`` over the thresholds ``t_i = i / (thresholds − 1)``
    (Keras' buckets: a score ``s`` counts as positive at ``t_i`` when
    ``⌈s (thresholds − 1)⌉ − 1 ≥ i``), precision and recall 0 where undefined (a class
    with no positive scores 0, and counts in the macro mean, as pfl's
    ``nan_to_num``). Macro: the mean over classes; micro: every (sample, class) pair
    as one binary problem. ``thresholds: 0`` ranks every distinct score instead
    (scikit-learn's ``average_precision_score``; tests/test_published_models.py
    compares both with it: equal where each distinct score has a bucket of its own).
    Checked against pfl-research's ``AveragedPrecision`` run on 200 random draws (up to
    80 x 20, ties, scores of 0 and 1): macro and micro within 2.2e-16; the twelve
    cases of tests/data/averaged_precision_reference.json (benchmarks/ap_reference.py)
    are tested to 1e-12.
    """
    s = np.asarray(scores, dtype=np.float64)
    t = np.asarray(targets, dtype=np.float64)
    if s.shape != t.shape or s.ndim != 2:
        raise ValueError(f"averaged_precision: scores {s.shape} and targets {t.shape} must be "
                         "the same [N, C]")
    per = np.array([_ap(s[:, c], t[:, c], thresholds) for c in range(s.shape[1])])
    return per, float(per.mean()) if per.size else float("nan"), \
        _ap(s.ravel(), t.ravel(), thresholds)


def _ap(s: np.ndarray, t: np.ndarray, thresholds: int) -> float:
    if thresholds:
        bucket = np.maximum(np.ceil(s * (thresholds - 1)) - 1, 0).astype(np.int64)
        bucket = np.minimum(bucket, thresholds - 1)
        tp_b = np.bincount(bucket, weights=t, minlength=thresholds)
        fp_b = np.bincount(bucket, weights=1 - t, minlength=thresholds)
        tp = np.cumsum(tp_b[::-1])[::-1]  # positives at threshold i: buckets >= i
        fp = np.cumsum(fp_b[::-1])[::-1]
    else:  # every distinct score a threshold, highest first
        order = np.argsort(-s, kind="stable")
        ss, tt = s[order], t[order]
        last = np.r_[np.flatnonzero(np.diff(ss)), len(ss) - 1] if len(ss) else np.array([], int)
        tp, fp = np.cumsum(tt)[last][::-1], np.cumsum(1 - tt)[last][::-1]
    pos = t.sum()
    with np.errstate(invalid="ignore", divide="ignore"):
        recall = np.nan_to_num(tp / pos) if pos else np.zeros_like(tp)
        precision = np.nan_to_num(tp / (tp + fp))
    recall = np.r_[recall, 0.0]  # the last threshold's step down to recall 0
    return float(-np.sum(np.diff(recall) * precision))


@torch.no_grad()
def evaluate_multilabel(module: nn.Module, layout: Layout, w: torch.Tensor, x: torch.Tensor,
                        y: torch.Tensor, batch_size: int = 512,
                        buffers: dict[str, torch.Tensor] | None = None,
                        thresholds: int = 200) -> dict[str, float]:
    """pfl's FLAIR metrics of a multi-label model (logits ``[B, 2, C]``, the first row
    zero, :mod:`fedloom.models.published`) on multi-hot ``y`` ``[N, C]``: ``micro_loss``
    (mean binary cross-entropy), ``micro_accuracy`` (labels right at 0.5), ``macro_ap``
    and ``micro_ap`` (:func:`averaged_precision`); eval mode."""
    scores, losses, hits = [], [], []
    with training_mode(module, False):
        for s in range(0, x.shape[0], batch_size):
            logits = functional_forward(module, layout, w, x[s : s + batch_size],
                                        buffers=buffers).to(torch.float64)
            z = logits[:, 1] - logits[:, 0]
            yb = y[s : s + batch_size].to(torch.float64)
            scores.append(torch.sigmoid(z))
            losses.append(F.binary_cross_entropy_with_logits(z, yb, reduction="none"))
            hits.append(((z > 0).double() == yb).double())
    p = torch.cat(scores).cpu().numpy()
    _, macro, micro = averaged_precision(p, y.cpu().numpy(), thresholds)
    return {"micro_loss": float(torch.cat(losses).mean()),
            "micro_accuracy": float(torch.cat(hits).mean()), "macro_ap": macro, "micro_ap": micro}
