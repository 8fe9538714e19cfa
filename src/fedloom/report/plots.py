"""PNG plots of one run (written into its run directory when matplotlib is installed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fedloom.files import save_figure

__all__ = ["have_matplotlib", "write_run_plots"]


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (the ``report`` extra)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_run_plots(run_dir: Path, history: Sequence[dict[str, Any]]) -> list[Path]:
    """``curves.png``: test and mean client accuracy, train and test loss, by round and by
    cumulative uplink. Returns the files written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ev = [m for m in history if "test_acc" in m]
    if not ev:
        return []
    rounds = [m["round"] for m in ev]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), dpi=110)
    axes[0].plot(rounds, [100 * m["test_acc"] for m in ev], label="test acc")
    if "client_acc_mean" in ev[0]:
        axes[0].plot(rounds, [100 * m["client_acc_mean"] for m in ev], label="client acc mean")
        axes[0].plot(rounds, [100 * m["client_acc_worst10"] for m in ev], label="worst 10 %")
    axes[0].set_xlabel("round")
    axes[0].set_ylabel("accuracy (%)")
    axes[1].plot([m["round"] for m in history], [m["train_loss"] for m in history],
                 label="train loss")
    axes[1].plot(rounds, [m["test_loss"] for m in ev], label="test loss")
    axes[1].set_xlabel("round")
    axes[1].set_yscale("log")
    losses = [v for v in [m["train_loss"] for m in history] + [m["test_loss"] for m in ev]
              if v > 0 and v == v and v != float("inf")]
    if losses:
        from fedloom.report.compare import log_ticks

        log_ticks(axes[1].yaxis, min(losses), max(losses))
    axes[2].plot([m["uplink_bytes_total"] / 1e6 for m in ev], [100 * m["test_acc"] for m in ev])
    axes[2].set_xlabel("cumulative uplink (MB)")
    axes[2].set_ylabel("test accuracy (%)")
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.grid(alpha=0.3)
    for ax in axes[:2]:  # rounds are whole numbers: no 2.5 on the axis of a 5-round run
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=8)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    path = run_dir / "curves.png"
    save_figure(fig, path)  # replaced: never written through a link
    plt.close(fig)
    return [path]
