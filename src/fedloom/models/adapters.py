"""A LoRA run's adapters as peft's own files, which transformers + peft load.

peft's ``save_pretrained`` writes ``adapter_config.json`` (the rank, ``alpha``, the
target modules) and ``adapter_model.safetensors`` (the ``lora_A``/``lora_B`` tensors,
named as ``PeftModel.from_pretrained`` reads them, without the adapter's name). The
base is not in them: it is the model the run read (``model.options.gguf_file``,
``model.options.path``) or, for ``model.options.config``, the random-init Llama its seed draws.

peft writes into a folder it opens itself (through any link there, file by file), so
:func:`adapter_files` has it write into a new temporary folder and reads the bytes
back; :func:`write_adapter` then replaces each file whole
(:func:`fedloom.files.replace_bytes`: a kill leaves the old file or the new one, a
link is replaced, never written through). The tensors first, the config last: a
folder with the config has the tensors that go with it.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

from torch import nn

from fedloom.files import replace_bytes

__all__ = ["ADAPTER_FILES", "adapter_files", "has_adapter", "write_adapter"]

# in the order they are written (see the module docstring)
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def _peft_model(module: nn.Module) -> nn.Module | None:
    """The peft model inside ``module`` (an ``hf_causal_lm`` with ``model.options.lora.r`` > 0),
    else None."""
    from fedloom.models.llm import CausalLM

    if not isinstance(module, CausalLM):
        return None
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover (a CausalLM is only built with peft there)
        return None
    return module.lm if isinstance(module.lm, PeftModel) else None


def has_adapter(module: nn.Module) -> bool:
    """Whether ``module`` is a causal LM with LoRA adapters (what :func:`write_adapter`
    writes)."""
    return _peft_model(module) is not None


def adapter_files(module: nn.Module) -> dict[str, bytes]:
    """peft's adapter files of ``module`` (name → bytes, :data:`ADAPTER_FILES`), as
    ``save_pretrained`` writes them; ``ValueError`` when it has no adapters."""
    lm = _peft_model(module)
    if lm is None:
        raise ValueError("the model has no LoRA adapters (model.name: hf_causal_lm with "
                         "model.options.lora.r > 0)")
    with tempfile.TemporaryDirectory(prefix="fedloom-adapter-") as tmp:
        with warnings.catch_warnings():
            # peft asks transformers deprecated questions while saving (their two
            # versions' matter, not the run's), and looks for the base's config.json
            # to see whether the vocabulary changed (fedloom never trains it; a GGUF
            # base has no such file)
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", "Could not find a config file")
            lm.save_pretrained(tmp)  # type: ignore[operator]
        return {name: (Path(tmp) / name).read_bytes() for name in ADAPTER_FILES}


def write_adapter(module: nn.Module, out: Path) -> list[Path]:
    """Write ``module``'s adapter files into the folder ``out`` (made if absent), each
    replaced whole; their paths. Nothing for a model without adapters (``[]``), so a
    run's end may call it for any model."""
    if not has_adapter(module):
        return []
    files = adapter_files(module)  # all bytes first: a failure here writes nothing
    paths = []
    for name in ADAPTER_FILES:
        replace_bytes(out / name, files[name])
        paths.append(out / name)
    return paths
