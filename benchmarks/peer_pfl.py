"""pfl-research (``pfl``) on a spec of the peers section (:mod:`peer_common`).

Runs in pfl's own virtualenv. Written with pfl's public API, as its
documentation sets up a simulation: a ``torch.nn.Module`` with ``loss`` and
``metrics`` inside :class:`pfl.model.pytorch.PyTorchModel` (local optimiser
``torch.optim.SGD``; central optimiser SGD at learning rate 1, so the model
step is the averaged model difference), a :class:`pfl.data.FederatedDataset`
whose user sampler hands out the spec's cohorts in order, each user a
:class:`pfl.data.Dataset` of that client's samples in fedloom's order for the
round (pfl's ``Dataset.iter`` slices batches in order, without shuffling, so
its batches are fedloom's), :class:`pfl.aggregate.simulate.SimulatedBackend`,
:class:`pfl.algorithm.FederatedAveraging` with ``NNAlgorithmParams`` and
``NNTrainHyperParams``, and a ``TrainingProcessCallback`` whose
``after_central_iteration`` reports the round and waits for the next ``go``.

Departures, stated: pfl evaluates every user of the first iteration before and
after its training (``iteration % evaluation_frequency == 0`` at iteration 0);
that is in its launch → end of round 1, not in its round times. No central
evaluation (``val_cohort_size=0``), as no framework evaluates here.

Several workers: pfl's multi-process simulation runs under torch's own launcher
(``python -m torch.distributed.run --standalone --nproc-per-node N
peer_pfl.py …``; pfl sees ``TORCHELASTIC_RUN_ID``, joins a ``gloo`` process
group and sums the workers' aggregates with ``all_reduce``). pfl's user
sampler calls the spec's sampler ``N`` times per user and gives worker ``r``
the ``r``-th draw, so the workers together train exactly the spec's cohort
(when ``N`` divides the cohort; otherwise the driver stops with exit 2).
Worker 0 alone speaks the round protocol; the others wait for it at a barrier
after each round, so no worker starts a round before its ``go``.

    python benchmarks/peer_pfl.py --spec DIR [--final W.pt] [--rounds N] [--threads N]
        [--no-dropout]
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import peer_common
import torch


def main(argv: list[str] | None = None) -> int:
    p = peer_common.arg_parser()
    p.add_argument("--threads", type=int, default=None, help="torch's intra-op threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec, x, y = peer_common.load_spec(args.spec)
    rounds, m = args.rounds or len(spec["cohorts"]), spec["per_round"]

    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Weighted
    from pfl.model.pytorch import PyTorchModel

    logging.getLogger("pfl").setLevel(logging.WARNING)
    net = peer_common.build_model(spec, dropout=not args.no_dropout)

    net = peer_common.pfl_methods(net, Weighted)  # pfl asks the module for its loss and metrics

    # user j of the run is client cohorts[j // m][j % m] with that round's order
    counter = itertools.count()

    def make_user(j: int) -> Dataset:
        r, pos = divmod(j, m)
        xs, ys = peer_common.ordered(spec, x, y, r, pos)
        return Dataset(raw_data=[xs, ys], user_id=str(int(spec["cohorts"][r][pos])))

    train = FederatedDataset(make_user, lambda: next(counter))
    val = FederatedDataset(lambda j: Dataset(raw_data=[x[:1], y[:1]]), lambda: 0)
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0))
    # under torch.distributed.run (pfl joined the process group when it was imported)
    launched = "TORCHELASTIC_RUN_ID" in os.environ
    rank = int(os.environ["RANK"]) if launched else 0
    workers = int(os.environ["WORLD_SIZE"]) if launched else 1
    if m % workers:  # pfl hands worker r users r, r + N, …: a round must split evenly
        print(f"pfl: {m} clients a round do not split over {workers} workers", file=sys.stderr)
        return 2
    pacer = peer_common.Pacer(rounds) if rank == 0 else None
    done = [0]

    class Pace(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            if pacer is not None:
                pacer.round_done()
            done[0] += 1
            if workers > 1:
                torch.distributed.barrier()
            return False, type(aggregate_metrics)()

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds,
                                           evaluation_frequency=10**9,
                                           train_cohort_size=m, val_cohort_size=0),
        backend=SimulatedBackend(training_data=train, val_data=val, postprocessors=[]),
        model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=spec["lr"],
                                              local_num_epochs=spec["epochs"],
                                              local_batch_size=spec["batch"]),
        model_eval_params=NNEvalHyperParams(local_batch_size=1000),
        callbacks=[Pace()])
    if done[0] != rounds:
        print(f"pfl: {done[0]} of {rounds} rounds ran (worker {rank})", file=sys.stderr)
        return 1
    if rank == 0:
        peer_common.save_final(args.final, net)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
