"""Groups of runs (the seeds of one experiment) and the tables that compare them.

Groups. Runs whose resolved configs are equal except for ``seed``, ``name``,
``logging`` and ``checkpoint`` (none of which changes what is computed) form one
group: the seeds of one experiment. A config is first brought to this version's
schema (missing keys get their defaults) so that runs written before a key
existed still group with new ones. ``--group-by KEY …`` groups by those dotted
keys instead (runs that differ elsewhere are then pooled). A group is labelled
by the keys whose values differ between groups.

Targets. With a target ``T`` on a metric (default ``test_acc``), a run reaches
it at the first logged round whose value is ``>= T``; the group shows the mean
± sd of that round and of ``uplink_bytes_total`` at that round over the runs
that reach it, with ``(k/n)`` when some do not.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedloom.files import write_output
from fedloom.report.compare.runs import (
    Run,
    first_reach,
    mean_sd,
    metric_value,
    run_stats,
)

# Keys of a resolved config that do not change what a run computes.
IGNORED_KEYS = ("seed", "name", "logging", "checkpoint")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))  # an empty mapping sets nothing
        else:
            # hashable and printable: a list as its JSON text
            out[key] = json.dumps(v) if isinstance(v, list) else v
    return out


def _normalised(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` in this version's schema (defaults filled in), else as it is. Read
    as data: a plug-in it names is compared by its name and options, never imported
    (a run folder's ``config.yaml`` may be anyone's; reading results runs no code)."""
    if not config:
        return config
    from fedloom.config import ConfigError, config_from_dict, config_to_dict

    try:
        return config_to_dict(config_from_dict(config, plugins=False))
    except (ConfigError, ValueError, TypeError):
        return config


@dataclass
class Group:
    """Runs of one experiment (they differ by seed only, or share ``--group-by``)."""

    keys: dict[str, Any]     # the dotted keys that tell this group from the others
    runs: list[Run]
    label: str = ""

    @property
    def seeds(self) -> list[Any]:
        return [r.seed for r in self.runs]


def group_runs(runs: Sequence[Run], by: Sequence[str] | None = None) -> list[Group]:
    """Group ``runs`` (module docstring), in order of each group's first run."""
    flat = []
    for r in runs:
        f = _flatten(_normalised(r.config))
        for k in list(f):
            if k.split(".")[0] in IGNORED_KEYS:
                del f[k]
        flat.append(f)
    if by:
        for b in by:
            if not any(b in f for f in flat):
                raise ValueError(f"--group-by {b}: no run's config has that key")
        idents = [tuple((b, f.get(b)) for b in by) for f in flat]
    else:
        idents = [tuple(sorted(f.items(), key=lambda kv: kv[0])) for f in flat]
    order: dict[tuple[Any, ...], list[int]] = {}
    for i, ident in enumerate(idents):
        order.setdefault(ident, []).append(i)
    firsts = [flat[ix[0]] for ix in order.values()]
    if by:
        differ = list(by)
    else:
        all_keys: dict[str, None] = {}
        for f in firsts:
            all_keys.update(dict.fromkeys(f))
        differ = [k for k in all_keys if len({json.dumps(f.get(k), default=str)
                                               for f in firsts}) > 1]
    groups = []
    for ix, first in zip(order.values(), firsts, strict=True):
        keys = {k: first.get(k) for k in differ}
        # by seed within a group (seed10 after seed2); runs without one keep their place
        members = sorted((runs[i] for i in ix), key=lambda r: (
            not isinstance(r.seed, int), r.seed if isinstance(r.seed, int) else 0))
        label = _label(keys, differ) or str(members[0].config.get("name")
                                            or members[0].path.name)
        groups.append(Group(keys, members, label))
    return groups


def _show(v: Any) -> str:
    return "–" if v is None else f"{v:g}" if isinstance(v, float) else str(v)


def _label(keys: dict[str, Any], differ: Sequence[str]) -> str:
    """A short legend label: ``craft, clip_norm=1`` for ``aggregator.name=craft,
    server.clip_norm=1.0`` (a ``*.name`` key by its value, others by their last
    component unless two differing keys share it); keys the group lacks are left out."""
    tails = [k.rsplit(".", 1)[-1] for k in differ]
    parts = []
    for k, v in keys.items():
        if v is None:
            continue
        tail = k.rsplit(".", 1)[-1]
        if tail == "name" and "." in k:
            parts.append(_show(v))
        else:
            parts.append(f"{tail if tails.count(tail) == 1 else k}={_show(v)}")
    return ", ".join(parts)



