"""The global model's pooled (``test_*``) and per-client (``client_*``) metrics from
one forward pass (fedloom.engine.stages.evaluation): where the pooled test set is the union
of the clients' test splits, a run gives the numbers of a pass over each, bit for
bit; where it is not (a source's own test set, a feature skew of the clients' rows)
the two passes stay. Language models: tests/test_lora_runs.py. And the sweep page's
row of a method's personal models, which follows the page's columns."""

import dataclasses

import numpy as np
import pytest
import torch

import fedloom
from conftest import TINY
from fedloom.config import load_config
from fedloom.data.sources import load_dataset
from fedloom.engine.experiment import Experiment
from fedloom.engine.stages import evaluation

# what a run measures of itself (seconds) differs between two runs of the same config
TIMED = ("_s", "_per_s")


def untimed(metrics):
    return [{k: v for k, v in m.items() if not k.endswith(TIMED)} for m in metrics]


def two_passes(monkeypatch):
    """Every Evaluator built from now on evaluates the pooled set apart."""
    monkeypatch.setattr(evaluation, "_same_rows", lambda *a, **k: False)


def count_one_pass(monkeypatch):
    """Counts the evaluations done in one pass (a one-element list)."""
    calls = [0]
    inner = evaluation.evaluate_pooled_and_clients

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(evaluation, "evaluate_pooled_and_clients", counted)
    return calls


@pytest.mark.parametrize("over", [
    [],
    # FedBN: the clients with buffers of their own are evaluated again with them
    ["model.name=resnet", "model.options={depth: 8, width: 4, norm: batch}",
     "model.buffers=local", "data.num_clients=4", "data.max_samples=300", "cohort.size=2"],
], ids=["mlp", "fedbn"])
def test_one_pass_gives_the_two_passes_numbers_bit_for_bit(over, monkeypatch):
    over = ["rounds=2", "checkpoint.every=0", "eval.batch_size=64", *over]
    calls = count_one_pass(monkeypatch)
    one = fedloom.run(TINY, over)
    assert calls[0] == 2  # an evaluation a round, each one pass
    two_passes(monkeypatch)
    two = fedloom.run(TINY, over)
    assert calls[0] == 2
    assert untimed(one.metrics) == untimed(two.metrics)  # exact float equality
    assert "client_acc_mean" in one.metrics[-1] and "test_loss" in one.metrics[-1]
    assert one.summary["model_sha256"] == two.summary["model_sha256"]


def test_the_pooled_set_is_checked_not_assumed():
    cfg = load_config(TINY, ["checkpoint.every=0"])
    # digits has no test set of its own: the pooled one is the clients' splits
    exp = Experiment.from_config(cfg)
    ev = exp.evaluator
    assert ev.pooled_is_clients
    assert torch.equal(ev.x_test, exp.x[ev.client_test_idx])
    # a feature skew transforms the clients' rows only: two passes
    skew = Experiment.from_config(load_config(TINY, [
        "checkpoint.every=0", "data.feature.name=noise", "data.feature.scale=0.5"]))
    assert not skew.evaluator.pooled_is_clients
    # a source's own test set (here the first 100 samples again): two passes
    ds = load_dataset(cfg.data, cfg.seed)
    own = dataclasses.replace(ds, x_test=ds.x[:100].clone(), y_test=ds.y[:100].clone())
    exp = Experiment.from_config(cfg, data=own)
    assert not exp.evaluator.pooled_is_clients
    w = exp.layout.flatten(exp.module).to(exp.dtype)
    out = exp.evaluator.global_(w)
    acc, _ = exp.global_eval(w)
    assert out["test_acc"] == acc and np.isfinite(out["client_acc_mean"])


def test_the_reports_personal_row_follows_the_columns():
    # a sweep page's row of a method's personal models (fedloom.report.sweep): the
    # accuracy columns as before, a language model's perplexity columns with its
    # personal_ppl_* rather than personal_acc_* under them
    from fedloom.report.sweep import COLUMNS, _personal_row

    row = {"personal_acc_mean": (0.5, 0.01), "personal_acc_std": (0.1, 0.0),
           "personal_acc_worst10": (0.25, 0.0), "personal_acc_best10": (0.75, 0.0),
           "personal_ppl_mean": (81.5, 0.25), "personal_ppl_worst10": (90.0, 1.0)}
    acc = [(k, label, "pct") for k, label in COLUMNS]
    assert _personal_row("Ditto", row, acc, 2) == (
        "| Ditto (personal models) | 50.0 ± 1.0 | 10.0 ± 0.0 | 25.0 ± 0.0 | 75.0 ± 0.0 | – | – |"
        " – | – |")
    ppl = [("client_ppl_mean", "", "num"), ("client_ppl_worst10", "", "num"),
           ("client_ppl_std", "", "num"), ("test_ppl", "", "num")]
    assert _personal_row("FedSA-LoRA", row, ppl, 1) == (
        "| FedSA-LoRA (personal models) | 81.5 ± 0.2 | 90.0 ± 1.0 | – | – | – |")
    assert _personal_row("FedAvg", {"client_acc_mean": (0.5, 0.0)}, acc, 1) is None
