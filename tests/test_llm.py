"""Federated LoRA fine-tuning of a causal LM (issue #41 items 1-2): ``model.name:
hf_causal_lm`` on ``data.name: text``, with a tiny random-init Llama and a fixture
play, so no file is downloaded and every run takes seconds."""

import math

import pytest
import torch

pytest.importorskip("transformers", reason="the llm extra (transformers) is not installed")
pytest.importorskip("peft", reason="the llm extra (peft) is not installed")

import fedloom
from conftest import stop_and_resume
from fedloom.client.sgd import LocalSGD
from fedloom.config import ConfigError, DataConfig, ModelConfig
from fedloom.data.shakespeare import NUM_CHARS, encode_text, parse_play
from fedloom.data.sources import load_dataset
from fedloom.data.text import windows
from fedloom.models import build_model
from fedloom.params import Layout

ROLES = {
    "Ham": "To be, or not to be, that is the question: whether 'tis nobler in the mind "
           "to suffer the slings and arrows of outrageous fortune. ",
    "Oph": "Good my lord, how does your honour for this many a day? I humbly thank you; "
           "well, well, well. ",
    "Lear": "Blow, winds, and crack your cheeks! rage! blow! You cataracts and hurricanoes, "
            "spout till you have drench'd our steeples. ",
    "Puck": "If we shadows have offended, think but this, and all is mended, that you have "
            "but slumber'd here while these visions did appear. ",
}
HIDDEN, LAYERS, RANK = 16, 2, 2
TINY = {"hidden_size": HIDDEN, "intermediate_size": 32, "num_hidden_layers": LAYERS,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}
LORA = {"r": RANK, "alpha": 4, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
# LoRA on q_proj and v_proj of every layer: A [r, h] and B [h, r] each
ADAPTERS = LAYERS * 2 * (RANK * HIDDEN + HIDDEN * RANK)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("plays")
    blocks = [f"{role}.\n{line}\n" for _ in range(6) for role, line in ROLES.items()]
    (d / "a_gut.txt").write_text("THE FIXTURE\n\n" + "\n".join(blocks))
    return str(d)


def config(corpus, **over):
    cfg = {
        "rounds": 2, "seed": 0, "backend": "sequential",
        "data": {"name": "text", "partition": {"name": "natural"}, "test_fraction": 0.25,
                 "options": {"path": corpus, "seq_len": 16, "min_chars": 200}},
        "model": {"name": "hf_causal_lm", "options": {"config": dict(TINY), "lora": dict(LORA)}},
        "cohort": {"size": 2}, "client": {"lr": 0.5, "steps": 2, "batch_size": 4},
        "eval": {"every": 1}, "checkpoint": {"every": 0},
    }
    cfg.update(over)
    return cfg


def tiny_model(seed=0):
    cfg = ModelConfig(name="hf_causal_lm", options={"config": dict(TINY)})
    cfg.options["lora"] = {"r": RANK, "alpha": 4}
    return build_model(cfg, (16,), NUM_CHARS, seed)


def test_text_windows_are_next_tokens_one_client_per_role(corpus):
    ds = load_dataset(DataConfig(name="text", options={"path": corpus, "seq_len": 16,
                                                        "min_chars": 200}),
              seed=0)
    assert ds.x.shape[1:] == (16,) and ds.y.shape == ds.x.shape and ds.num_classes == NUM_CHARS
    assert len(set(ds.groups.tolist())) == len(ROLES)
    first = sorted(ROLES)[0]  # clients in role order
    codes = encode_text(parse_play(open(f"{corpus}/a_gut.txt").read())[first])
    x, y = windows(codes, 16, 16)
    assert torch.equal(ds.x[: len(x)], torch.from_numpy(x))
    assert torch.equal(ds.y[: len(x)], torch.from_numpy(y))
    assert torch.equal(ds.x[0, 1:], ds.y[0, :-1])  # the labels are the window shifted by one


def test_only_adapters_in_the_layout_one_group_per_projection():
    module = tiny_model()
    layout = Layout.from_module(module)
    assert layout.size == ADAPTERS
    assert all(".lora_A." in n or ".lora_B." in n for n in layout.names)
    assert len(layout.groups) == LAYERS * 2  # q_proj and v_proj of each layer
    for g in layout.groups:
        assert g.name.endswith(("q_proj", "v_proj"))
        assert [n.split(".lora_")[1][0] for n in g.tensors] == ["A", "B"]
    frozen = [p for p in module.parameters() if not p.requires_grad]
    assert sum(p.numel() for p in frozen) > 10 * ADAPTERS
    # LoRA's B starts at zero: the adapted model starts as the base
    assert all(float(p.detach().abs().sum()) == 0 for n, p in module.named_parameters()
               if ".lora_B." in n)


def test_trainers_share_the_frozen_base():
    module = tiny_model()
    layout = Layout.from_module(module)
    fm = [LocalSGD(module, layout)._flat_module() for _ in range(2)]
    for name, p in module.named_parameters():
        q1, q2 = (dict(f.module.named_parameters())[name] for f in fm)
        if p.requires_grad:  # each trainer holds its own adapters
            assert q1.data_ptr() != p.data_ptr() and q1.data_ptr() != q2.data_ptr()
        else:  # the base once per process
            assert q1.data_ptr() == p.data_ptr() == q2.data_ptr()


def test_fedavg_trains_and_sends_only_adapters_base_unchanged(corpus):
    base = {n: p.detach().clone() for n, p in tiny_model().named_parameters()
            if not p.requires_grad}
    res = fedloom.run(config(corpus, rounds=3))
    assert res.layout.size == ADAPTERS
    # identity payload: 8-byte header + 4 bytes a coordinate + 4-byte CRC-32C trailer
    assert [m["uplink_bytes"] for m in res.metrics] == [2 * (ADAPTERS * 4 + 12)] * 3
    assert float(res.w.abs().sum()) > 0
    after = dict(res.model.named_parameters())
    assert all(torch.equal(after[n], t) for n, t in base.items())  # bit-equal
    losses = [m["train_loss"] for m in res.metrics]
    assert losses[-1] < losses[0]
    last = res.metrics[-1]
    assert math.isclose(last["test_ppl"], math.exp(last["test_loss"]), rel_tol=1e-9)
    for key in ("client_acc_mean", "client_acc_std", "client_acc_worst10",
                "client_ppl_mean", "client_ppl_std", "client_ppl_worst10"):
        assert math.isfinite(last[key]), key
    assert last["client_ppl_worst10"] >= last["client_ppl_mean"] >= last["client_ppl_best10"]
    assert 0 <= last["test_acc"] <= 1


def test_craft_per_layer_and_topk_with_ef_run(corpus):
    res = fedloom.run(config(corpus, aggregator={"name": "craft", "options": {"groups": "layer"}}))
    assert len(res.layout.groups) == LAYERS * 2 and math.isfinite(res.metrics[-1]["test_loss"])
    res = fedloom.run(config(corpus, compression={"name": "topk", "options": {"ratio": 0.25},
                                                  "feedback": "ef"}))
    assert res.metrics[-1]["uplink_bytes"] < 2 * ADAPTERS * 4
    assert math.isfinite(res.metrics[-1]["test_loss"])


def test_resume_is_bit_identical(corpus, tmp_path):
    ref, res = stop_and_resume(config(corpus, rounds=3), [], tmp_path / "run", stop_after=2)
    assert torch.equal(ref.w, res.w)
    import json

    per_client = json.loads((res.run_dir / "client_acc.json").read_text())
    assert len(per_client["client_ppl"]) == len(per_client["client_acc"]) == len(ROLES)
    assert math.isclose(sum(per_client["client_ppl"]) / len(ROLES),
                        res.metrics[-1]["client_ppl_mean"], rel_tol=1e-9)


def test_a_missing_gguf_file_is_one_line(corpus, tmp_path):
    cfg = config(corpus)
    cfg["model"] = {"name": "hf_causal_lm", "options": {"gguf_file": str(tmp_path / "absent.gguf")}}
    with pytest.raises(ConfigError,
                       match=r"^model\.options\.gguf_file: no such file: .*absent\.gguf$"):
        fedloom.run(cfg)


def test_a_local_model_directory_and_its_tokenizer(corpus, tmp_path):
    # model.options.path and data.options.tokenizer from a directory save_pretrained wrote (a
    # character-level fast tokenizer and a tiny Llama): the route of a real model, offline
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = sorted(set("".join(ROLES.values())))
    vocab = {"[UNK]": 0, **{c: i + 1 for i, c in enumerate(chars)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(
        models.BPE(vocab, [], unk_token="[UNK]")), unk_token="[UNK]")
    tok.save_pretrained(tmp_path)
    torch.manual_seed(1)
    saved = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab) + 3, **TINY))
    saved.save_pretrained(tmp_path)
    cfg = config(corpus, rounds=1)
    cfg["data"]["options"]["tokenizer"] = str(tmp_path)
    cfg["model"] = {"name": "hf_causal_lm", "options": {"path": str(tmp_path), "lora": dict(LORA)}}
    res = fedloom.run(cfg, out=tmp_path / "run")
    assert res.layout.size == ADAPTERS
    # model.pt holds the adapters; load_model reads the directory again for the base
    from fedloom.engine.runs.directory import load_model

    x = torch.randint(0, len(vocab), (2, 16))
    with torch.no_grad():
        assert torch.equal(load_model(tmp_path / "run")(x), res.model(x))
    # the base is the saved model's, not drawn again from the run's seed
    after = {n.split("base_model.model.", 1)[1]: p for n, p in res.model.named_parameters()
             if not p.requires_grad}
    assert all(torch.equal(after[n.replace(".weight", ".base_layer.weight")]
                           if n.replace(".weight", ".base_layer.weight") in after else after[n],
                           p) for n, p in saved.named_parameters())
    missing = config(corpus)
    missing["model"] = {"name": "hf_causal_lm", "options": {"path": str(tmp_path / "absent")}}
    with pytest.raises(ConfigError, match=r"^model\.options\.path: no such directory: .*absent$"):
        fedloom.run(missing)


