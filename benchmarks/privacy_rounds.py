"""The privacy accountant's cost a round in a run: 200 rounds of central DP on digits
(10 clients, 4 a round), accounted as a deployment of 100 clients a round out of
10,000 (rate 0.01, z = 1, fixed-size sampling: the PLD of issue 55's example),
evaluated every 20 rounds, against the same run without privacy. Prints wall and CPU
seconds of each run, a round, and the ε at round 200.

    OMP_NUM_THREADS=1 python benchmarks/privacy_rounds.py

(``PYTHONPATH=<another checkout>/src`` in front times that checkout's engine.)
"""

from __future__ import annotations

import time

import fedloom

ROUNDS = 200
BASE = {"name": "bench", "seed": 3, "rounds": ROUNDS,
        "data": {"name": "digits", "num_clients": 10,
                 "partition": {"name": "dirichlet", "options": {"alpha": 0.5, "min_samples": 20}}},
        "model": {"name": "mlp", "options": {"hidden": [16]}},
        "cohort": {"size": 4}, "client": {"lr": 0.1, "batch_size": 16, "epochs": 1},
        "eval": {"every": 20}, "checkpoint": {"every": 0}}
DP = ["privacy.mode=central", "privacy.noise_multiplier=1.0", "privacy.delta=1e-6",
      "privacy.accounting_population=10000", "privacy.accounting_cohort=100"]


def main() -> None:
    for name, over in (("none", []), ("central", DP)):
        t, c = time.perf_counter(), time.process_time()
        res = fedloom.run(dict(BASE), over)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        eps = [m.get("dp_epsilon") for m in res.metrics]
        print(f"{name}: wall {wall:.1f} s ({wall / ROUNDS * 1000:.0f} ms a round), "
              f"cpu {cpu:.1f} s ({cpu / ROUNDS * 1000:.0f} ms a round), "
              f"epsilon at round {ROUNDS}: {eps[-1]}, "
              f"rounds with epsilon: {sum(e is not None for e in eps)}", flush=True)


if __name__ == "__main__":
    main()
