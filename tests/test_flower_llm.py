"""fedloom's strategies and CompressionMod on a stock Flower ClientApp that
fine-tunes a causal LM with LoRA (issue #41 item 5), as FlowerTune's apps do: the
app builds the base and its adapters with transformers and peft, loads the
adapters from ``msg.content["arrays"]`` (``set_peft_model_state_dict``), trains
them with AdamW on its partition's tokens and replies with
``ArrayRecord(get_peft_model_state_dict(model))`` — the adapters only, never the
base. It knows nothing of fedloom; the server swaps ``FedAvg`` for ``CRAFT``.

The model is a tiny random-init Llama (``model.options.config``'s kind: hidden 16, 2
layers), its base drawn from one seed on every node; messages go through
:class:`test_flower_strategies.LocalGrid` (Flower's Grid in one process).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("flwr")
pytest.importorskip("transformers", reason="the llm extra (transformers) is not installed")
pytest.importorskip("peft", reason="the llm extra (peft) is not installed")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from peft import (
    LoraConfig,
    get_peft_model,
    get_peft_model_state_dict,
    set_peft_model_state_dict,
)
from transformers import LlamaConfig, LlamaForCausalLM

from fedloom.integrations.flower.stock import CompressionMod
from fedloom.integrations.flower.strategies import CRAFT, FedloomRule
from test_flower_strategies import LocalGrid, task_identity  # noqa: F401

# peft asks transformers a deprecated question: about their two versions, not the test
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

VOCAB, SEQ, NODES = 32, 16, 3
TINY = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "max_position_embeddings": SEQ}


def make_model():
    """The app's model: the same base on every node (one seed), rank-4 adapters on
    q_proj and v_proj (peft's init; the server's arrays replace them)."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**TINY))
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj"]))


def load_tokens(partition_id: int) -> torch.Tensor:
    """Partition k: 12 windows of a cycle through the vocabulary with step k + 1
    (each client its own next-token rule: non-IID text)."""
    start = torch.arange(12).unsqueeze(1)
    return (start + (partition_id + 1) * torch.arange(SEQ + 1)) % VOCAB


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:])


def stock_llm_app(mods=None) -> ClientApp:
    app = ClientApp(mods=mods or [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = make_model()
        set_peft_model_state_dict(model, msg.content["arrays"].to_torch_state_dict())
        tokens = load_tokens(int(context.node_config["partition-id"]))
        lr = float(msg.content["config"].get("lr", 1e-2))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        model.train()
        losses = []
        for i in range(0, len(tokens), 4):
            opt.zero_grad()
            loss = lm_loss(model, tokens[i:i + 4])
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        content = RecordDict({
            "arrays": ArrayRecord(get_peft_model_state_dict(model)),
            "metrics": MetricRecord({"train_loss": sum(losses) / len(losses),
                                     "num-examples": len(tokens)})})
        return Message(content=content, reply_to=msg)

    return app


def adapters() -> ArrayRecord:
    return ArrayRecord(get_peft_model_state_dict(make_model()))


def global_loss(arrays: ArrayRecord) -> float:
    model = make_model()
    set_peft_model_state_dict(model, arrays.to_torch_state_dict())
    model.eval()
    with torch.no_grad():
        return sum(float(lm_loss(model, load_tokens(k))) for k in range(NODES)) / NODES


def run(strategy, app, rounds=3):
    grid = LocalGrid(app, NODES)
    res = strategy.start(grid=grid, initial_arrays=adapters(), num_rounds=rounds,
                         train_config=ConfigRecord({"lr": 1e-2}))
    return res, grid


def test_craft_and_topk_ef_on_a_stock_lora_app():
    start = adapters()
    keys = list(start.to_torch_state_dict())
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    d = sum(v.numel() for v in start.to_torch_state_dict().values())
    before = global_loss(start)

    # the one-line swap: CRAFT on the adapters the stock app sends
    craft = CRAFT(fraction_evaluate=0.0, min_available_nodes=NODES, server_lr=1.0)
    res, grid = run(craft, stock_llm_app())
    assert list(res.arrays.to_torch_state_dict()) == keys  # adapters in, adapters out
    assert craft.state_layout.layout.size == d
    assert craft.totals["accepted"] == 3 * NODES and craft.totals["rejected"] == 0
    after = global_loss(res.arrays)
    assert math.isfinite(after) and after < before
    # replies hold the adapters only: a base tensor never crosses the wire
    assert all(list(rep.content["arrays"].to_torch_state_dict()) == keys for rep in grid.log)

    # Top-25 % with error feedback through the mod, decoded by the strategy
    mod = CompressionMod("topk", {"ratio": 0.25}, feedback="ef", seed=1)
    fedavg = FedloomRule("fedavg", compression="topk", compression_options={"ratio": 0.25},
                         server_lr=1.0, fraction_evaluate=0.0, min_available_nodes=NODES)
    res, grid = run(fedavg, stock_llm_app(mods=[mod]))
    assert fedavg.totals["accepted"] == 3 * NODES and fedavg.totals["rejected"] == 0
    assert global_loss(res.arrays) < before
    for rep in grid.log:  # no arrays, a payload of about a quarter of the dense adapters
        assert not rep.content.array_records
        assert len(rep.content["fedloom"]["payload"]) < 0.5 * 4 * d
    for ctx in grid.contexts.values():  # each node keeps its adapters' residual
        e = ctx.state["fedloom.stock-feedback"].to_torch_state_dict()["residual"]
        assert e.numel() == d and float(e.norm()) > 0
