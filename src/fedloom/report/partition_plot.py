"""``partition.png``: a picture of one split (label counts per client, client sizes).

Left, a heatmap of the ``[N, C]`` class counts, classes down, clients across: clients
ordered by their largest class, then by that class's share, then by size, so clients
alike sit together and label skew shows as blocks (a diagonal staircase for ``k = 1``,
an even grey for IID). Colour is the count, on a square-root scale so small counts stay
visible beside large ones. Right, the histogram of client sizes. At 1,000 clients a
heatmap column is under a pixel wide: the ordering keeps the blocks readable. The
title carries the heterogeneity measures (:mod:`fedloom.data.heterogeneity`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from fedloom.files import save_figure

__all__ = ["client_order", "write_partition_plot"]


def client_order(counts: np.ndarray) -> np.ndarray:
    """The clients' order in the heatmap: by dominant class, its share (descending), size."""
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum(axis=1)
    top = counts.argmax(axis=1)
    share = np.where(n > 0, counts.max(axis=1) / np.maximum(n, 1), 0.0)
    return np.lexsort((-n, -share, top))


def write_partition_plot(path: Path, counts: np.ndarray,
                         measures: Mapping[str, float] | None = None,
                         title: str = "") -> Path | None:
    """Write the picture to ``path``; ``None`` (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import PowerNorm
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        return None
    counts = np.asarray(counts)
    n_clients, n_classes = counts.shape
    sizes = counts.sum(axis=1)
    order = client_order(counts)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 3.8), dpi=110,
                                 gridspec_kw={"width_ratios": [2.6, 1]}, layout="constrained")
    img = ax.imshow(counts[order].T, aspect="auto", cmap="viridis", interpolation="nearest",
                    norm=PowerNorm(0.5, vmin=0, vmax=max(1, int(counts.max()))))
    ax.set_xlabel(f"client ({n_clients}, sorted by dominant class, then share and size)")
    ax.set_ylabel("class")
    if n_classes <= 20:
        ax.set_yticks(range(n_classes))
    else:
        ax.set_yticks(np.linspace(0, n_classes - 1, 11).round().astype(int))
    fig.colorbar(img, ax=ax, label="samples (√ scale)", pad=0.01)
    bins = min(50, max(5, int(np.sqrt(n_clients)) * 2))
    bx.hist(sizes, bins=bins, color="tab:blue", edgecolor="white", linewidth=0.5)
    bx.set_xlabel("client size (samples)")
    bx.set_ylabel("clients")
    bx.yaxis.set_major_locator(MaxNLocator(integer=True))
    bx.set_title(f"sizes: min {int(sizes.min())}, median {int(np.median(sizes))}, "
                 f"max {int(sizes.max())}", fontsize=9)
    head = title
    if measures:
        m = measures
        head += (("  —  " if head else "") + f"Hellinger {m['hellinger']:.3f}, "
                 f"TV {m['tv']:.3f}, eff. classes {m['eff_classes']:.2f}, "
                 f"classes {m['classes']:.2f}, size Gini {m['size_gini']:.3f}")
    if head:
        ax.set_title(head, fontsize=9, loc="left")
    path = save_figure(fig, path)  # replaced whole: never written through a link
    plt.close(fig)
    return path
