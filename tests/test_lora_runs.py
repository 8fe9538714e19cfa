"""LoRA-aware methods in whole runs (issue #41 item 3): FedIT's product error, the exact
aggregation, FedSA-LoRA and FFA-LoRA on a tiny random-init Llama over a fixture play
(tests/test_llm.py's setting), alone and with the engine's other parts (CRAFT, robust
rules, Top-k with error feedback)."""

import json
import math

import pytest
import torch

pytest.importorskip("transformers", reason="the llm extra (transformers) is not installed")
pytest.importorskip("peft", reason="the llm extra (peft) is not installed")

import fedloom
import test_llm
from conftest import stop_and_resume
from fedloom.config import ConfigError, ModelConfig
from fedloom.data.shakespeare import NUM_CHARS
from fedloom.models import build_model
from fedloom.report.compare import lower_is_better
from test_evaluation import count_one_pass, two_passes, untimed
from test_llm import ADAPTERS, LAYERS, LORA, TINY

corpus = test_llm.corpus  # test_llm's fixture play, shared (a pytest fixture)
HEADER = 12  # an identity payload's 8-byte header and 4-byte CRC-32C trailer


def config(corpus, rounds=2, method=None, train="both", **over):
    client = {"lr": 0.5, "steps": 2, "batch_size": 4}
    if method:
        client["method"] = {"name": method}
    cfg = {
        "rounds": rounds, "seed": 0, "backend": "sequential",
        "data": {"name": "text", "partition": {"name": "natural"}, "test_fraction": 0.25,
                 "options": {"path": corpus, "seq_len": 16, "min_chars": 200}},
        "model": {"name": "hf_causal_lm",
                  "options": {"config": dict(TINY), "lora": {**LORA, "train": train}}},
        "cohort": {"size": 2}, "client": client,
        "eval": {"every": 1}, "checkpoint": {"every": 0},
    }
    cfg.update(over)
    return cfg


def adapters(module, which):
    return {n: p.detach().clone() for n, p in module.named_parameters()
            if f".lora_{which}." in n}


def test_fedit_logs_the_product_error_each_round(corpus):
    # (that its model is FedAvg's: tests/test_lora.py)
    res = fedloom.run(config(corpus, rounds=2, aggregator={"name": "fedit"}))
    errs = [m["lora_product_error"] for m in res.metrics]
    # clients that train both factors do not share A: the error is small but not zero
    assert all(0 < e < 1 for e in errs)
    assert all(m["lora_product_error_max"] >= m["lora_product_error"] for m in res.metrics)


def test_exact_aggregation_runs_and_truncates_less_than_fedit_misses(corpus):
    res = fedloom.run(config(corpus, rounds=3, aggregator={"name": "lora_exact"}))
    assert res.layout.size == ADAPTERS
    for m in res.metrics:
        assert 0 < m["lora_truncation_error"] < m["lora_product_error"] < 1
    assert math.isfinite(res.metrics[-1]["test_loss"])
    assert res.metrics[-1]["train_loss"] < res.metrics[0]["train_loss"]


def test_exact_aggregation_resumes_bit_identically(corpus, tmp_path):
    # its state (the A/B pairing) is checkpointed; evaluation at the end only, for time
    cfg = config(corpus, rounds=2, aggregator={"name": "lora_exact"}, eval={"every": 2})
    ref, res = stop_and_resume(cfg, [], tmp_path / "run", stop_after=1)
    assert torch.equal(ref.w, res.w)