def test_vmap_trains_as_the_sequential_path(corpus):
    # vmap's masked loss reads a sample's loss as the mean over its tokens
    seq = fedloom.run(config(corpus, rounds=1))
    vm = fedloom.run(config(corpus, rounds=1, backend="vmap"))
    assert torch.allclose(seq.w, vm.w, rtol=1e-4, atol=1e-6)


def test_full_loss_is_per_token(corpus):
    # the start loss of q-FedAvg, AFL and loss-driven selection: per label, as evaluate's
    from fedloom.metrics import evaluate

    ds = load_dataset(DataConfig(name="text", options={"path": corpus, "seq_len": 16,
                                                        "min_chars": 200}),
              seed=0)
    module = tiny_model()
    layout = Layout.from_module(module)
    w = layout.flatten(module)
    loss = LocalSGD(module, layout).full_loss(w, ds.x, ds.y, batch=7)
    assert math.isclose(loss, evaluate(module, layout, w, ds.x, ds.y)[1], rel_tol=1e-5)
    assert math.isclose(loss, math.log(NUM_CHARS), rel_tol=0.05)  # a random model's


def _tiny_gguf(path, vocab=96, tokens=None):
    """A tiny Llama written as GGUF (float32 tensors, llama.cpp's names); ``tokens``:
    its sentencepiece-style vocabulary (``<unk>``, ``<s>``, ``</s>`` first), else
    ``vocab`` placeholder tokens."""
    import numpy as np
    from gguf import GGUFWriter

    if tokens is not None:
        vocab = len(tokens)

    ffn, heads = TINY["intermediate_size"], TINY["num_attention_heads"]
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(32)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("llama")
    if tokens is None:
        w.add_token_list([f"<{i}>" for i in range(vocab)])
        w.add_token_types([1] * vocab)
    else:  # llama.cpp's token types: 2 unknown, 3 control, 1 normal
        w.add_token_list(tokens)
        w.add_token_types([2, 3, 3] + [1] * (vocab - 3))
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
    w.add_token_scores([0.0] * vocab)
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (vocab, HIDDEN), "output_norm": (HIDDEN,), "output": (vocab, HIDDEN)}
    for i in range(LAYERS):
        for name, shape in [("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (HIDDEN, HIDDEN)),
                            ("attn_v", (HIDDEN, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                            ("ffn_gate", (ffn, HIDDEN)), ("ffn_up", (ffn, HIDDEN)),
                            ("ffn_down", (HIDDEN, ffn)), ("attn_norm", (HIDDEN,)),
                            ("ffn_norm", (HIDDEN,))]:
            shapes[f"blk.{i}.{name}"] = shape
    tensors = {n: (rng.standard_normal(s) * 0.02).astype(np.float32) for n, s in shapes.items()}
    for name, t in tensors.items():
        w.add_tensor(f"{name}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_a_gguf_file_loads_frozen_with_adapters(corpus, tmp_path):
    pytest.importorskip("gguf", reason="GGUF files need the gguf package (the llm extra)")
    tensors = _tiny_gguf(tmp_path / "tiny.gguf")
    cfg = config(corpus, rounds=1)
    cfg["model"] = {"name": "hf_causal_lm",
                    "options": {"gguf_file": str(tmp_path / "tiny.gguf"), "lora": dict(LORA)}}
    res = fedloom.run(cfg)
    assert res.layout.size == ADAPTERS
    params = dict(res.model.named_parameters())
    embed = params["lm.base_model.model.model.embed_tokens.weight"]
    assert not embed.requires_grad
    assert torch.equal(embed, torch.from_numpy(tensors["token_embd"]))  # the file's weights
    assert math.isfinite(res.metrics[-1]["test_loss"])


def test_a_gguf_files_own_tokenizer_makes_the_windows(corpus, tmp_path):
    # data.options.tokenizer and model.options.gguf_file naming one file, as for a published
    # GGUF model: the windows are the file's token ids (a character vocabulary here,
    # "▁" the space, as sentencepiece spells it)
    pytest.importorskip("gguf", reason="GGUF files need the gguf package (the llm extra)")
    chars = sorted(set("".join(ROLES.values())) - {" "})
    tokens = ["<unk>", "<s>", "</s>", "\u2581", *chars]
    _tiny_gguf(tmp_path / "tok.gguf", tokens=tokens)
    cfg = DataConfig(name="text", options={"path": corpus, "seq_len": 16, "min_chars": 200,
                                           "tokenizer": str(tmp_path / "tok.gguf")})
    ds = load_dataset(cfg, seed=0)
    assert ds.num_classes == len(tokens)
    first = sorted(ROLES)[0]
    speech = parse_play(open(f"{corpus}/a_gut.txt").read())[first]
    # sentencepiece's prefix space first, then one token a character
    want = ["\u2581"] + ["\u2581" if c == " " else c for c in speech[:15]]
    assert [tokens[i] for i in ds.x[0].tolist()] == want
    assert torch.equal(ds.x[0, 1:], ds.y[0, :-1])
    run = config(corpus, rounds=1)
    run["data"]["options"]["tokenizer"] = str(tmp_path / "tok.gguf")
    run["model"] = {"name": "hf_causal_lm",
                    "options": {"gguf_file": str(tmp_path / "tok.gguf"), "lora": dict(LORA)}}
    assert math.isfinite(fedloom.run(run).metrics[-1]["test_loss"])


def test_image_data_is_refused_in_one_line():
    pytest.importorskip("sklearn")
    with pytest.raises(ConfigError, match=r"^model\.name: hf_causal_lm reads token windows"):
        fedloom.run({"rounds": 1, "data": {"name": "digits", "num_clients": 4,
                                           "partition": {"name": "iid"}},
                     "cohort": {"size": 2},
                     "model": {"name": "hf_causal_lm", "options": {"config": dict(TINY)}}})


def test_partitioners_apply_to_windows(corpus):
    from fedloom.config import PartitionConfig
    from fedloom.data.federated import build_federated
    from fedloom.data.heterogeneity import class_counts

    base = DataConfig(name="text", options={"path": corpus, "seq_len": 16, "min_chars": 200})
    ds = load_dataset(base, seed=0)
    natural = build_federated(ds, DataConfig(**{**base.__dict__,
                                                "partition": PartitionConfig(name="natural")}), 0)
    assert natural.num_clients == len(ROLES)
    iid = build_federated(ds, DataConfig(**{**base.__dict__, "num_clients": 3,
                                            "partition": PartitionConfig(name="iid")}), 0)
    assert iid.num_clients == 3
    assert sum(len(a) + len(b) for a, b in zip(iid.train, iid.test, strict=True)) == len(ds)
    # the token counts of each client (summary.json's heterogeneity measures)
    counts = class_counts(ds.y.numpy(), iid.train, ds.num_classes)
    assert counts.sum() == sum(len(t) for t in iid.train) * 16


def test_an_absent_tokenizer_is_one_line(corpus, tmp_path):
    from fedloom.data import DatasetUnavailable

    cfg = DataConfig(name="text", options={"path": corpus, "tokenizer": str(tmp_path / "no")})
    with pytest.raises(DatasetUnavailable, match=r"^data\.options\.tokenizer: no such directory"):
        load_dataset(cfg, seed=0)
    cfg.options["tokenizer"] = str(tmp_path / "no.gguf")
    with pytest.raises(DatasetUnavailable, match=r"^data\.options\.tokenizer: no such file"):
        load_dataset(cfg, seed=0)


def test_rank_zero_trains_every_parameter():
    module = build_model(ModelConfig(name="hf_causal_lm", options={"config": dict(TINY)}), (16,),
                         NUM_CHARS, 0)
    layout = Layout.from_module(module)
    assert layout.size == sum(p.numel() for p in module.parameters())
    # one group per module that owns parameters (a projection, a norm, the embedding)
    assert all(len({n.rpartition(".")[0] for n in g.tensors}) == 1 for g in layout.groups)


# ------------------------------------------- speed and memory (issue #41 item 4)
def _layer0_calls(module, x):
    """How often decoder layer 0's MLP runs in one forward and backward."""
    mlp = next(m for n, m in module.named_modules() if n.endswith("layers.0.mlp"))
    calls = []
    handle = mlp.register_forward_pre_hook(lambda *a: calls.append(1))
    module.train()
    torch.nn.functional.cross_entropy(module(x), x).backward()
    handle.remove()
    return len(calls)


def test_gradient_checkpointing_recomputes_layers_and_trains_the_same(corpus):
    x = torch.randint(0, NUM_CHARS, (2, 16))
    plain = tiny_model()
    cfg = ModelConfig(name="hf_causal_lm",
                      options={"config": dict(TINY), "gradient_checkpointing": True})
    cfg.options["lora"] = {"r": RANK, "alpha": 4}
    ckpt = build_model(cfg, (16,), NUM_CHARS, 0)
    assert _layer0_calls(plain, x) == 1
    assert _layer0_calls(ckpt, x) == 2  # the forward, then again in the backward
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        if p.requires_grad:
            assert torch.allclose(p.grad, q.grad, atol=1e-6), n
    model = {"name": "hf_causal_lm", "options": {"config": dict(TINY), "lora": dict(LORA)}}
    ref = fedloom.run(config(corpus, model=model))
    ckpt = {**model, "options": {**model["options"], "gradient_checkpointing": True}}
    res = fedloom.run(config(corpus, model=ckpt))
    assert torch.allclose(ref.w, res.w, atol=1e-6)
    # torch.func refuses what checkpointed layers do: vmap trains on the sequential path
    vm = fedloom.run(config(corpus, model=ckpt, backend="vmap"))
    assert torch.allclose(res.w, vm.w, atol=1e-6)


def test_a_bfloat16_base_under_float32_adapters(corpus):
    cfg = ModelConfig(name="hf_causal_lm",
                      options={"config": dict(TINY), "base_dtype": "bfloat16"})
    cfg.options["lora"] = {"r": RANK, "alpha": 4}
    module = build_model(cfg, (16,), NUM_CHARS, 0)
    params = dict(module.named_parameters())
    assert {p.dtype for p in params.values() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for p in params.values() if p.requires_grad} == {torch.float32}
    assert Layout.from_module(module).size == ADAPTERS
    assert module(torch.zeros(1, 16, dtype=torch.long)).dtype == torch.float32
    model = {"name": "hf_causal_lm",
             "options": {"config": dict(TINY), "lora": dict(LORA), "base_dtype": "bfloat16"}}
    res = fedloom.run(config(corpus, model=model, rounds=3))
    assert res.w.dtype == torch.float32 and float(res.w.abs().sum()) > 0
    losses = [m["train_loss"] for m in res.metrics]
    assert losses[-1] < losses[0]
    after = dict(res.model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in params.items() if not p.requires_grad)
    with pytest.raises(ConfigError, match=r"^model\.options\.base_dtype: bfloat16 is the frozen"):
        fedloom.run(config(corpus, model={**model,
                                          "options": {**model["options"], "lora": {"r": 0}}}))


def test_summary_counts_local_training_tokens_and_peak_rss(corpus):
    res = fedloom.run(config(corpus))
    # every round: 2 clients × 2 steps × batch 4 windows × 16 tokens
    assert [m["train_tokens"] for m in res.metrics] == [2 * 2 * 4 * 16] * 2
    s = res.summary
    assert s["train_tokens_total"] == 2 * 2 * 2 * 4 * 16
    train_s = sum(m["train_s"] for m in res.metrics)
    assert math.isclose(s["train_tokens_per_s"], s["train_tokens_total"] / train_s, rel_tol=1e-3)
    assert s["peak_rss_mb"] > 0


def test_a_cohort_of_ten_holds_one_base(corpus, monkeypatch):
    # every forward of the run (10 clients' training, evaluation) reads the same
    # frozen storage: one base in the process, not one a client
    from fedloom.models.llm import CausalLM

    seen, modules = set(), set()
    forward = CausalLM.forward

    def spy(self, x):
        modules.add(id(self))
        # by name: the evaluator's copy holds its adapters frozen, over the flat w
        seen.update(p.untyped_storage().data_ptr() for n, p in self.named_parameters()
                    if ".lora_" not in n)
        return forward(self, x)

    monkeypatch.setattr(CausalLM, "forward", spy)
    cfg = config(corpus, rounds=1, cohort={"size": 10})
    cfg["data"] = {**cfg["data"], "num_clients": 10, "partition": {"name": "iid"}}
    res = fedloom.run(cfg)
    assert res.metrics[-1]["cohort_size"] == 10
    frozen = [p for p in res.model.parameters() if not p.requires_grad]
    assert len(modules) >= 2  # the trainer's copy and the evaluated model
    assert len(seen) == len({p.untyped_storage().data_ptr() for p in frozen})


def test_model_pt_holds_the_adapters_and_loads_back(corpus, tmp_path):
    from fedloom.engine.runs.directory import load_model

    res = fedloom.run(config(corpus), out=tmp_path / "run")
    blob = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    assert sorted(blob["state_dict"]) == sorted(n for n, p in res.model.named_parameters()
                                                if p.requires_grad)
    assert len(blob["base_omitted"]) == sum(1 for p in res.model.parameters()
                                            if not p.requires_grad)
    loaded = load_model(tmp_path / "run")
    x = torch.randint(0, NUM_CHARS, (3, 16))
    with torch.no_grad():
        assert torch.equal(loaded(x), res.model(x))
    # another seed draws another base: refused, not silently loaded
    blob["config"]["seed"] = 1
    torch.save(blob, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"the rebuilt base is not the run's"):
        load_model(tmp_path / "other.pt")


def test_local_adamw_is_torch_adamw_and_trains_adapters(corpus):
    from fedloom.client.adamw import AdamW
    from fedloom.client.transforms import StepContext

    torch.manual_seed(0)
    w0 = torch.randn(20, dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([p], lr=0.01, weight_decay=0.1)
    w, term = w0.clone(), AdamW(weight_decay=0.1)
    state = term.init(w)
    for step in range(5):
        g = torch.randn(20, dtype=torch.float64)
        p.grad = g.clone()
        opt.step()
        d, state = term.update(g.clone(), state, StepContext(step, w.clone(), w0))
        w = w - 0.01 * d
    assert torch.allclose(w, p.detach(), rtol=0, atol=1e-12)
    res = fedloom.run(config(corpus, rounds=3, client={"lr": 0.01, "steps": 2, "batch_size": 4,
                                                       "transforms": [{"name": "adamw"}]}))
    losses = [m["train_loss"] for m in res.metrics]
    assert losses[-1] < losses[0]
    with pytest.raises(ConfigError, match=r"^adamw: beta1 must be in \[0, 1\), got 1\.5$"):
        fedloom.run(config(corpus, client={"transforms": [{"name": "adamw",
                                                           "options": {"beta1": 1.5}}]}))
