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
evaluation (``val_cohort_size=0``), as no framework evaluates here. One
process: pfl's multi-process simulation needs a distributed launcher
(Horovod or ``torch.distributed``) and shards users across processes; on two
cores it is left at pfl's default of one worker.

    python benchmarks/peer_pfl.py --spec DIR [--final W.pt] [--rounds N] [--threads N]
        [--no-dropout]
"""

from __future__ import annotations

import itertools
import logging
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

    # pfl asks the module for its loss and metrics
    def loss(self, inputs, targets, eval=False):  # pfl's keyword
        self.eval() if eval else self.train()
        return torch.nn.functional.cross_entropy(self(inputs), targets)

    @torch.no_grad()
    def metrics(self, inputs, targets, eval=True):
        self.eval() if eval else self.train()
        summed = torch.nn.functional.cross_entropy(self(inputs), targets, reduction="sum")
        return {"loss": Weighted(summed.item(), len(targets))}

    import types
    net.loss = types.MethodType(loss, net)
    net.metrics = types.MethodType(metrics, net)

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
    pacer = peer_common.Pacer(rounds)

    class Pace(TrainingProcessCallback):
        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            pacer.round_done()
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
    if pacer.done != rounds:
        print(f"pfl: {pacer.done} of {rounds} rounds ran", file=sys.stderr)
        return 1
    peer_common.save_final(args.final, net)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
