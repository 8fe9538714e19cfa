"""The command line: ``fedloom run | sweep | compare | export | datasets | models |
schema | algorithms`` (``fedloom COMMAND --help`` for each).

Errors in what the user gave (config, overrides, data, run directory) print one
line ``fedloom: error: …`` and exit with status 2; nothing is left behind.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import TypeAlias


    # what add_subparsers returns: each command's parser is added to it
    _Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = ["main"]


def _default_out(config: str, name: str | None) -> Path:
    """``runs/NAME-TIMESTAMP`` (NAME: the config's ``name``, else the file's stem), a
    folder directly under ``runs/``: a name that is not one folder name (``../x``, an
    absolute path, ``a/b`` from an override) is refused, one line naming ``name``."""
    from fedloom.names import path_component

    field = "name (the run folder's name without --out)"
    stem = path_component(name or Path(config).stem, field)
    return Path("runs") / path_component(f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}", field)


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
    directory will be and removed at once. An ``out`` that exists is not probed:
    nothing is made in a directory before it is known to be a run directory
    (the run's lock step tells, in one line).
    """
    import os
    import tempfile

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a directory")
    if out.is_dir():
        return out
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
    from fedloom.engine.runs.loop import run
    from fedloom.runtable import fmt_bytes, summary_rows

    cfg = load_config(args.config, args.overrides)
    from fedloom.device import resolve
    from fedloom.engine.given import refuse_unrecorded

    refuse_unrecorded(args.config, cfg, None, None)  # a run directory of an earlier version

    resolve(cfg.device)  # device=cuda without CUDA: one line, exit 2, before anything starts
    out = Path(args.out) if args.out else _default_out(args.config, cfg.name)
    if args.resume and not args.out:
        raise ValueError("--resume needs --out DIR (the run directory to continue)")
    if args.allow_data_change and not args.resume:
        raise ValueError("--allow-data-change goes with --resume (a new run records its data)")
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
                "up": fmt_bytes(m["uplink_bytes_total"]),
                "down": fmt_bytes(m["downlink_bytes_total"])}
        bar.set_postfix(post, refresh=False)
        bar.update(1)

    from fedloom.engine.runs.checkpoint import RunDirWriteError

    try:
        result = run(cfg, out=out, resume=args.resume, callbacks=[progress],
                     allow_data_change=args.allow_data_change)
    except RunDirWriteError as e:  # e.g. a full disk: the checkpoints so far are kept
        _remove_new_dirs(out, base)
        then = "free some space" if e.full else "make it writable"
        raise RunDirWriteError(f"{e}; {then}, then continue the run with --resume --out "
                               f"{out}") from None
    except BaseException:
        _remove_new_dirs(out, base)
        raise
    finally:
        bar.close()
    rows = summary_rows(result.summary, cfg)
    width = max(len(k) for k, _ in rows)
    print(f"\n{'metric':<{width}}  value\n{'-' * width}  {'-' * 24}")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"\nrun directory: {result.run_dir}")
    # The files a person opens first, as paths from where the command ran.
    assert result.run_dir is not None  # the command always gives the run a directory
    files = [result.run_dir / n for n in ("curves.png", "partition.png", "metrics.csv")]
    for f in (f for f in files if f.is_file()):
        print(f"  {os.path.relpath(f)}")
    return 0


