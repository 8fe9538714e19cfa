"""``model.name: hf_causal_lm``: a causal language model, optionally with LoRA adapters.

As in FlowerTune's and pfl-research's LLM benchmarks: a frozen pretrained base and
low-rank adapters (Hu et al. 2021, LoRA: ``W x + (α/r) B A x``, ``B`` zero at the
start, so the adapted model starts as the base) on the attention projections; only
the adapters are trained, sent and averaged (``model.options.lora.train: b``: FFA-LoRA, Sun et
al. 2024, every ``A`` frozen at its initialisation).

The base is the option ``config`` (a tiny random-init Llama drawn from the run's
seed), ``path`` (a local model directory, never downloaded) or ``gguf_file`` (a
GGUF file, de-quantised to the run's dtype; ``package:DIST/PATH`` finds it inside an
installed Python package, :mod:`fedloom.packaged`).

fedloom sees the trainable parameters only, so the ``Layout``, every update and
payload hold adapter tensors; each adapted projection (its ``A`` and ``B``) is one
layer group. :meth:`CausalLM.__deepcopy__` shares the frozen base, held once per
process. The forward takes ids ``[B, T]`` and returns logits ``[B, V, T]``, so local
training's loss is the mean next-token cross-entropy unchanged. A run's ``model.pt``
holds the adapters, not the base; :mod:`fedloom.models.adapters` writes them as
peft's adapter files.

docs/howto/llm.md has the keys, the memory and speed options, the departures from
the benchmarks and FFA-LoRA's.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from fedloom.config import LoRAConfig
from fedloom.packaged import model_file
from fedloom.registry import register

__all__ = ["CausalLM", "build_causal_lm"]

INSTALL = "pip install 'fedloom[llm]'"
_OPT = "model.options."
# No adapters (every parameter trains): the factory's default, never mutated.
_NO_LORA = LoRAConfig()


class CausalLM(nn.Module):
    """A transformers causal LM (peft-wrapped when it has adapters): ids in, logits
    ``[B, V, T]`` out. Frozen tensors are shared by deep copies (the base once per
    process); :meth:`fedloom_layer_groups` puts each adapter's ``A`` and ``B`` in one
    layer group."""

    def __init__(self, lm: nn.Module, base_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.lm = lm
        # model.options.base_dtype: the frozen tensors' dtype whatever ``.to(dtype)`` asks
        # (None: they follow the module, as any parameter)
        self.base_dtype = base_dtype
        # fedloom.engine.trainers.vmap.vmap_supported: False sends backend vmap's training to
        # the sequential path (model.options.gradient_checkpointing)
        self.fedloom_vmap = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids=x.long(), use_cache=False)
        logits: torch.Tensor = out.logits
        if self.base_dtype is not None:
            # a bfloat16 base gives bfloat16 logits: the loss is taken in the adapters' dtype
            logits = logits.to(self.adapter_dtype())
        return logits.transpose(1, 2)

    def adapter_dtype(self) -> torch.dtype:
        """The adapters' dtype (the run's; ``requires_grad`` is no guide: evaluation
        may load detached tensors)."""
        return next((p.dtype for n, p in self.named_parameters() if ".lora_" in n),
                    torch.float32)

    def _apply(self, fn: Any, recurse: bool = True) -> CausalLM:
        # build_model casts the whole module to the run's dtype; a bfloat16 base is
        # cast back here (the adapters keep the run's dtype, the Layout's)
        super()._apply(fn, recurse)
        self.cast_base()
        return self

    def cast_base(self) -> None:
        """The frozen floating tensors of the base to ``base_dtype`` (when set); an
        adapter's tensors keep theirs, frozen or not (FFA-LoRA's ``A``: peft feeds
        ``A``'s output to ``B``, so the two share a dtype)."""
        if self.base_dtype is None:
            return
        for name, p in self.named_parameters():
            if (not p.requires_grad and p.is_floating_point() and ".lora_" not in name
                    and p.dtype != self.base_dtype):
                p.data = p.data.to(self.base_dtype)

    def __deepcopy__(self, memo: dict[int, Any]) -> CausalLM:
        # The frozen base is read-only everywhere in fedloom: a copy keeps the same
        # tensors (a 1B-parameter base is not held once per trainer or worker thread).
        for p in self.parameters():
            if not p.requires_grad:
                memo[id(p)] = p
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def fedloom_layer_groups(self) -> list[list[str]]:
        """The trainable tensors' names in groups: one per adapted projection (its
        ``lora_A`` and ``lora_B``), else one per owning module."""
        groups: list[list[str]] = []
        keys: list[str] = []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            key = name.split(".lora_", 1)[0] if ".lora_" in name else name.rpartition(".")[0]
            if keys and keys[-1] == key:
                groups[-1].append(name)
            else:
                groups.append([name])
                keys.append(key)
        return groups


def _need_packages() -> None:
    import importlib.util

    for mod in ("transformers", "peft"):
        if importlib.util.find_spec(mod) is None:
            raise ValueError(f"model.name: hf_causal_lm needs {mod}; install it with: {INSTALL}")


