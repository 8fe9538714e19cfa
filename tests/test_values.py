"""An experiment of three values (fedloom.engine.values) runs as the config that
names the same settings does, bit for bit; its defaults are the schema's; its
record names what ran; a bad value is refused before any round."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fedloom
from fedloom.config import ConfigError, DataConfig, PartitionConfig, load_config
from fedloom.engine.build import build, describe

ROUNDS = 2


def _data():
    gen = np.random.default_rng(0)
    X = gen.normal(size=(300, 6)).astype(np.float32)
    y = (X[:, 0] + X[:, 1] > 0).astype(np.int64) + 2 * (X[:, 2] > 0)
    return fedloom.data.from_arrays(X, y)


def _net():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))


SPLIT = DataConfig(num_clients=6, partition=PartitionConfig("dirichlet", {"alpha": 0.5}))


def _config(over=()):
    return load_config({"rounds": ROUNDS, "seed": 0, "cohort": {"size": 3},
                        "client": {"lr": 0.1}, "backend": {"threads": 1},
                        "data": {"num_clients": 6,
                                 "partition": {"name": "dirichlet", "options": {"alpha": 0.5}}},
                        "server": {"lr": 1.0}, "checkpoint": {"every": 0}}, list(over))


def _rounds(exp):
    st = exp.init()
    history = []
    for _ in range(ROUNDS):
        st, m = exp.round(st)
        history.append(m)
    exp.close()
    return st, history


def test_values_run_as_the_config_does():
    exp = fedloom.Experiment(fedloom.Algorithm(local=fedloom.LocalUpdate(lr=0.1)),
                             fedloom.Federation(data=_data(), split=SPLIT, cohort=3),
                             fedloom.Runtime(threads=1, seed=0), _net(), rounds=ROUNDS)
    st, hist = _rounds(exp)
    ref, ref_hist = _rounds(fedloom.Experiment.from_config(_config(), data=_data(),
                                                           model=_net()))
    assert torch.equal(st.w, ref.w)
    assert [m["test_acc"] for m in hist] == [m["test_acc"] for m in ref_hist]
    assert st.totals == ref.totals
    # a seed is the runtime's: another one trains another model
    other = fedloom.Experiment(fedloom.Algorithm(local=fedloom.LocalUpdate(lr=0.1)),
                               fedloom.Federation(data=_data(), split=SPLIT, cohort=3),
                               fedloom.Runtime(threads=1, seed=1), _net(), rounds=ROUNDS)
    assert not torch.equal(_rounds(other)[0].w, st.w)


def test_a_config_builds_its_components_and_its_record():
    over = ["aggregator.name=craft", "compression.name=topk", "compression.options.ratio=0.5",
            "client.momentum=0.5"]
    built = build(_config(over), data=_data(), model=_net())
    a = built.algorithm
    assert type(a.aggregator).__name__ == "CRAFT"
    assert type(a.compressor).__name__ == "TopK"
    assert a.local.momentum == 0.5 and a.local.lr == 0.1
    assert built.federation.cohort == 3 and built.federation.split.num_clients == 6
    assert built.record.aggregator.name == "craft" and not built.model_from_config
    # the module given is copied: the run trains its own
    net = _net()
    assert build(_config(), data=_data(), model=net).model is not net


def test_describe_records_objects_by_class_and_defaults_by_name():
    from fedloom.aggregate.craft import CRAFT

    algo = fedloom.Algorithm(local=fedloom.LocalUpdate(lr=0.2, batch_size=16),
                             aggregator=CRAFT())
    cfg = describe(algo, fedloom.Federation(data=_data(), split=SPLIT, cohort=2),
                   fedloom.Runtime(seed=5), _net(), fedloom.Config().eval, 7)
    assert cfg.aggregator.name == "object fedloom.aggregate.craft.CRAFT"
    assert cfg.compression.name == "identity" and cfg.client.method.name == "sgd"
    assert (cfg.seed, cfg.rounds, cfg.cohort.size, cfg.client.lr, cfg.client.batch_size) == (
        5, 7, 2, 0.2, 16)


def test_a_bad_value_is_refused_when_bound():
    fed = fedloom.Federation(data=_data(), split=SPLIT, cohort=7)  # 6 clients
    with pytest.raises(ConfigError, match=r"cohort\.size"):
        fedloom.Experiment(fedloom.Algorithm(), fed, fedloom.Runtime(), _net())
    wrong = torch.nn.Linear(6, 3)  # the data has 4 classes
    with pytest.raises(ConfigError, match="4 classes"):
        fedloom.Experiment(fedloom.Algorithm(), dataclasses.replace(fed, cohort=2),
                           fedloom.Runtime(), wrong)


def test_the_experiment_holds_no_run_state():
    exp = fedloom.Experiment(fedloom.Algorithm(),
                             fedloom.Federation(data=_data(), split=SPLIT, cohort=3),
                             fedloom.Runtime(threads=1), _net(), rounds=ROUNDS)
    st0 = exp.init()
    a, _ = exp.round(st0)
    b, _ = exp.round(st0)  # the same state in: the same state out
    exp.close()
    assert torch.equal(a.w, b.w) and a.next_round == b.next_round == 1
