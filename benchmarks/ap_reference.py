"""Reference values of pfl-research's averaged precision (FLAIR's macro and micro AP,
``benchmarks/model/numpy/metrics.py``: ``AveragedPrecision`` over Keras' 200 threshold
buckets) on seeded multi-label scores; tests/test_published_models.py checks
:func:`fedloom.metrics.averaged_precision` against them.

pfl-research's benchmark code is not a package: give its checkout (a clone of
github.com/apple/pfl-research)::

    python benchmarks/ap_reference.py --pfl-research ~/src/pfl-research
    # writes tests/data/averaged_precision_reference.json

The metrics module subclasses ``pfl.metrics.MetricValue`` and ``Weighted``; where the
``pfl`` package is not installed, this script stands two empty base classes in for
them (they carry no arithmetic: every number comes from the module's own
``BucketConfusionMatrix`` and ``AveragedPrecision``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "averaged_precision_reference.json"


def _pfl_metrics(checkout: Path) -> types.ModuleType:
    if importlib.util.find_spec("pfl") is None:
        stub = types.ModuleType("pfl.metrics")

        class MetricValue:
            pass

        class Weighted(MetricValue):
            def __init__(self, weighted_value: float, weight: float) -> None:
                self._weighted_value, self._weight = weighted_value, weight

        stub.MetricValue, stub.Weighted = MetricValue, Weighted  # type: ignore[attr-defined]
        sys.modules["pfl"] = types.ModuleType("pfl")
        sys.modules["pfl.metrics"] = stub
    path = checkout / "benchmarks" / "model" / "numpy" / "metrics.py"
    spec = importlib.util.spec_from_file_location("pfl_benchmark_metrics", path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cases() -> list[tuple[np.ndarray, np.ndarray]]:
    """Twelve (scores, multi-hot) draws: sizes 1..40 x 1..8, ties (scores rounded to
    0.05) in every third, scores of exactly 0 and 1 in every fourth, a class
    without positives where one falls out."""
    rng = np.random.default_rng(57)
    out = []
    for i in range(12):
        n, c = int(rng.integers(1, 41)), int(rng.integers(1, 9))
        y = (rng.random((n, c)) < rng.uniform(0.1, 0.6)).astype(np.int64)
        s = rng.random((n, c))
        if i % 3 == 0:
            s = np.round(s * 20) / 20
        if i % 4 == 0:
            s[0, :] = 1.0
            s[-1, :] = 0.0
        out.append((s, y))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pfl-research", type=Path, required=True, help="a pfl-research checkout")
    args = ap.parse_args()
    mod = _pfl_metrics(args.pfl_research)
    rows = []
    for s, y in cases():
        rows.append({
            "scores": s.tolist(), "targets": y.tolist(),
            "macro_ap": float(mod.AveragedPrecision(y_true=y, y_pred=s,
                                                    multi_label=True).overall_value),
            "micro_ap": float(mod.AveragedPrecision(y_true=y, y_pred=s,
                                                    multi_label=False).overall_value)})
    OUT.write_text(json.dumps({"source": "apple/pfl-research benchmarks/model/numpy/metrics.py "
                                         "AveragedPrecision (num_thresholds 200)",
                               "cases": rows}) + "\n")
    print(f"wrote {OUT} ({len(rows)} cases)")


if __name__ == "__main__":
    main()
