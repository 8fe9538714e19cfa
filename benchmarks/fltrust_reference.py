"""FLTrust against the public PyTorch code of zhmzm/FLAME (``utils/defense.py``,
``fltrust(params, central_param, global_parameters, args)``, commit fd4cef2): its
per-key sum of ``ReLU(cos) · ‖g_0‖/‖g_i‖ · g_i`` over the trust total, added to the
global parameters times ``args.server_lr`` (it returns them unchanged when every trust
score is 0).

Its file is loaded as it is, with two stand-ins so it imports on a CPU machine:
``hdbscan`` (imported at its top, unused by ``fltrust``) an empty module, and
``torch.nn.Module.cuda`` the identity (its ``CosineSimilarity(...).cuda()``). On 40
seeded cohorts (8 to 15 rows of d = 500 in three keys, float64: honest rows around a
direction, sign-flipped and scaled attackers, a reference near the honest direction)
and 5 cohorts with no positive cosine, fedloom's ``fltrust`` direction is compared with
the code's new parameters from zero; the largest difference is printed::

    git clone https://github.com/zhmzm/FLAME /tmp/FLAME
    python benchmarks/fltrust_reference.py /tmp/FLAME/utils/defense.py
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import types
from pathlib import Path

import torch

from fedloom import CohortInfo, make_aggregator

KEYS = (("a.weight", (20, 20)), ("a.bias", (20,)), ("b.weight", (80,)))


def _load(path: Path) -> types.ModuleType:
    sys.modules.setdefault("hdbscan", types.ModuleType("hdbscan"))
    torch.nn.Module.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    spec = importlib.util.spec_from_file_location("flame_defense", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _as_dict(row: torch.Tensor) -> dict[str, torch.Tensor]:
    out, at = {}, 0
    for name, shape in KEYS:
        n = int(torch.tensor(shape).prod())
        out[name] = row[at : at + n].reshape(shape).clone()
        at += n
    return out


def _cohort(seed: int, hopeless: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    d = sum(int(torch.tensor(s).prod()) for _, s in KEYS)
    m = 8 + seed % 8
    base = torch.randn(d, generator=gen, dtype=torch.float64)
    rows = base + torch.randn(m, d, generator=gen, dtype=torch.float64)
    bad = max(1, m // 4)
    rows[:bad] = -(1 + 9 * torch.rand(bad, 1, generator=gen, dtype=torch.float64)) * rows[:bad]
    rows[bad] = 1e4 * rows[bad]  # a scaling attacker
    ref = base + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
    if hopeless:  # every row opposite the reference
        rows = -rows.abs() * ref.sign()
    return rows, ref


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("defense", type=Path, help="zhmzm/FLAME's utils/defense.py")
    args = p.parse_args()
    theirs = _load(args.defense)
    ours = make_aggregator("fltrust")
    worst, skipped = 0.0, 0
    for seed in range(45):
        hopeless = seed >= 40
        rows, ref = _cohort(seed, hopeless)
        zero = {k: torch.zeros(s, dtype=torch.float64) for k, s in KEYS}
        got = theirs.fltrust([_as_dict(r) for r in rows], _as_dict(ref), zero,
                             types.SimpleNamespace(server_lr=1.0))
        got_row = torch.cat([got[k].reshape(-1) for k, _ in KEYS])
        info = CohortInfo(clients=torch.arange(len(rows)), round=0, num_clients=len(rows),
                          reference=ref)
        try:
            out, _, _ = ours(rows, torch.ones(len(rows), dtype=torch.float64), None, info=info)
        except ValueError:  # fedloom skips the round's step: the model stays where it is
            out = torch.zeros_like(got_row)
            skipped += 1
        worst = max(worst, float((out - got_row).abs().max()))
    print(json.dumps({"cohorts": 45, "no_trust_cohorts": skipped, "max_abs_diff": worst}))


if __name__ == "__main__":
    main()