def _base(path: str, gguf_file: str, config: Mapping[str, Any] | None,
          num_classes: int) -> nn.Module:
    """The base model from ``model.options.config``, ``….gguf_file`` or ``….path``."""
    import transformers

    if config:
        if path or gguf_file:
            raise ValueError(f"{_OPT}config: give either {_OPT}config or "
                             f"{_OPT}path/gguf_file")
        keys = {"vocab_size": num_classes, **config}
        try:
            lcfg = transformers.LlamaConfig(**keys)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{_OPT}config: {str(e).splitlines()[0]}") from None
        if lcfg.vocab_size < num_classes:
            raise ValueError(f"{_OPT}config.vocab_size: {lcfg.vocab_size} is smaller than "
                             f"the data's {num_classes} tokens")
        return transformers.LlamaForCausalLM(lcfg)
    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file:
        g = model_file(gguf_file, f"{_OPT}gguf_file")  # a package: spec, else as given
        g = Path(path) / g if path else g
        if not g.is_file():
            raise ValueError(f"{_OPT}gguf_file: no such file: {g}")
        where, kwargs["gguf_file"] = str(g.parent), g.name
    elif path:
        if not Path(path).is_dir():
            raise ValueError(f"{_OPT}path: no such directory: {path}")
        where = path
    else:
        raise ValueError(f"model.name: hf_causal_lm needs {_OPT}config, {_OPT}path or "
                         f"{_OPT}gguf_file")
    try:
        lm = transformers.AutoModelForCausalLM.from_pretrained(where, **kwargs)
    except Exception as e:  # transformers' own reasons (format, a missing gguf package)
        field = f"{_OPT}gguf_file" if gguf_file else f"{_OPT}path"
        raise ValueError(f"{field}: {type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None
    vocab = int(lm.get_output_embeddings().weight.shape[0])
    if vocab < num_classes:
        raise ValueError(f"{_OPT}path: the model's vocabulary ({vocab}) is smaller than the "
                         f"data's {num_classes} tokens (data.options.tokenizer)")
    out: nn.Module = lm
    return out


def _with_lora(lm: nn.Module, lo: LoRAConfig) -> nn.Module:
    if lo.r == 0:
        return lm  # every parameter trains
    import warnings

    from peft import LoraConfig, get_peft_model

    try:
        with warnings.catch_warnings():
            # peft asks transformers a deprecated question (is_gradient_checkpointing):
            # a warning about their two versions, not about the run
            warnings.simplefilter("ignore", FutureWarning)
            wrapped: nn.Module = get_peft_model(lm, LoraConfig(
                r=lo.r, lora_alpha=lo.alpha, lora_dropout=lo.dropout,
                target_modules=list(lo.target_modules), bias="none"))
    except ValueError as e:  # e.g. a target module the model does not have
        raise ValueError(f"{_OPT}lora: {str(e).strip().splitlines()[0]}") from None
    if lo.train == "b":
        # FFA-LoRA: A stays at its init (drawn from the run's seed, so every client and
        # a resumed run hold the same A) and, frozen, is out of the Layout and payloads
        for name, p in wrapped.named_parameters():
            if ".lora_A." in name:
                p.requires_grad_(False)
    return wrapped


@register("model", "hf_causal_lm")
def build_causal_lm(in_shape: tuple[int, ...], num_classes: int, *, path: str = "",
                    gguf_file: str = "", config: dict[str, Any] | None = None,
                    lora: LoRAConfig = _NO_LORA, gradient_checkpointing: bool = False,
                    base_dtype: Literal["run", "bfloat16"] = "run") -> nn.Module:
    """A causal LM over ``num_classes`` tokens (see the module docstring); its own
    initialisation (transformers' and peft's), drawn from the global generators that
    :func:`fedloom.models.build_model` seeds. ``path``: a local model directory;
    ``gguf_file``: a GGUF file (in ``path`` or alone); ``config``: a transformers
    LlamaConfig's keys (random init, no file); ``lora``: the adapters
    (:class:`~fedloom.config.LoRAConfig`, or a mapping of its keys);
    ``gradient_checkpointing``: recompute each decoder layer's activations in the
    backward (less memory, about one more forward); ``base_dtype``: the frozen base's
    dtype (``run``: the run's; the adapters stay in the run's dtype)."""
    if isinstance(lora, Mapping):  # a Python caller's mapping (a config's is converted)
        lora = LoRAConfig(**lora)
    _need_packages()
    if len(in_shape) != 1:
        raise ValueError(f"model.name: hf_causal_lm reads token windows [seq_len] "
                         f"(data.name: text), not inputs of shape {tuple(in_shape)}")
    base = _base(path, gguf_file, config, num_classes)
    if gradient_checkpointing:
        # non-reentrant checkpointing: gradients reach the adapters inside a
        # checkpointed layer whatever its input (the reentrant variant needs inputs that
        # require grad); it acts in train mode only, as local training runs
        kwargs = {"use_reentrant": False}
        enable: Any = getattr(base, "activation_checkpointing_enable", None)
        if enable is not None:  # the name in recent transformers (the old one warns)
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            old: Any = getattr(base, "gradient_checkpointing_enable", None)
            old(gradient_checkpointing_kwargs=kwargs)
    lm = _with_lora(base, lora)
    frozen = None
    if base_dtype == "bfloat16":
        if lora.r == 0:
            raise ValueError(f"{_OPT}base_dtype: bfloat16 is the frozen base's dtype; with "
                             f"{_OPT}lora.r: 0 every parameter trains (use client.amp: bf16)")
        frozen = torch.bfloat16
    module = CausalLM(lm, frozen)
    module.cast_base()
    # backend vmap trains a checkpointed model on the sequential path
    # (fedloom.engine.trainers.vmap.vmap_supported)
    module.fedloom_vmap = not gradient_checkpointing
    module.eval()
    return module


# fedloom.models.build_model: the factory initialises its own weights (a pretrained
# base must not be re-drawn, and LoRA's B starts at zero).
build_causal_lm.fedloom_own_init = True  # type: ignore[attr-defined]