def test_ffa_lora_sends_b_only_and_keeps_a(corpus):
    cfg = ModelConfig(name="hf_causal_lm", options={"config": dict(TINY)})
    cfg.options["lora"] = {"r": LORA["r"], "alpha": LORA["alpha"]}
    a_init = adapters(build_model(cfg, (16,), NUM_CHARS, 0), "A")  # the run's A draw
    res = fedloom.run(config(corpus, rounds=2, train="b"))
    assert res.layout.size == ADAPTERS // 2
    assert all(".lora_B." in n for n in res.layout.names)
    assert len(res.layout.groups) == LAYERS * 2  # still one group per adapted projection
    # two clients a round: B's coordinates only, A's half of a dense update saved
    assert [m["uplink_bytes"] for m in res.metrics] == [2 * (ADAPTERS // 2 * 4 + HEADER)] * 2
    a_after = adapters(res.model, "A")
    assert a_after.keys() == a_init.keys()
    assert all(torch.equal(a_after[n], a_init[n]) for n in a_init)  # bit-equal
    assert all(float(b.abs().sum()) > 0 for b in adapters(res.model, "B").values())
    assert math.isfinite(res.metrics[-1]["test_loss"])


def test_fedsa_lora_shares_a_and_keeps_each_clients_b(corpus):
    res = fedloom.run(config(corpus, rounds=3, method="fedsa_lora"))
    b = [t for t in res.layout if ".lora_B." in t.name]
    a = [t for t in res.layout if ".lora_A." in t.name]
    # the server's B never moves from LoRA's zero start; its A does
    assert all(float(res.w[t.slice].abs().max()) == 0 for t in b)
    init = adapters(build_model(_model_cfg(), (16,), NUM_CHARS, 0), "A")
    moved = adapters(res.model, "A")
    assert any(not torch.equal(moved[n], init[n]) for n in init)
    assert len(a) == len(b) == LAYERS * 2
    last = res.metrics[-1]
    # evaluated on the personal models (the global A, each client's B) as FedPer is
    assert last["personal_clients"] >= 2 and math.isfinite(last["personal_acc_mean"])


PPL = ("mean", "std", "worst10", "best10")


def test_fedsa_lora_reports_each_clients_perplexity_with_its_own_b(corpus, tmp_path):
    # one round, 2 of the 4 roles sampled: two clients with a B of their own, two
    # evaluated with the initial B (the global model's, zero)
    cfg = config(corpus, rounds=1, method="fedsa_lora", logging={"plots": False})
    res = fedloom.run(cfg, out=tmp_path / "run")
    last = res.metrics[-1]
    assert last["personal_clients"] == 2
    for key in [f"{p}_ppl_{s}" for p in ("personal", "unsampled") for s in PPL]:
        assert math.isfinite(last[key]), key
    assert last["personal_ppl_worst10"] >= last["personal_ppl_mean"] >= last["personal_ppl_best10"]
    per = json.loads((res.run_dir / "client_acc.json").read_text())
    mine = [k for k, p in enumerate(per["personal_ppl"]) if p is not None]
    assert len(mine) == 2 and len(per["personal_ppl"]) == len(per["client_ppl"]) == 4
    assert math.isclose(sum(per["personal_ppl"][k] for k in mine) / 2,
                        last["personal_ppl_mean"], rel_tol=1e-12)
    # a trained B moves each sampled client's perplexity off the global model's
    for k in mine:
        assert per["personal_ppl"][k] != per["client_ppl"][k]
        assert per["personal_acc"][k] is not None
    assert last["personal_ppl_mean"] != sum(per["client_ppl"][k] for k in mine) / 2
    # the others' model is the global one: the global pass's perplexities, to the
    # rounding of a pass over the client's windows alone
    rest = [k for k in range(4) if k not in mine]
    assert math.isclose(last["unsampled_ppl_mean"],
                        sum(per["client_ppl"][k] for k in rest) / 2, rel_tol=1e-9)
    # perplexity is lower-is-better wherever runs are compared (tuning, claims, plots)
    assert all(lower_is_better(f"{p}_ppl_{s}") for p in ("personal", "unsampled")
               for s in ("mean", "worst10", "best10"))


def test_fedsa_lora_personal_metrics_resume_bit_identically(corpus, tmp_path):
    # round 2's personal models hold round 1's B, restored from the checkpoint
    cfg = config(corpus, rounds=2, method="fedsa_lora")
    ref, res = stop_and_resume(cfg, [], tmp_path / "run", stop_after=1)
    assert torch.equal(ref.w, res.w)
    a, b = ref.metrics[-1], res.metrics[-1]
    keys = [k for k in a if k.startswith(("personal_", "unsampled_", "client_", "test_"))]
    assert "personal_ppl_worst10" in keys and "test_ppl" in keys
    assert {k: b[k] for k in keys} == {k: a[k] for k in keys}


def test_one_pass_gives_the_two_passes_numbers_for_a_language_model(corpus, monkeypatch):
    # the text source's pooled test windows are the clients' (fedloom.engine.stages.evaluation)
    cfg = config(corpus, rounds=2, method="fedsa_lora")
    calls = count_one_pass(monkeypatch)
    one = fedloom.run(cfg)
    assert calls[0] == 2
    two_passes(monkeypatch)
    two = fedloom.run(cfg)
    assert calls[0] == 2
    assert untimed(one.metrics) == untimed(two.metrics)  # exact float equality
    assert "client_ppl_worst10" in one.metrics[-1] and "personal_ppl_mean" in one.metrics[-1]


def _model_cfg():
    cfg = ModelConfig(name="hf_causal_lm", options={"config": dict(TINY)})
    cfg.options["lora"] = {"r": LORA["r"], "alpha": LORA["alpha"]}
    return cfg


def test_fedsa_lora_refuses_b_only_adapters(corpus):
    with pytest.raises(ConfigError, match=r"fedsa_lora needs LoRA adapters with both A and B"):
        fedloom.run(config(corpus, rounds=1, method="fedsa_lora", train="b"))


TOPK = {"name": "topk", "options": {"ratio": 0.25}}


@pytest.mark.parametrize("case", [
    # Top-k with SA-PEF's feedback on FFA-LoRA's B and on the exact aggregation
    {"train": "b", "compression": {**TOPK, "feedback": "sapef"}},
    {"train": "b", "aggregator": {"name": "lora_exact"}},  # no pair: FedAvg of B
    {"aggregator": {"name": "lora_exact"}, "compression": {**TOPK, "feedback": "sapef"}},
    # EF21 under FedIT's error metric, FLARE's feedback with FedSA-LoRA
    {"aggregator": {"name": "fedit"}, "compression": {**TOPK, "feedback": "ef21"}},
    {"method": "fedsa_lora", "compression": {**TOPK, "feedback": "flare"}},
    # CRAFT per adapted projection on FFA-LoRA's B; a robust rule with FedSA-LoRA
    {"train": "b", "aggregator": {"name": "craft", "options": {"groups": "layer"}}},
    {"method": "fedsa_lora", "aggregator": {"name": "median"}},
], ids=["ffa+topk+sapef", "ffa+exact", "exact+topk+sapef", "fedit+topk+ef21", "fedsa+topk+flare",
        "ffa+craft", "fedsa+median"])
def test_composes_with_the_engine(corpus, case):
    res = fedloom.run(config(corpus, rounds=2, **case))
    d = ADAPTERS // 2 if case.get("train") == "b" else ADAPTERS
    assert res.layout.size == d
    last = res.metrics[-1]
    assert math.isfinite(last["test_loss"]) and last["rejected_rounds_total"] == 0
    if "compression" in case:  # a quarter of the coordinates: well under a dense payload
        assert last["uplink_bytes"] < 2 * (d * 4 + HEADER) / 2
