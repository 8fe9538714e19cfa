"""Reference ε and noise from the peers' accountants: pfl 0.6's PLD, PRV and RDP
``PrivacyAccountant`` classes and Opacus 1.6's RDP and PRV accountants (Poisson
sampling, add/remove: the one relation both take), on a grid of (q, z, T, δ), and
the noise multiplier each solves for a target ε. tests/test_accounting.py checks
fedloom.accounting against them.

pfl pins dp-accounting < 0.6 and Opacus its own torch, so they run in a peer venv
under /tmp, built here when missing (torch 2.13.0's CPU wheel first, from the index
the Makefile uses, then pfl==0.6.0 and opacus==1.6.0)::

    python benchmarks/privacy_reference.py            # writes tests/data/privacy_reference.json

(85 s once the venv exists, rewriting the committed file byte for byte; building
the venv takes minutes). ``--venv DIR`` names another peer venv; ``--compute OUT``
is the step that runs inside it.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "data" / "privacy_reference.json"
VENV = Path("/tmp/fedloom-privacy-peers")
COMMAND = "python benchmarks/privacy_reference.py"
PINS = ("torch==2.13.0", "pfl==0.6.0", "opacus==1.6.0")

# (q, z, T, δ), with where each row comes from
EPSILON_GRID: list[tuple[float, float, int, float, str]] = [
    (0.01, 1.0, 2000, 1e-6, "issue 55's example: 100 of 10,000 a round, z=1, 2,000 rounds "
                            "(its first setting: fedloom 34.15, pfl PLD 2.955)"),
    (0.01, 1.0, 500, 1e-6, "issue 55's third setting, inferred (fedloom 17.86, pfl PLD 1.580)"),
    (0.1, 1.1, 200, 1e-6, "issue 55's fourth setting, inferred (fedloom 99.49, pfl PLD 9.454)"),
    (0.005, 0.8639, 2000, 1e-6, "pfl's StackOverflow benchmark: 5,000 of 10^6, eps 2 by PLD"),
    (0.1, 1.0, 100, 1e-5, "a small simulation: 10 of 100 a round"),
    (0.002, 2.0, 10000, 1e-6, "a low rate, high noise, many rounds"),
    (0.05, 0.8, 500, 1e-5, "a moderate rate and noise"),
]
# (q, T, target ε, δ)
NOISE_GRID: list[tuple[float, int, float, float, str]] = [
    (0.01, 2000, 3.0, 1e-6, "issue 55: z = 1.039 for eps 3 (RDP)"),
    (0.005, 2000, 2.0, 1e-6, "pfl's StackOverflow point: z = 0.8639 for eps 2 (PLD)"),
    (0.1, 100, 4.0, 1e-5, "a small simulation"),
]


def _pfl(kind: str, **kw: float) -> float:
    from pfl.privacy import privacy_accountant as pa

    cls = {"pld": pa.PLDPrivacyAccountant, "prv": pa.PRVPrivacyAccountant,
           "rdp": pa.RDPPrivacyAccountant}[kind]
    acc = cls(mechanism="gaussian", **kw)
    return float(acc.epsilon if "noise_parameter" in kw else acc.noise_parameter)


def _opacus_epsilon(kind: str, q: float, z: float, steps: int, delta: float) -> float:
    from opacus.accountants import create_accountant

    acc = create_accountant(mechanism=kind)
    acc.history = [(z, q, steps)]
    return float(acc.get_epsilon(delta=delta))


def _opacus_noise(kind: str, q: float, steps: int, eps: float, delta: float) -> float:
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=eps, target_delta=delta, sample_rate=q,
                                      steps=steps, accountant=kind))


def compute(out: Path) -> None:
    """Inside the peer venv: every row, each peer's value and its time."""
    from importlib.metadata import version

    rows, noise = [], []
    for q, z, steps, delta, why in EPSILON_GRID:
        row: dict[str, object] = {"q": q, "z": z, "T": steps, "delta": delta, "why": why}
        for kind in ("pld", "prv", "rdp"):
            row[f"pfl_{kind}"] = _pfl(kind, num_compositions=steps, sampling_probability=q,
                                      noise_parameter=z, delta=delta)
        for kind in ("rdp", "prv"):
            row[f"opacus_{kind}"] = _opacus_epsilon(kind, q, z, steps, delta)
        print(json.dumps(row), flush=True)
        rows.append(row)
    for q, steps, eps, delta, why in NOISE_GRID:
        row = {"q": q, "T": steps, "epsilon": eps, "delta": delta, "why": why}
        for kind in ("pld", "prv", "rdp"):
            row[f"pfl_{kind}"] = _pfl(kind, num_compositions=steps, sampling_probability=q,
                                      epsilon=eps, delta=delta)
        for kind in ("rdp", "prv"):
            row[f"opacus_{kind}"] = _opacus_noise(kind, q, steps, eps, delta)
        print(json.dumps(row), flush=True)
        noise.append(row)
    out.write_text(json.dumps({
        "command": COMMAND,
        "versions": {p: version(p) for p in ("pfl", "opacus", "dp-accounting",
                                             "prv-accountant", "torch", "numpy", "scipy")},
        "python": platform.python_version(),
        "sampling": "Poisson, add/remove neighbours (pfl's and Opacus's accounting)",
        "settings": {
            "pfl": "PrivacyAccountant classes with their defaults: PLD interval 1e-4; "
                   "PRV eps_error 0.07, delta_error 1e-10, the estimate; noise by binary "
                   "search on delta to rtol 1e-3",
            "opacus": "accountants with their defaults: RDP its DEFAULT_ALPHAS; PRV "
                      "eps_error 0.01, delta_error delta/1000, the upper bound; noise by "
                      "get_noise_multiplier (epsilon_tolerance 0.01)"},
        "epsilon": rows, "noise": noise}, indent=1) + "\n")


def _peer_venv(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        pip = [str(py), "-m", "pip", "install", "-q"]
        subprocess.run([*pip, PINS[0]], check=True)  # torch first: the CPU wheel
        subprocess.run([*pip, *PINS[1:]], check=True)
    return py


def peer_main(doc: str, script: str, compute_step: Callable[[Path], None], out: Path) -> None:
    """The command line of a reference script: ``--compute OUT`` runs ``compute_step``
    (inside the peer venv); without it, ``script`` runs itself that way in the peer venv
    (built when missing) and writes ``out``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=VENV)
    ap.add_argument("--compute", type=Path, help="(inside the peer venv) write here")
    args = ap.parse_args()
    if args.compute is not None:
        compute_step(args.compute)
        return
    py = _peer_venv(args.venv)
    t = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([str(py), script, "--compute", str(out)], check=True)
    print(f"wrote {out.relative_to(ROOT)} in {time.perf_counter() - t:.0f} s")


def main() -> None:
    peer_main(__doc__, __file__, compute, OUT)


if __name__ == "__main__":
    main()