# ------------------------------------------------------------------------ tables
def _fmt_value(mean: float, sd: float, k: int, n: int) -> str:
    if k == 0 or math.isnan(mean):
        return "–"
    if abs(mean) >= 1e5:
        text = f"{mean:,.0f}" + (f" ± {sd:,.0f}" if k > 1 else "")
    else:
        text = f"{mean:.4g}" + (f" ± {sd:.2g}" if k > 1 else "")
    return text + (f" ({k}/{n})" if k < n else "")


def compare_table(groups: Sequence[Group], metrics: Sequence[str], at: str | int = "final",
                  target: float | None = None, target_metric: str = "test_acc"
                  ) -> tuple[list[str], list[list[str]], list[dict[str, Any]]]:
    """``(header, text rows, CSV records)`` of the comparison (module docstring)."""
    key_cols = list(groups[0].keys) if groups and groups[0].keys else ["run"]
    header = [*key_cols, "seeds"]
    at_label = at if at in ("final", "best") else f"round {at}"
    header += [f"{m} ({at_label})" for m in metrics]
    if target is not None:
        header += [f"rounds to {target_metric} ≥ {target:g}", "uplink MB to target"]
    rows: list[list[str]] = []
    records: list[dict[str, Any]] = []
    for g in groups:
        stats = [run_stats(r) for r in g.runs]
        n = len(g.runs)
        cells = ([_show(g.keys[k]) for k in key_cols] if g.keys else [g.label])
        cells.append(",".join(str(s) for s in g.seeds))
        rec: dict[str, Any] = dict(g.keys) if g.keys else {"run": g.label}
        rec.update({"runs": n, "seeds": " ".join(str(s) for s in g.seeds)})
        for m in metrics:
            vals = [metric_value(r, m, at, s) for r, s in zip(g.runs, stats, strict=True)]
            k = sum(not math.isnan(v) for v in vals)
            mu, sd = mean_sd(vals)
            cells.append(_fmt_value(mu, sd, k, n))
            rec.update({f"{m}_mean": mu, f"{m}_sd": sd, f"{m}_n": k})
        if target is not None:
            hits = [h for h in (first_reach(r.metrics, target_metric, target) for r in g.runs)
                    if h is not None]
            rmu, rsd = mean_sd([h[0] for h in hits])
            bmu, bsd = mean_sd([h[1] for h in hits])
            if hits:
                cells.append(_fmt_value(rmu, rsd, len(hits), n))
                cells.append(_fmt_value(bmu / 1e6, bsd / 1e6, len(hits), n))
            else:
                cells += ["not reached", "–"]
            rec.update({"target": target, "target_metric": target_metric,
                        "target_reached": len(hits),
                        "rounds_to_target_mean": rmu, "rounds_to_target_sd": rsd,
                        "uplink_bytes_to_target_mean": bmu, "uplink_bytes_to_target_sd": bsd})
        rec["paths"] = ";".join(str(r.path) for r in g.runs)
        rows.append(cells)
        records.append(rec)
    return header, rows, records


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Aligned plain-text columns (a terminal table)."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    lines = ["  ".join(f"{h:<{w}}" for h, w in zip(header, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(f"{c:<{w}}" for c, w in zip(r, widths, strict=True)).rstrip()
              for r in rows]
    return "\n".join(lines)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def esc(c: str) -> str:
        return str(c).replace("|", "\\|")

    lines = ["| " + " | ".join(esc(h) for h in header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: str | Path, records: Sequence[dict[str, Any]]) -> Path:
    """``records`` as CSV; columns are the union of their keys in first-seen order."""
    p = Path(path)
    cols: dict[str, None] = {}
    for rec in records:
        cols.update(dict.fromkeys(rec))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(cols), lineterminator="\n")
    w.writeheader()
    for rec in records:
        w.writerow({k: ("" if v is None else v) for k, v in rec.items()})
    return write_output(p, buf.getvalue())  # replaced whole: never written through a link

