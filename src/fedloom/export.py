"""``fedloom export RUN DIR``: a finished LoRA run's adapters as peft's own files.

A run's ``model.pt`` holds the adapters in fedloom's names (``lm.base_model.model…``)
with the config that rebuilds the base. The command rebuilds the model from it
(:func:`fedloom.engine.runs.directory.load_model`: the base read again and checked
against the run's hash), and writes ``adapter_config.json`` and
``adapter_model.safetensors`` into ``DIR`` (:func:`fedloom.models.adapters.write_adapter`:
each replaced whole), which ``peft.PeftModel.from_pretrained(base, DIR)`` loads.

What is refused, in one line (the command exits with status 2) and before anything
is written: a path without a ``model.pt``, a ``model.pt`` that cannot be read or
does not fit its model (damaged), and a run of another model or without adapters
(``model.options.lora.r: 0``).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import TypeAlias

    _Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = ["add_export_command", "export_adapter"]


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _lora_blob(file: Path) -> None:
    """Check that ``file`` is a readable ``model.pt`` of a LoRA run (one line else)."""
    import torch

    try:
        blob = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: torch's reasons vary
        raise ValueError(f"{file}: cannot be read as a run's model ({_first_line(e)})"
                         ) from None
    cfg = blob.get("config") if isinstance(blob, dict) else None
    if not isinstance(cfg, dict) or "state_dict" not in blob:
        raise ValueError(f"{file}: not a model.pt that fedloom wrote (no config or "
                         "state_dict)")
    from fedloom.config.translate import translate

    # an older version's file writes the model's options flat (fedloom.config.translate)
    model: dict[str, Any] = dict(translate(cfg).get("model") or {})
    name = model.get("name")
    rank = ((model.get("options") or {}).get("lora") or {}).get("r", 0)
    if name != "hf_causal_lm" or not rank:
        what = f"model.name: {name}" if name != "hf_causal_lm" else "model.options.lora.r: 0"
        raise ValueError(f"{file}: not a LoRA run ({what}); fedloom export writes the "
                         "adapters of a model.name: hf_causal_lm run with "
                         "model.options.lora.r > 0")


def export_adapter(run: str | Path, out: str | Path) -> list[Path]:
    """Write the adapters of the finished LoRA run ``run`` (its directory or its
    ``model.pt``) into the folder ``out`` as peft's files; their paths. ``ValueError``
    in one line, with nothing written, for what the module docstring lists."""
    from fedloom.engine.runs.directory import MODEL_FILE, load_model
    from fedloom.models.adapters import write_adapter

    p = Path(run)
    file = p / MODEL_FILE if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"{run}: no {MODEL_FILE} (not a finished run: a run writes it "
                         "at its end)")
    _lora_blob(file)
    try:  # a ValueError (load_model's, the model's) is one line already
        module = load_model(file)
    except (RuntimeError, KeyError, TypeError) as e:  # tensors that do not fit the model
        raise ValueError(f"{file}: does not load into its model ({_first_line(e)})"
                         ) from None
    try:  # write_adapter makes every file's bytes before it writes the first
        return write_adapter(module, Path(out))
    except OSError as e:
        raise ValueError(f"{out}: cannot be written ({e.strerror or type(e).__name__})"
                         ) from None


def _cmd_export(args: argparse.Namespace) -> int:
    for path in export_adapter(args.run, args.dir):
        print(path)
    return 0


def add_export_command(sub: _Commands) -> None:
    """The ``export`` subcommand on the CLI's parser."""
    e = sub.add_parser("export", help="a finished LoRA run's adapters as peft's files "
                                      "(adapter_config.json, adapter_model.safetensors)")
    e.add_argument("run", help="the run directory (or its model.pt)")
    e.add_argument("dir", help="the folder to write them into (made if absent)")
    e.set_defaults(func=_cmd_export)
