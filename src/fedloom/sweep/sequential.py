"""The sequential protocol: seeds go where the claims are still undecided.

With ``seeds: {min: 3, max: 12, batch: 2}`` the seeds are 1 … ``max`` in that order
and a (setting, method) runs a prefix of them. :func:`sequential_runs`:

1. every (setting, method) gets the first ``min`` seeds; they run;
2. every claim cell is computed again, on the anytime-valid confidence sequence
   (:mod:`fedloom.report.sequential`: the interval stays valid however many looks
   are taken and wherever the sweep stops);
3. a (setting, method pair) of which some cell is still **no evidence**, or
   **inconsistent** (its sequence has missed: no verdict from it), and whose
   shared seeds are fewer than ``max`` is *open*: both methods get seeds up to the
   pair's count + ``batch`` (at most ``max``); decided pairs get nothing more;
4. until no pair is open.

A method in several pairs runs as many seeds as its most demanding open pair; a
pair's cell uses every seed both methods ran (its "seeds used"). The allocation is
a function of the runs' results only, which are fixed by their configs and seeds,
so a sweep stopped and started again — or run again with a larger ``max`` —
replays the same batches and reuses every run already finished. Methods in no
claim run ``min`` seeds, as do the sensitivity runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedloom.sweep.suite import RunSpec, StaleRunsError, Suite, SweepError


class _NotFinished(Exception):
    """The runs of this batch have not all finished (``--report-only``)."""


def allocated(suite: Suite, specs: list[RunSpec], counts: dict[tuple[str, str], int]
              ) -> list[RunSpec]:
    """The specs within each (setting, method)'s first ``counts`` seeds, in order."""
    index = {s: i for i, s in enumerate(suite.seeds)}
    seq = suite.sequential
    assert seq is not None
    return [sp for sp in specs
            if index[sp.seed] < counts.get((sp.setting, sp.method), seq.min)]


def open_pairs(suite: Suite, specs: list[RunSpec]) -> dict[tuple[str, str, str], int]:
    """{(setting, method, against): seeds used} of the pairs with a claim cell still
    open (no evidence, or inconsistent) on the finished runs of ``specs``."""
    from fedloom.report.claims import claim_table
    from fedloom.report.sequential import UNDECIDED
    from fedloom.report.sweep import _targets, aggregate_runs

    table = aggregate_runs(specs)
    _, _, records = claim_table(suite.report.claims, table, list(suite.settings),
                                _targets(suite, table), sequential=True)
    out: dict[tuple[str, str, str], int] = {}
    for r in records:
        if r["verdict"] in UNDECIDED:
            key = (r["setting"], r["method"], r["against"])
            out[key] = max(out.get(key, 0), int(r["n"]))
    return out


def sequential_runs(suite: Suite, specs: list[RunSpec],
                    run: Callable[[list[RunSpec]], Any],
                    log: Callable[[str], None] = print
                    ) -> tuple[list[RunSpec], SweepError | None]:
    """Run ``specs`` (every seed 1 … max) batch by batch (module docstring) with
    ``run`` (a list of specs; it skips the finished ones); returns the specs the
    protocol asked for and the :class:`SweepError` of a batch whose runs failed (the
    loop stops there: the page is made of what finished, and running the sweep
    again retries them). Stale runs (:class:`StaleRunsError`) propagate; under
    ``--report-only`` (:func:`finished_only`) the loop stops at the first batch
    that has not finished."""
    seq = suite.sequential
    assert seq is not None
    counts: dict[tuple[str, str], int] = {(sp.setting, sp.method): seq.min for sp in specs}
    step = 1
    while True:
        chosen = allocated(suite, specs, counts)
        try:
            run(chosen)
        except _NotFinished:
            return chosen, None
        except StaleRunsError:
            raise
        except SweepError as e:
            return chosen, e
        grown = []
        for (setting, a, b), n in open_pairs(suite, chosen).items():
            if n >= seq.max:
                continue  # open at max: the cell says so
            target = min(n + seq.batch, seq.max)
            for m in (a, b):
                if counts[(setting, m)] < target:
                    counts[(setting, m)] = target
                    grown.append(f"{setting}/{m}→{target}")
        if not grown:
            return chosen, None
        step += 1
        log(f"sequential: batch {step}, for the pairs still open: "
            + ", ".join(dict.fromkeys(grown)) + " seeds")


def finished_only(specs: list[RunSpec]) -> None:
    """A ``run`` for :func:`sequential_runs` that runs nothing: the batches are replayed
    as far as their runs have finished (``--report-only``)."""
    if not all(sp.done for sp in specs):
        raise _NotFinished


def first_seeds(suite: Suite, sens: dict[tuple[str, str], list[tuple[Any, list[RunSpec]]]]
                ) -> dict[tuple[str, str], list[tuple[Any, list[RunSpec]]]]:
    """The sensitivity runs of a sequential suite: its first ``min`` seeds."""
    seq = suite.sequential
    if seq is None:
        return sens
    keep = set(suite.seeds[:seq.min])
    return {k: [(v, [sp for sp in sps if sp.seed in keep]) for v, sps in rows]
            for k, rows in sens.items()}
