"""The command line: ``fedloom run | datasets``.

Errors in what the user gave (config, overrides, data, run directory) print one
line ``fedloom: error: …`` and exit with status 2; nothing is left behind.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # pragma: no cover


def _default_out(config: str, name: str | None) -> Path:
    stem = name or Path(config).stem
    return Path("runs") / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def _first_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (``exists()`` is False under a file)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def _check_out(out: Path) -> Path:
    """Refuse an ``--out`` that cannot become a run directory, before any data is
    loaded; return the nearest ancestor that exists (see :func:`_remove_new_dirs`).

    Permissions alone do not tell (root may write anywhere, yet ``mkdir`` in
    ``/proc`` fails), so a probe directory is made next to where the run
    directory will be and removed at once.
    """
    import os
    import tempfile

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    base = _first_existing(out)
    if not base.is_dir():
        raise ValueError(f"--out {out}: {base} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fedloom-probe-", dir=base))
    except OSError as e:
        raise ValueError(f"--out {out}: cannot create a directory in {base} "
                         f"({e.strerror or type(e).__name__})") from None
    return base


def _remove_new_dirs(out: Path, base: Path) -> None:
    """After a failed start, remove the empty parents of ``out`` this run created
    (``run`` removes ``out`` itself unless it holds a checkpoint)."""
    import os

    for p in out.parents:
        if p == base or not p.is_relative_to(base):
            break
        try:
            os.rmdir(p)  # only if empty: never what another run or the user put there
        except OSError:
            break


def _cmd_run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from fedloom.config import load_config
    from fedloom.engine.loop import run

    cfg = load_config(args.config, args.overrides)
    out = Path(args.out) if args.out else _default_out(args.config, cfg.name)
    if args.resume and not args.out:
        raise ValueError("--resume needs --out DIR (the run directory to continue)")
    base = _check_out(out)
    bar = tqdm(total=cfg.rounds, desc="rounds", unit="rd", file=sys.stderr,
               disable=args.quiet, dynamic_ncols=True)
    last_acc: list[float] = []

    def progress(state: Any, m: dict[str, Any]) -> None:
        if bar.n == 0 and state.next_round > 1:
            bar.update(state.next_round - 1)  # resumed
        if "test_acc" in m:
            last_acc[:] = [m["test_acc"]]
        post = {"acc": f"{last_acc[0]:.4f}" if last_acc else "-",
                "up": _fmt_bytes(m["uplink_bytes_total"]),
                "down": _fmt_bytes(m["downlink_bytes_total"])}
        bar.set_postfix(post, refresh=False)
        bar.update(1)

    try:
        result = run(cfg, out=out, resume=args.resume, callbacks=[progress])
    except BaseException:
        _remove_new_dirs(out, base)
        raise
    finally:
        bar.close()
    s = result.summary
    rows = [
        ("rounds", f"{s['rounds']}"),
        ("test accuracy", f"{s.get('test_acc', float('nan')):.4f}"),
        ("test loss", f"{s.get('test_loss', float('nan')):.4f}"),
        ("client acc mean ± std", f"{s.get('client_acc_mean', float('nan')):.4f} ± "
                                  f"{s.get('client_acc_std', float('nan')):.4f}"),
        ("client acc worst 10 %", f"{s.get('client_acc_worst10', float('nan')):.4f}"),
        *([("personal acc mean ± std", f"{s['personal_acc_mean']:.4f} ± "
                                       f"{s['personal_acc_std']:.4f}"),
           ("personal acc worst 10 %", f"{s['personal_acc_worst10']:.4f}")]
          if "personal_acc_mean" in s else []),
        ("uplink total", _fmt_bytes(s["uplink_bytes_total"])),
        ("downlink total", _fmt_bytes(s["downlink_bytes_total"])),
        ("rejected updates", f"{s['rejected_updates_total']}"),
        # shown only when something happened: a skipped step or a clipped update
        *([("rejected rounds (step skipped)", f"{s['rejected_rounds_total']}")]
          if s.get("rejected_rounds_total") else []),
        *([("clipped updates", f"{s['clipped_updates_total']}")]
          if s.get("clipped_updates_total") else []),
        ("backend", f"{s.get('backend', '')}"),
        ("wall time", f"{s['wall_s_total']:.1f} s"),
        ("model sha256", s["model_sha256"][:16] + "…"),
    ]
    width = max(len(k) for k, _ in rows)
    print(f"\n{'metric':<{width}}  value\n{'-' * width}  {'-' * 24}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"\nrun directory: {result.run_dir}")
    return 0


def _cmd_datasets(args: argparse.Namespace) -> int:
    from fedloom.data.sources import list_sources

    rows = [(s.name, "yes" if s.available() else "no", s.description,
             "" if s.available() else s.install) for s in list_sources()]
    w0 = max(len(r[0]) for r in rows)
    print(f"{'dataset':<{w0}}  here  description / install command")
    for name, here, desc, inst in rows:
        print(f"{name:<{w0}}  {here:<4}  {desc}")
        if inst:
            print(f"{'':<{w0}}        install: {inst}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from fedloom.sweep import run_suite

    suite = run_suite(args.suite, workers=args.workers,
                      log=lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", flush=True),
                      report_only=args.report_only)
    if suite.doc is not None:
        print(f"report: {suite.doc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedloom", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run an experiment from a YAML config")
    r.add_argument("config", help="YAML config file")
    r.add_argument("overrides", nargs="*", help="dotted overrides, e.g. client.lr=0.05")
    r.add_argument("--out", help="run directory (default: runs/NAME-TIMESTAMP)")
    r.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest intact checkpoint "
                        "(checkpoints/last.pt, else prev.pt: a warning says which)")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=_cmd_run)
    s = sub.add_parser("sweep", help="run a suite of settings x methods x seeds, then report")
    s.add_argument("suite", help="suite YAML (see fedloom.sweep)")
    s.add_argument("--workers", type=int, default=2, help="parallel single-thread runs")
    s.add_argument("--report-only", action="store_true",
                   help="write the report from the runs that finished; run nothing")
    s.set_defaults(func=_cmd_sweep)
    d = sub.add_parser("datasets", help="list datasets, whether they are here, how to install")
    d.set_defaults(func=_cmd_datasets)
    return p


def main(argv: list[str] | None = None) -> int:
    from fedloom.config import ConfigError
    from fedloom.data.partition import PartitionError
    from fedloom.data.sources import DatasetUnavailable

    logging.basicConfig(level=logging.WARNING, format="fedloom: %(message)s")
    logging.getLogger("fedloom").setLevel(logging.INFO)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ConfigError, DatasetUnavailable, PartitionError, ValueError) as e:
        print(f"fedloom: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedloom: interrupted (continue with --resume --out DIR)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
