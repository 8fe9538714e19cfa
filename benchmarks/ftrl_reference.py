"""Reference values of pfl 0.6's banded matrix factorization (``pfl.privacy.ftrl_mechanism``):
for a few (rounds T, min_separation s, q), pfl's query matrix C (its L-BFGS on
``tr(AᵀA X⁻¹)`` with ``diag X = 1`` and s−1 bands, then ``C = cholesky(X)``), its
``ForwardSubstitution`` applied to a fixed noise sequence, the noise multiplier its
``BandedMatrixFactorizationMechanism`` takes from a PLD accountant for a target ε over
⌈T/s⌉ compositions, and that accountant's ε at a given z. tests/test_ftrl_reference.py
checks fedloom.ftrl against them.

pfl runs in the peer venv of benchmarks/privacy_reference.py (built there when missing)::

    python benchmarks/ftrl_reference.py            # writes tests/data/ftrl_reference.json

(4 minutes once the venv exists, most of it pfl's factorization). ``--venv DIR``
names another peer venv; ``--compute OUT`` is the step that runs inside it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from privacy_reference import peer_main

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "ftrl_reference.json"
COMMAND = "python benchmarks/ftrl_reference.py"
# (T, min_separation, q, target ε, δ, z for ε)
SETTINGS = [
    (16, 4, 0.1, 2.0, 1e-6, 1.0),
    (32, 8, 0.05, 4.0, 1e-5, 0.8),
    (48, 5, 1.0, 8.0, 1e-5, 2.0),
]
NOISE_DIM = 3       # the fixed noise: T rows of NOISE_DIM values, numpy seed 0


def compute(out: Path) -> None:
    """Inside the peer venv: pfl's C, its online C⁻¹z, its noise and ε per setting."""
    from importlib.metadata import version

    import numpy as np
    import torch
    from pfl.internal.ops import pytorch_ops
    from pfl.internal.ops.selector import set_framework_module
    from pfl.privacy.ftrl_mechanism import (
        BandedMatrixFactorizationMechanism,
        ForwardSubstitution,
    )
    from pfl.privacy.privacy_accountant import PLDPrivacyAccountant

    set_framework_module(pytorch_ops)
    rows = []
    for steps, sep, q, eps, delta, z in SETTINGS:
        def accountant(k: int, q: float = q, eps: float = eps, delta: float = delta
                       ) -> PLDPrivacyAccountant:
            return PLDPrivacyAccountant(num_compositions=k, sampling_probability=q,
                                        mechanism="gaussian", epsilon=eps, delta=delta)

        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:  # pfl saves C under the working folder
            here = os.getcwd()
            os.chdir(d)
            try:
                mech = BandedMatrixFactorizationMechanism(1.0, steps, sep, accountant)
            finally:
                os.chdir(here)
        secs = time.perf_counter() - t
        c = np.asarray(mech.query_matrix, dtype=np.float64)
        noise = np.random.default_rng(0).normal(size=(steps, NOISE_DIM))
        fs = ForwardSubstitution(c, sep - 1)
        solved = np.array([np.asarray(fs.step(torch.tensor(noise[i], dtype=torch.float32)))
                           for i in range(steps)])  # pfl holds C in float32
        k = -(-steps // sep)
        eps_at_z = PLDPrivacyAccountant(num_compositions=k, sampling_probability=q,
                                        mechanism="gaussian", noise_parameter=z,
                                        delta=delta).epsilon
        row = {"T": steps, "min_separation": sep, "bands": sep - 1, "q": q,
               "epsilon": eps, "delta": delta, "compositions": k,
               "noise_multiplier": float(mech._relative_noise_stddev),
               "z": z, "epsilon_at_z": float(eps_at_z),
               "C": c.tolist(), "noise": noise.tolist(), "C_inv_noise": solved.tolist(),
               "column_norm_max": float(np.linalg.norm(c, axis=0).max())}
        print(json.dumps({k: v for k, v in row.items()
                          if k not in ("C", "noise", "C_inv_noise")}), f"{secs:.0f} s", flush=True)
        rows.append(row)
    out.write_text(json.dumps({
        "command": COMMAND,
        "versions": {p: version(p) for p in ("pfl", "dp-accounting", "torch", "numpy")},
        "python": platform.python_version(),
        "settings": "pfl BandedMatrixFactorizationMechanism(clipping_bound=1, num_iterations=T, "
                    "min_separation=s, PLDPrivacyAccountant(k, q, gaussian, eps, delta)); "
                    "C = its query_matrix (FTRLMatrixFactorizer, prefix-sum workload, "
                    "bandwidth s-1, stop at max|dX| <= 1e-3); C_inv_noise: its "
                    "ForwardSubstitution(C, s-1) on 'noise' (numpy default_rng(0) normals)",
        "rows": rows}, indent=1) + "\n")


def main() -> None:
    peer_main(__doc__, __file__, compute, OUT)


if __name__ == "__main__":
    main()
