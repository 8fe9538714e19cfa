"""FLGo (``flgo``) on a spec of the peers section (:mod:`peer_common`).

Runs in FLGo's own virtualenv. Written with FLGo's public API as its
tutorials build a custom run: ``flgo.gen_benchmark_from_file`` on a
configuration file that defines ``train_data`` (a ``TensorDataset`` of the
spec's arrays), ``test_data`` and ``get_model``; ``flgo.gen_task_by_`` with a
``BasicPartitioner`` that gives client ``k`` rows ``k·n … (k+1)·n − 1``
(``--prepare``: FLGo keeps tasks on disk, so this is done once, outside the
timed launch); then ``flgo.init(task, algorithm, option)`` and ``runner.run()``
with FedAvg as FLGo's own ``BasicServer``/``BasicClient`` (uniform
aggregation, SGD). Two methods are overridden, as FLGo's algorithms do:
``Server.sample`` returns the spec's cohort of the round, and ``Client.train``
hands FLGo's own data loader that round's sample order (a ``Subset`` in
fedloom's order, ``shuffle=False``) before FLGo's training loop runs
unchanged. The rounds are paced through ``register_exit_condition``, which
FLGo calls between rounds.

Settings: FLGo's defaults except what the workload fixes (``num_epochs``,
``batch_size``, ``learning_rate``, ``num_rounds``), ``train_holdout=0`` (every
sample trains, as in the other frameworks), no evaluation
(``eval_interval=-1``) and no console log. FLGo's default
``torch_num_threads`` is 1 and its default ``num_parallels`` 1 (clients one
after another in the server's process); both are kept unless
``--threads``/``--parallels`` say otherwise. ``--parallels N`` trains N clients
at a time in threads of the server's process (``parallel_type="t"``; torch
releases the GIL in its kernels): FLGo's process pools (``"r"`` without Ray)
pickle the whole server, every client's dataset included, to a new pool in
every round, and cannot pickle algorithm classes defined in a function.

Departure, stated: FLGo 0.4.4's client dataset class fails a check torch added
in 2.6 (a ``Subset`` subclass that overrides ``__getitem__`` must define
``__getitems__``); the driver gives it the per-item ``__getitems__`` torch's
error message proposes, which is what torch's data loader did before.

    python benchmarks/peer_flgo.py --spec DIR --prepare
    python benchmarks/peer_flgo.py --spec DIR [--final W.pt] [--no-dropout]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peer_common  # noqa: E402
import torch  # noqa: E402

BENCHMARK = "fedloom_peers_bmk"
TASK = "fedloom_peers_task"

_CONFIG = '''"""FLGo benchmark configuration written by benchmarks/peer_flgo.py."""
import os
import sys

sys.path.insert(0, {here!r})
import peer_common
import torch

_spec, _x, _y = peer_common.load_spec({spec!r})
train_data = torch.utils.data.TensorDataset(_x, _y)
test_data = torch.utils.data.TensorDataset(_x[:100], _y[:100])


def get_model(*args, **kwargs):
    return peer_common.build_model(
        _spec, dropout=os.environ.get("FEDLOOM_PEERS_DROPOUT", "1") == "1")
'''


def prepare(spec_dir: Path) -> None:
    import flgo
    from flgo.benchmark.partition import BasicPartitioner

    spec = torch.load(spec_dir / "spec.pt", weights_only=True)
    config = spec_dir / "flgo_config.py"
    config.write_text(_CONFIG.format(here=str(HERE), spec=str(spec_dir)))

    class Natural(BasicPartitioner):
        """Client k owns rows k·n … (k+1)·n − 1 of the spec."""

        num_clients = spec["clients"]  # read by FLGo's partition plot

        def __call__(self, data):
            n = spec["samples"]
            return [list(range(k * n, (k + 1) * n)) for k in range(spec["clients"])]

    import importlib
    bmk = flgo.gen_benchmark_from_file(BENCHMARK, str(config), target_path=".",
                                       data_type="cv", task_type="classification",
                                       overwrite=True)
    module = importlib.import_module(bmk)
    # no partition plot: matplotlib on every client's label counts takes minutes on a
    # loaded machine and is not part of a run
    module.visualize = lambda *args, **kwargs: None
    flgo.gen_task_by_(module, Natural(), task_path=TASK, overwrite=True)


def main(argv: list[str] | None = None) -> int:
    p = peer_common.arg_parser()
    p.add_argument("--prepare", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="FLGo's torch_num_threads")
    p.add_argument("--parallels", type=int, default=None, help="FLGo's num_parallels")
    args = p.parse_args(argv)
    spec_dir = Path(args.spec).resolve()
    # FLGo names benchmarks and tasks relative to the working directory
    os.chdir(spec_dir)
    sys.path.insert(0, str(spec_dir))
    if args.prepare:
        prepare(spec_dir)
        return 0
    os.environ["FEDLOOM_PEERS_DROPOUT"] = "0" if args.no_dropout else "1"
    spec = torch.load(spec_dir / "spec.pt", weights_only=True)
    rounds = args.rounds or len(spec["cohorts"])
    cohorts = [[int(k) for k in c] for c in spec["cohorts"]]

    import flgo
    import flgo.benchmark.toolkits.cv.classification as flgo_cv
    from flgo.algorithm import fedbase

    # FLGo 0.4.4's client dataset (a torch Subset that overrides __getitem__) fails
    # torch >= 2.6's check that such a subclass also defines __getitems__; this is
    # the per-item one torch's message gives (what its DataLoader did before).
    task_ds = flgo_cv.FromDatasetPipe.TaskDataset
    if "__getitems__" not in vars(task_ds):
        task_ds.__getitems__ = lambda self, idx: [self[i] for i in idx]

    class Server(fedbase.BasicServer):
        def sample(self):
            return list(cohorts[self.current_round - 1])

    class Client(fedbase.BasicClient):
        def train(self, model):
            r = self.server.current_round - 1
            perm = spec["perms"][r][cohorts[r].index(self.id)]
            view = torch.utils.data.Subset(self.train_data, perm.tolist())
            self._train_loader = self.calculator.get_dataloader(
                view, batch_size=self.batch_size, shuffle=False,
                num_workers=self.loader_num_workers, pin_memory=self.option["pin_memory"])
            self.data_loader = None
            return super().train(model)

    class FedAvg:
        pass

    FedAvg.Server, FedAvg.Client = Server, Client
    option = {"num_rounds": rounds, "num_epochs": spec["epochs"], "batch_size": spec["batch"],
              "learning_rate": spec["lr"], "proportion": spec["per_round"] / spec["clients"],
              "train_holdout": 0.0, "eval_interval": -1, "no_log_console": True,
              "log_file": False, "seed": 0}
    if args.threads:
        option["torch_num_threads"] = args.threads
    if args.parallels:
        # threads of one process (FLGo's parallel_type "t"): its process pools pickle
        # the whole server, every client's data included, in every round
        option.update(num_parallels=args.parallels, parallel_type="t")
    runner = flgo.init(TASK, FedAvg, option=option)
    peer_common.load_flat(runner.model, spec["init"])
    pacer = peer_common.Pacer(rounds)

    def between_rounds(server) -> bool:
        if server.current_round > 1:
            pacer.round_done()
        return server.current_round > rounds

    runner.register_exit_condition(between_rounds)
    runner.run()
    if pacer.done != rounds:
        print(f"flgo: {pacer.done} of {rounds} rounds ran", file=sys.stderr)
        return 1
    peer_common.save_final(args.final, runner.model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