def _cmd_datasets(args: argparse.Namespace) -> int:
    import os

    from fedloom.data.sources import list_sources

    old = os.environ.get("FEDLOOM_DATA")
    if args.root:  # look there instead of $FEDLOOM_DATA / ~/.cache/fedloom/data
        os.environ["FEDLOOM_DATA"] = args.root
    try:
        rows = [(s.name, "yes" if s.available() else "no", s.description,
                 "" if s.available() else s.install, s.where() if s.where else "")
                for s in list_sources()]
    finally:  # the caller's environment as it was (main() runs inside tests too)
        if old is None:
            os.environ.pop("FEDLOOM_DATA", None)
        else:
            os.environ["FEDLOOM_DATA"] = old
    w0 = max(len(r[0]) for r in rows)
    print(f"{'dataset':<{w0}}  here  description / where it is looked for / install")
    for name, here, desc, inst, where in rows:
        print(f"{name:<{w0}}  {here:<4}  {desc}")
        if where:
            print(f"{'':<{w0}}        looked in: {where}")
        if inst:
            print(f"{'':<{w0}}        install: {inst}")
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from fedloom.models.zoo import describe_models

    rows = describe_models()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    w0 = max(len(str(r["name"])) for r in rows)
    print(f"{'model':<{w0}}  {'parameters':>11}  {'input':<9}  description  [model.* options]")
    for r in rows:
        n = r["parameters"]
        shape = "x".join(str(v) for v in r["input"]) or "-"  # type: ignore[attr-defined]
        opts = f"  [{', '.join(r['options'])}]" if r["options"] else ""  # type: ignore[arg-type]
        count = f"{n:,}" if isinstance(n, int) else "-"
        print(f"{r['name']:<{w0}}  {count:>11}  {shape:<9}  {r['description']}{opts}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from fedloom.sweep import SweepError, run_suite

    failed: SweepError | None = None
    try:
        suite = run_suite(args.suite, workers=args.workers,
                          log=lambda s: print(f"[{time.strftime('%H:%M:%S')}] {s}", flush=True),
                          report_only=args.report_only, csv=args.csv)
    except SweepError as e:  # runs failed: the report of the others, then one line
        if e.suite is None:  # nothing to report (e.g. --report-only over stale runs)
            print(f"fedloom: error: {e}", file=sys.stderr)
            return 1
        suite, failed = e.suite, e
    if suite.report_text and suite.report.doc is not None:
        print(f"report: {suite.report.doc}")
    elif suite.report_text:  # no doc: in the suite: the report goes to stdout
        print(suite.report_text)
    if args.csv and suite.report_text:
        print(f"csv: {args.csv}")
    if failed is not None:
        print(f"fedloom: error: {failed}", file=sys.stderr)
        return 1
    return 0


def _at(text: str) -> str | int:
    if text in ("final", "best"):
        return text
    try:
        rnd = int(text)
    except ValueError:
        rnd = 0
    if rnd < 1:
        raise argparse.ArgumentTypeError(f"expected final, best or a round ≥ 1, got {text!r}")
    return rnd


def _max_lines(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a count ≥ 0 (0: all), got {text!r}")
    return n


def _cmd_compare(args: argparse.Namespace) -> int:
    from fedloom.report.compare import DEFAULT_METRICS, compare

    facet = args.facet
    if facet is not None and "none" in facet:
        if len(facet) > 1:
            raise ValueError("--facet none: give it alone (it turns facets off)")
        facet = []
    text, notes = compare(args.runs, metrics=args.metric or DEFAULT_METRICS, at=args.at,
                          target=args.target, target_metric=args.target_metric,
                          group_by=args.group_by, csv_path=args.csv,
                          markdown_path=args.markdown, plots_dir=args.plots,
                          facet=facet, max_lines=args.max_lines, baseline=args.baseline)
    print(text)
    for n in notes:
        print(n)
    return 0


def _config_sections() -> str:
    """``fedloom run --help``'s list of the config's sections and keys, from the
    :class:`~fedloom.config.Config` dataclasses (so it never goes stale)."""
    import dataclasses
    import textwrap
    import typing

    from fedloom.config import Config

    def keys(cls: type) -> list[str]:
        hints = typing.get_type_hints(cls)
        return [f"{f.name}.*" if dataclasses.is_dataclass(hints[f.name]) else f.name
                for f in dataclasses.fields(cls)]

    hints = typing.get_type_hints(Config)
    rows = [("top level", [f.name for f in dataclasses.fields(Config)
                           if not dataclasses.is_dataclass(hints[f.name])])]
    rows += [(f.name, keys(hints[f.name])) for f in dataclasses.fields(Config)
             if dataclasses.is_dataclass(hints[f.name])]
    width = max(len(name) for name, _ in rows) + 2
    lines = ["config sections and keys (set any as SECTION.KEY=VALUE; `fedloom schema` "
             "gives types, defaults and bounds):"]
    for name, ks in rows:
        lines += textwrap.wrap(", ".join(ks), 98, initial_indent=f"  {name + ':':<{width}}",
                               subsequent_indent=" " * (width + 2))
    return "\n".join(lines)


def _cmd_partition(args: argparse.Namespace) -> int:
    from fedloom.config import load_config
    from fedloom.data.heterogeneity import heterogeneity, measures_table, split_counts

    cfg = load_config(args.config, args.overrides)
    counts = split_counts(cfg)
    p = cfg.data.partition
    print(f"{cfg.data.name}, partition {p.name}, seed {cfg.seed}"
          + (f", feature skew {cfg.data.feature.name} (scale {cfg.data.feature.scale:g}; "
             "not in the label measures)" if cfg.data.feature.name != "none" else ""))
    print(measures_table(counts))
    if args.plot:
        from fedloom.report.partition_plot import write_partition_plot

        plot = Path(args.plot)
        if not plot.parent.is_dir():
            raise ValueError(f"--plot: folder {plot.parent} does not exist")
        if write_partition_plot(plot, counts, heterogeneity(counts),
                                f"{cfg.data.name}, {p.name}") is None:
            raise ValueError("--plot: needs matplotlib (pip install 'fedloom[report]')")
        print(f"plot: {plot}")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    import json

    from fedloom.schema import config_schema

    print(json.dumps(config_schema(), indent=2))
    return 0


def _cmd_algorithms(args: argparse.Namespace) -> int:
    from fedloom.report.algorithms import entries, render_markdown, render_text

    if args.markdown:  # built-ins only: the site's algorithm reference
        sys.stdout.write(render_markdown())
    else:  # installed plug-ins too, with where they come from
        sys.stdout.write(render_text(entries(builtin_only=False)))
    return 0


def _version() -> str:
    import platform

    import torch

    from fedloom import __version__

    return f"fedloom {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


def _add_run(sub: _Commands) -> None:
    """The ``run`` command and its options."""
    r = sub.add_parser("run", help="run an experiment from a YAML config",
                       epilog=_config_sections(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("config", help="YAML config file, or the name of a shipped one (quickstart)")
    r.add_argument("overrides", nargs="*", default=[],
                   help="dotted overrides, e.g. client.lr=0.05 (before or after the options)")
    r.add_argument("--out", help="run directory (default: runs/NAME-TIMESTAMP)")
    r.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its newest intact checkpoint "
                        "(checkpoints/last.pt, else prev.pt: a warning says which)")
    r.add_argument("--allow-data-change", action="store_true",
                   help="with --resume: continue on data other than the run was trained on "
                        "(refused otherwise); data.json notes the round it changed at")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=_cmd_run)


def _add_sweep(sub: _Commands) -> None:
    """The ``sweep`` command and its options."""
    s = sub.add_parser("sweep", help="run a suite of settings x methods x seeds, then report")
    s.add_argument("suite", help="suite YAML (see fedloom.sweep)")
    s.add_argument("--workers", type=int, default=2, help="parallel single-thread runs")
    s.add_argument("--report-only", action="store_true",
                   help="make the report from the runs that finished; run nothing "
                        "(printed when the suite has no doc:)")
    s.add_argument("--csv", metavar="FILE", help="also write the results tables as CSV")
    s.set_defaults(func=_cmd_sweep)


def _add_compare(sub: _Commands) -> None:
    """The ``compare`` command and its options."""
    c = sub.add_parser("compare", help="tables and plots across run directories "
                                       "(mean ± sd over seeds)",
                       description="Compare runs: runs whose configs differ only by seed "
                                   "form one group (see fedloom.report.compare).")
    c.add_argument("runs", nargs="+", metavar="RUN_OR_SWEEP_DIR",
                   help="run directories, or folders holding them (a sweep's out)")
    c.add_argument("--metric", action="extend", nargs="+", metavar="NAME",
                   help="metrics to show (default: test_acc client_acc_mean "
                        "client_acc_worst10)")
    c.add_argument("--at", type=_at, default="final", metavar="final|best|ROUND",
                   help="each run's final value, its best over rounds, or at round ROUND")
    c.add_argument("--target", type=float, metavar="VALUE",
                   help="rounds and uplink bytes to first reach VALUE of --target-metric")
    c.add_argument("--target-metric", default="test_acc", metavar="NAME")
    c.add_argument("--group-by", nargs="+", metavar="KEY",
                   help="group by these dotted config keys instead of 'all but the seed'")
    c.add_argument("--csv", metavar="FILE", help="also write the table as CSV")
    c.add_argument("--markdown", metavar="FILE", help="also write the table as markdown")
    c.add_argument("--plots", metavar="DIR",
                   help="write curves.png (the first --metric, or --target-metric with "
                        "--target, vs round and vs uplink) and client_acc_cdf.png there "
                        "(matplotlib)")
    c.add_argument("--facet", nargs="+", metavar="KEY",
                   help="one row of plots per value of these dotted config keys (default: "
                        "the data.* keys that differ between groups; 'none': one)")
    c.add_argument("--baseline", metavar="LABEL",
                   help="compare every group with this one seed by seed: mean paired "
                        "difference, 95 %% t-interval and verdict (better/worse/no evidence)")
    c.add_argument("--max-lines", type=_max_lines, default=8, metavar="N",
                   help="lines a plot's panel draws at most, the best by the plotted "
                        "metric's final mean; the rest are named in the output "
                        "(default 8; 0: all)")
    c.set_defaults(func=_cmd_compare)


class _IntermixedParser(argparse.ArgumentParser):
    """A command's parser that takes its options and positionals in any order.

    Plain argparse fills every positional in the first run of them it sees, so in
    ``run CONFIG --out X k=v`` the overrides (``nargs="*"``) are already taken,
    empty, by ``CONFIG`` and ``k=v`` is "unrecognized". ``parse_known_intermixed_args``
    reads the options first, then the positionals from what is left; it calls
    ``parse_known_args`` itself (twice), hence the flag that lets those calls through.
    """

    _inside = False

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None
                         ) -> tuple[Any, list[str]]:
        if self._inside:
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


def build_parser() -> argparse.ArgumentParser:
    from fedloom.export import add_export_command

    p = argparse.ArgumentParser(prog="fedloom")
    p.add_argument("--version", action="version", version=_version())
    # Every command's options and positionals (a run's overrides) in any order.
    sub: _Commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                      parser_class=_IntermixedParser)
    _add_run(sub)
    _add_sweep(sub)
    _add_compare(sub)
    add_export_command(sub)
    d = sub.add_parser("datasets", help="list datasets, whether they are here, how to install")
    d.add_argument("--root", help="look for on-disk datasets here (default: $FEDLOOM_DATA, "
                   "else ~/.cache/fedloom/data)")
    d.set_defaults(func=_cmd_datasets)
    mo = sub.add_parser("models", help="list models, their parameter counts and options")
    mo.add_argument("--json", action="store_true", help="machine-readable output")
    mo.set_defaults(func=_cmd_models)
    pa = sub.add_parser("partition", help="the split a config makes: heterogeneity "
                                          "measures (and --plot FILE), no training")
    pa.add_argument("config", help="YAML config file")
    pa.add_argument("overrides", nargs="*", default=[],
                    help="dotted overrides, e.g. data.partition.k=2")
    pa.add_argument("--plot", metavar="FILE", help="also write the picture (PNG)")
    pa.set_defaults(func=_cmd_partition)
    sc = sub.add_parser("schema", help="print the config's JSON Schema (editors complete keys "
                                       "with it: fedloom schema > fedloom.schema.json)")
    sc.set_defaults(func=_cmd_schema)
    al = sub.add_parser("algorithms", help="list aggregators, compressors, feedback policies, "
                                           "methods … with their options (plug-ins too)")
    al.add_argument("--markdown", action="store_true",
                    help="the built-ins' reference with papers, public code and departures "
                         "(the site's algorithm reference, docs/reference/algorithms.md)")
    al.set_defaults(func=_cmd_algorithms)
    # Every command, named where `fedloom --help` starts.
    p.description = ("Federated learning on heterogeneous clients over slow links. "
                     f"Commands: {', '.join(sub.choices)}; `fedloom COMMAND --help` for each.")
    return p


def main(argv: list[str] | None = None) -> int:
    # As a process of its own (the console script, `python -m fedloom.cli`; argv is
    # None), the cyclic garbage collector is off while torch and fedloom are imported
    # and what the imports made is then frozen out of its later passes (gc.freeze):
    # the imports create some 170,000 long-lived objects, and the collector's full
    # passes over them as they are made found nothing to free and cost about a sixth of
    # `import torch` (11-19 % of its CPU seconds in 4 interleaved pairs on the shared
    # 2-core machine; benchmarks/results.md, the start-up goal).
    # Called with argv (the tests, a sweep's worker) the caller's heap is left alone.
    own = argv is None
    if own:
        gc.disable()
    try:
        from fedloom.config import ConfigError
        from fedloom.data.partition import PartitionError
        from fedloom.data.sources import DatasetUnavailable

        logging.basicConfig(level=logging.WARNING, format="fedloom: %(message)s")
        logging.getLogger("fedloom").setLevel(logging.INFO)
        args = build_parser().parse_args(argv)
        if own and args.func is _cmd_run:
            import fedloom.engine.runs.loop  # noqa: F401  (imported here, while collection is off)
    finally:
        if own:
            gc.freeze()
            gc.enable()
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
