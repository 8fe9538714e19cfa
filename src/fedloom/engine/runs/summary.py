"""What a run says of itself: the divergence warning and the summary.

:class:`DivergenceWatch` names, once, the setting most likely at fault when
the training loss blows up; :func:`summarize` is ``summary.json``: the final
value of each metric, the run's totals, the model's hash, where it ran and
with what. What it reads of the run beside its state and metrics is one
:class:`RunFacts`, which the loop takes from the experiment when the run ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedloom.aggregate.base import default_server_lr
from fedloom.buffers import buffers_sha256
from fedloom.config import Config
from fedloom.data.heterogeneity import heterogeneity
from fedloom.data.sources import Dataset
from fedloom.data.user import unscaled_features
from fedloom.device import describe, peak_memory_mb, peak_rss_mb
from fedloom.engine.build import resolve_auto
from fedloom.engine.inputs import ModelSpace
from fedloom.engine.objects import server_step
from fedloom.engine.runstate import RunState, model_sha256
from fedloom.privacy import Privacy

__all__ = ["DivergenceWatch", "RunFacts", "summarize"]


@dataclass(frozen=True)
class RunFacts:
    """What a run's summary and files say of it beside its state and metrics,
    taken from the experiment when the run ends (so ``backend`` is the backend
    ``auto`` chose, and ``worker_threads`` its workers')."""

    cfg: Config                    # the resolved config (config.yaml, model.pt, the plots)
    space: ModelSpace              # the module and its layout (model.pt), the run's device
    dataset: Dataset               # model.pt's input shape and number of classes
    partition_counts: np.ndarray   # the split's class counts (partition_*, partition.png)
    model_from_config: bool        # model.pt: load_model rebuilds the module from cfg
    backend: str                   # the backend's name
    worker_threads: int | None     # threads per worker of a backend with workers
    threads: int                   # torch threads of the process that trains
    privacy: Privacy               # ε spent and δ, when on


# Per-round details that make no sense as a run's final value.
_PER_ROUND_ONLY = ("rejected_clients", "rejected_reasons", "rejected_round_reason",
                   "dropped_client_ids")


class DivergenceWatch:
    """Says, once, that a run's training loss went non-finite or rose 10× over its
    first value, and names the setting most likely at fault.

    Rule: round ``r``'s ``train_loss`` is not finite, or exceeds ``10·L_1`` with
    ``L_1 > 0`` the first finite one, or ``10·ln C`` (``C`` classes: ``ln C`` is
    the cross-entropy of a uniform guess, about where training starts, so a first
    round that already blew up is caught too). The likely setting: ``server.lr`` when it is
    above the aggregator's public default (:func:`resolve_auto`) or the server
    optimizer is adaptive and ``server.lr >= 0.1`` (such optimizers move every
    coordinate by about ``server.lr`` a round); ``client.lr`` otherwise; and, for
    tabular features that look unscaled, ``data.standardize``.
    """

    FACTOR = 10.0

    def __init__(self, cfg: Config, num_classes: int = 0, x: torch.Tensor | None = None
                 ) -> None:
        self.cfg = resolve_auto(cfg)
        self.first: float | None = None
        self.uniform = float(np.log(num_classes)) if num_classes >= 2 else 0.0
        self.message: str | None = None
        # Tabular features ``x`` (``[n, f]``, as trained on: standardized under
        # data.standardize), measured when the rule trips: columns that look unscaled
        # are named beside the step sizes, as a CSV's load says
        self.x = x if x is not None and x.ndim == 2 and x.is_floating_point() else None

    def see(self, m: dict[str, Any]) -> str | None:
        """The warning, the first time round metrics ``m`` trip the rule; else None."""
        loss = m.get("train_loss")
        if self.message is not None or not isinstance(loss, int | float):
            return None
        if m.get("cohort_size", 1) <= m.get("dropped_clients", 0):
            return None  # nobody reported (none available, all dropped): no loss to judge
        if not np.isfinite(loss):
            what = "is not finite"
        elif self.first is not None and self.first > 0 and loss > self.FACTOR * self.first:
            what = f"is {loss:.3g}, {loss / self.first:.0f}× its first value {self.first:.3g}"
        elif self.uniform and loss > self.FACTOR * self.uniform:
            what = (f"is {loss:.3g}, {loss / self.uniform:.0f}× a uniform guess's "
                    f"ln C = {self.uniform:.3g}")
        else:
            if self.first is None:
                self.first = float(loss)
            return None
        self.message = f"round {m.get('round')}: the training loss {what}; {self._culprit()}"
        why = (unscaled_features(self.x.detach().cpu().double().numpy())
               if self.x is not None else None)
        if why is not None:
            self.message += (f"; the features look unscaled ({why}): data.standardize=true "
                             "scales each to mean 0, std 1")
        return self.message

    def _culprit(self) -> str:
        s, c, name = self.cfg.server, self.cfg.client, self.cfg.aggregator.name
        step = server_step(self.cfg)
        if step is not None:  # server.lr is not applied: never blame it
            return f"likely client.lr={c.lr:g} or the server step's own size ({step})"
        lr = s.lr
        assert not isinstance(lr, str), "resolve_auto in __init__ resolved server.lr=auto"
        try:
            default = default_server_lr(name, self.cfg.aggregator.options)
        except (KeyError, ValueError):
            default = lr
        if lr > default:
            return (f"likely server.lr={lr:g}, above {name}'s public default {default:g} "
                    "(server.lr=auto uses it)")
        if s.optimizer.name in ("adam", "yogi", "adagrad") and lr >= 0.1:
            return (f"likely server.lr={lr:g}: server.optimizer={s.optimizer.name} moves every "
                    "coordinate by about server.lr a round")
        return f"likely client.lr={c.lr:g} (or server.lr={lr:g}) is too large"


def _versions() -> dict[str, str]:
    """What produced the run: fedloom, torch, numpy and Python versions."""
    import platform

    from fedloom._version import __version__

    return {"fedloom": __version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": platform.python_version()}


def summarize(run: RunFacts, st: RunState, history: list[dict[str, Any]],
              warnings: Sequence[str] = (), stop_reason: str | None = None) -> dict[str, Any]:
    """``summary.json`` of a run that ended in ``st`` (``stop_reason``: why it
    stopped before its last round)."""
    cfg, device, privacy = run.cfg, run.space.device, run.privacy
    summary: dict[str, Any] = {"rounds": st.next_round, "model_sha256": model_sha256(st.w),
                               "num_parameters": run.space.layout.size,
                               "backend": run.backend,
                               "versions": _versions()}
    # The step used: server.lr (auto resolved to the rule's default), or a server step
    # object's own, which server.lr does not scale (the summary never claims it then)
    step = server_step(cfg)
    summary.update({"server_lr": cfg.server.lr} if step is None else {"server_step": step})
    if st.buffers:  # module buffers (BatchNorm statistics) are not in w
        summary["buffers_sha256"] = buffers_sha256(st.buffers)
        summary["buffers"] = cfg.model.buffers
    if warnings:
        summary["warnings"] = list(warnings)
    for m in history:  # final value of each metric (eval metrics from the last eval round)
        summary.update({k: v for k, v in m.items() if k not in _PER_ROUND_ONLY})
    # How heterogeneous the split is (fedloom.data.heterogeneity), as partition_* keys
    summary.update({f"partition_{k}": v
                    for k, v in heterogeneity(run.partition_counts).items()})
    summary["rejected_updates_total"] = st.totals["rejected_updates"]
    summary["rejected_rounds_total"] = st.totals.get("rejected_rounds", 0)
    summary["clipped_updates_total"] = st.totals.get("clipped_updates", 0)
    summary["wall_s_total"] = float(sum(m.get("wall_s", 0.0) for m in history))
    # Where it ran (fedloom.device): the device, its name and total memory, the
    # run's peak memory on it (CUDA: allocated tensors; CPU: the process's peak RSS,
    # named in peak_device_memory_kind), and the torch threads used.
    summary.update(describe(device))
    peak, kind = peak_memory_mb(device)
    summary["peak_device_memory_mb"] = round(peak, 1)
    summary["peak_device_memory_kind"] = kind
    # The process's peak RSS on any device (getrusage: since the process started,
    # whatever else ran in it; on CUDA the host side, next to the device's peak)
    summary["peak_rss_mb"] = round(peak_rss_mb(), 1)
    tokens = [m["train_tokens"] for m in history if "train_tokens" in m]
    if tokens:  # token data: the tokens of local training over its wall time (train_s)
        train_s = sum(m.get("train_s", 0.0) for m in history if "train_tokens" in m)
        summary["train_tokens_total"] = int(sum(tokens))
        summary["train_tokens_per_s"] = (round(sum(tokens) / train_s, 1) if train_s > 0
                                         else float("nan"))
    summary["threads"] = run.threads
    if run.worker_threads is not None:
        summary["worker_threads"] = run.worker_threads
    if privacy.enabled:  # ε spent (also when no round ran) and why the run stopped
        summary["dp_epsilon"] = privacy.epsilon(st.privacy_state, st.next_round)
        summary["dp_delta"] = privacy.delta
        summary["dp_accounting"] = privacy.record()  # what the ε is of (fedloom.accounting)
    if stop_reason is not None:
        summary["stop_reason"] = stop_reason
    return summary
