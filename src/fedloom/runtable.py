"""The table ``fedloom run`` prints when a run ends: (metric, value) rows from its
summary, with what the run's mode measured (a selector, simulated time and
staleness, a language model's tokens per second and memory)."""

from __future__ import annotations

from typing import Any

from fedloom.config import Config

__all__ = ["fmt_bytes", "summary_rows"]


def fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def _num(v: Any) -> str:
    """A metric to 4 decimals; "–" when there is none (e.g. no client keeps a test split)."""
    if not isinstance(v, int | float) or v != v:
        return "–"
    return f"{v:.4f}"


def _pm(mean: Any, sd: Any) -> str:
    return "–" if _num(mean) == "–" else f"{_num(mean)} ± {_num(sd)}"


def _fmt_device(s: dict[str, Any]) -> str:
    """``cpu`` (threads), or ``cuda:0 (NVIDIA H200, 139.8 GB)``."""
    dev = str(s.get("device", "cpu"))
    if dev.startswith("cuda"):
        return f"{dev} ({s.get('device_name', '?')}, {s.get('device_memory_gb', 0):.1f} GB)"
    return f"{dev} ({s.get('threads', '?')} threads)"


def _mode_rows(s: dict[str, Any], cfg: Config) -> list[tuple[str, str]]:
    """What the run's mode measured: a selector other than uniform sampling, Poisson
    sampling and its rate, the simulated time and staleness of a system model or an
    event mode, and a language model's tokens per second and peak memory (the
    process's peak RSS on the CPU)."""
    rows: list[tuple[str, str]] = []
    if cfg.cohort.selection.name != "uniform":
        rows.append(("selector", cfg.cohort.selection.name))
    if cfg.cohort.sampling == "poisson":
        q = cfg.cohort.rate
        rows.append(("cohort sampling", f"poisson, rate {q:g}" if q is not None else
                     f"poisson, rate cohort.size / N = {cfg.cohort.size}/N"))
    if "sim_time_s" in s:
        rows.append(("simulated time", f"{s['sim_time_s']:.4g} s"))
    if "staleness_mean" in s:
        rows.append(("staleness mean / max (last round)",
                     f"{s['staleness_mean']:.2f} / {s.get('staleness_max', float('nan')):g}"))
    if "train_tokens_per_s" in s:
        rows.append(("training tokens/s", f"{s['train_tokens_per_s']:,.1f} "
                     f"({s.get('train_tokens_total', 0):,} tokens)"))
        if not str(s.get("device", "")).startswith("cuda") and "peak_rss_mb" in s:
            rows.append(("peak memory (RSS)", f"{s['peak_rss_mb']:.0f} MB"))
    return rows


def summary_rows(s: dict[str, Any], cfg: Config) -> list[tuple[str, str]]:
    """The table ``run`` prints at the end: (metric, value) rows from the run's summary."""
    return [
        ("rounds", f"{s['rounds']}"),
        ("test accuracy", _num(s.get("test_acc"))),
        ("test loss", _num(s.get("test_loss"))),
        ("client acc mean ± std", _pm(s.get("client_acc_mean"), s.get("client_acc_std"))),
        ("client acc worst 10 %", _num(s.get("client_acc_worst10"))),
        # a causal LM (fedloom.models.llm): the accuracies above are token accuracies
        *([("test perplexity", _num(s.get("test_ppl"))),
           ("client ppl mean ± std", _pm(s["client_ppl_mean"], s.get("client_ppl_std"))),
           ("client ppl worst 10 %", _num(s.get("client_ppl_worst10")))]
          if "client_ppl_mean" in s else []),
        *([("personal acc mean ± std", _pm(s["personal_acc_mean"], s.get("personal_acc_std"))),
           ("personal acc worst 10 %", _num(s.get("personal_acc_worst10")))]
          if "personal_acc_mean" in s else []),
        *([("personal ppl mean ± std", _pm(s["personal_ppl_mean"], s.get("personal_ppl_std"))),
           ("personal ppl worst 10 %", _num(s.get("personal_ppl_worst10")))]
          if "personal_ppl_mean" in s else []),
        ("uplink total", fmt_bytes(s["uplink_bytes_total"])),
        ("downlink total", fmt_bytes(s["downlink_bytes_total"])),
        ("rejected updates", f"{s['rejected_updates_total']}"),
        # shown only when something happened: a skipped step or a clipped update
        *([("rejected rounds (step skipped)", f"{s['rejected_rounds_total']}")]
          if s.get("rejected_rounds_total") else []),
        *([("clipped updates", f"{s['clipped_updates_total']}")]
          if s.get("clipped_updates_total") else []),
        # privacy.mode: the ε spent at δ, and why the run stopped early (target_epsilon)
        *([("dp epsilon (delta)", f"{s['dp_epsilon']:.4g} ({s['dp_delta']:g})")]
          if "dp_epsilon" in s and "dp_delta" in s else []),
        *([("stopped", s["stop_reason"])] if "stop_reason" in s else []),
        *_mode_rows(s, cfg),
        # the step used and where it came from (auto: the rule's), or a server step object
        *([("server.lr", f"{s['server_lr']:g}" + (f" (auto: {cfg.aggregator.name}'s default)"
                                                 if cfg.server.lr == "auto" else ""))]
          if "server_lr" in s else [("server step", f"{s['server_step'][:80]} (server.lr not "
                                     "applied)")] if "server_step" in s else []),
        ("backend", f"{s.get('backend', '')}"),
        ("device", _fmt_device(s)),
        *([("peak device memory", f"{s['peak_device_memory_mb']:.0f} MB")]
          if str(s.get("device", "")).startswith("cuda") else []),
        ("wall time", f"{s['wall_s_total']:.1f} s"),
        ("model sha256", s["model_sha256"][:16] + "…"),
    ]
