"""How heterogeneous a split is: numbers computed from the per-client label counts.

For ``N`` clients and ``C`` classes let ``c_{kj}`` be client ``k``'s count of class
``j``, ``n_k = Σ_j c_{kj}``, ``p_k = c_k / n_k`` its label distribution and
``g = Σ_k c_k / Σ_k n_k`` the global one.

- ``hellinger``: mean over clients of ``H(p_k, g) = sqrt(1 − Σ_j sqrt(p_{kj} g_j))``
  (0 for an IID client; 1 when they share no class).
- ``tv``: mean total-variation distance ``½ Σ_j |p_{kj} − g_j|``.
- ``eff_classes``: mean effective number of classes ``exp(−Σ_j p_{kj} log p_{kj})``
  (the exponential of the Shannon entropy: ``k`` for ``k`` equally frequent
  classes, ``C`` for a balanced client).
- ``classes``: mean number of classes present on a client.
- ``size_gini``: the Gini coefficient of the sizes,
  ``Σ_k Σ_l |n_k − n_l| / (2 N² mean(n))`` (0 equal sizes; → 1 one client holds all).
- ``size_cv``: the coefficient of variation ``std(n)/mean(n)`` of the sizes.

The client means are unweighted: each client is one participant, whatever its size.
The measures follow the non-IID statistics of Li et al., ICDE 2022 (label
distribution and quantity skew) and the label-distribution plots of flwr-datasets.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["MEASURES", "class_counts", "heterogeneity"]

# The keys of :func:`heterogeneity`, in the order tables show them, with a header.
MEASURES = {"hellinger": "Hellinger", "tv": "TV", "eff_classes": "eff. classes",
            "classes": "classes", "size_gini": "size Gini", "size_cv": "size CV"}


def class_counts(labels: np.ndarray, parts: Sequence[np.ndarray],
                 num_classes: int | None = None) -> np.ndarray:
    """``[N, C]`` integer counts of each class on each client (labels ``0…C−1``; a
    sample with a sequence of labels counts each; a negative label, a padded target
    of cross-entropy's ``ignore_index``, counts for none)."""
    labels = np.asarray(labels).astype(np.int64)
    c = int(num_classes if num_classes is not None else labels.max(initial=-1) + 1)
    out = np.zeros((len(parts), max(c, 1)), dtype=np.int64)
    for k, p in enumerate(parts):
        # ravel: a sample with a sequence of labels (text) counts each of its tokens
        tokens = labels[np.asarray(p, dtype=np.int64)].ravel()
        out[k] = np.bincount(tokens[tokens >= 0], minlength=out.shape[1])
    return out


def heterogeneity(counts: np.ndarray) -> dict[str, float]:
    """The measures above from ``[N, C]`` counts (clients without a sample are skipped
    in the label measures and counted as size 0 in the size ones)."""
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum(axis=1)
    total = n.sum()
    if total <= 0:
        raise ValueError("heterogeneity: the split holds no sample")
    g = counts.sum(axis=0) / total
    held = n > 0
    p = counts[held] / n[held, None]
    bc = np.sqrt(p * g[None, :]).sum(axis=1)
    hell = np.sqrt(np.clip(1.0 - bc, 0.0, None))
    tv = 0.5 * np.abs(p - g[None, :]).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=1)
    mean = n.mean()
    # Σ_k Σ_l |n_k − n_l| = 2 Σ_i (2i − N − 1) n_(i) over the sizes sorted
    # increasingly (i = 1…N): O(N log N) time and O(N) memory, not the N × N
    # matrix of differences (800 MB at 10,000 clients)
    ns = np.sort(n)
    rank = 2.0 * np.arange(1, len(ns) + 1) - len(ns) - 1
    gini = float(2.0 * (rank * ns).sum() / (2 * len(n) ** 2 * mean))
    return {"hellinger": float(hell.mean()), "tv": float(tv.mean()),
            "eff_classes": float(np.exp(ent).mean()),
            "classes": float((p > 0).sum(axis=1).mean()),
            "size_gini": gini, "size_cv": float(n.std() / mean)}


def split_counts(cfg: object) -> np.ndarray:
    """The ``[N, C]`` class counts of the split a config makes (each client's whole part,
    train and test), without building a model: what ``fedloom partition`` shows."""
    from fedloom.data.federated import build_federated
    from fedloom.data.sources import load_dataset

    data, seed = cfg.data, cfg.seed  # type: ignore[attr-defined]
    ds = load_dataset(data, seed)
    fed = build_federated(ds, data, seed)
    parts = [np.concatenate([tr, te]) for tr, te in zip(fed.train, fed.test, strict=True)]
    return class_counts(fed.dataset.y.numpy(), parts, fed.dataset.num_classes)


def measures_table(counts: np.ndarray) -> str:
    """The measures as a two-column text table, with the sizes' range."""
    m = heterogeneity(counts)
    n = counts.sum(axis=1)
    rows = [("clients", f"{counts.shape[0]}"), ("classes", f"{counts.shape[1]}"),
            ("samples", f"{int(n.sum())}"),
            ("client size min / median / max",
             f"{int(n.min())} / {int(np.median(n))} / {int(n.max())}")]
    rows += [(f"{label} ({key})", f"{m[key]:.4f}") for key, label in MEASURES.items()]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{width}}  {b}" for a, b in rows)
