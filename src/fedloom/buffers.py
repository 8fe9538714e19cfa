"""Module buffers (BatchNorm running statistics) under federated training.

Buffers (``running_mean``, ``running_var``, ``num_batches_tracked``, anything
registered with ``register_buffer`` and persistent) are not parameters: they
travel beside ``w`` as a name → tensor mapping, and ``model.buffers`` says what
the server does with them after a round:

- ``average`` (default): the data-weighted mean ``Σ_k n_k b_k / Σ_k n_k`` of the
  accepted clients' buffers (FedAvg's weights, McMahan et al. 2017), in float64;
  integer buffers take the maximum;
- ``local`` (FedBN, Li et al., ICLR 2021): each client keeps its own in the state
  store and is evaluated with them; the global ones are still the average.
  Departure from FedBN: the BatchNorm affine parameters are part of ``w`` and
  aggregated;
- ``keep_global``: never updated.

Buffers are never aggregated by the aggregator, compressed or fed back; a client
with non-finite buffers is rejected. Checked against plain PyTorch
(tests/test_train_mode.py; conv → BatchNorm2d → linear, 4 clients): the buffers
agree bit for bit, the weights to 1.4e-17 (float64) and 1.5e-8 (float32).
Each policy in detail: docs/explanation/train-mode.md (Buffers in detail).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from fedloom.rng import forked_rng

__all__ = ["BUFFER_POLICIES", "average_buffers", "buffer_names", "buffers_sha256",
           "check_buffers", "flatten_buffers", "has_batch_statistics", "load_buffers",
           "module_buffers", "random_in_train", "trains_on_one_sample", "unflatten_buffers"]

BUFFER_POLICIES = ("average", "local", "keep_global")


def buffer_names(module: nn.Module) -> list[str]:
    """Names of ``module``'s persistent buffers, in ``named_buffers`` order."""
    persistent = set(module.state_dict(keep_vars=True))
    return [n for n, _ in module.named_buffers() if n in persistent]


def module_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of ``module``'s persistent buffers."""
    named = dict(module.named_buffers())
    return {n: named[n].detach().clone() for n in buffer_names(module)}


@torch.no_grad()
def load_buffers(module: nn.Module, bufs: Mapping[str, torch.Tensor]) -> None:
    """Copy ``bufs`` into ``module``'s buffers of the same names, in place."""
    named = dict(module.named_buffers())
    for n, v in bufs.items():
        named[n].copy_(v)


def average_buffers(bufs: Sequence[Mapping[str, torch.Tensor]],
                    weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """``Σ_k n_k b_k / Σ_k n_k`` per floating buffer (float64, then its dtype);
    the maximum per integer buffer. ``bufs`` must be non-empty and share names."""
    if not bufs:
        raise ValueError("average_buffers: no client buffers to average")
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64)
    if w.numel() != len(bufs) or not bool((w > 0).all()):
        raise ValueError("average_buffers: one positive weight per client is needed")
    out: dict[str, torch.Tensor] = {}
    for name, first in bufs[0].items():
        stack = torch.stack([b[name] for b in bufs])
        if first.is_floating_point() or first.is_complex():
            shape = (-1,) + (1,) * first.ndim
            mean = (stack.to(torch.float64) * w.to(stack.device).view(shape)).sum(0) / w.sum()
            out[name] = mean.to(first.dtype)
        else:
            out[name] = stack.amax(0) if stack.dtype != torch.bool else stack.any(0)
    return out


def flatten_buffers(bufs: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One ``dtype`` vector of every buffer (a per-client store row)."""
    if not bufs:
        return torch.zeros(0, dtype=dtype)
    return torch.cat([v.detach().reshape(-1).to(dtype) for v in bufs.values()])


def unflatten_buffers(row: torch.Tensor, template: Mapping[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """The buffers of a store row, shaped and typed as ``template`` (integer
    buffers are rounded: a float32 row holds integers up to 2**24 exactly)."""
    out: dict[str, torch.Tensor] = {}
    s = 0
    for name, t in template.items():
        part = row[s : s + t.numel()].reshape(t.shape)
        if not (t.is_floating_point() or t.is_complex()):
            part = part.round()
        out[name] = part.to(dtype=t.dtype, device=t.device).clone()
        s += t.numel()
    if s != row.numel():
        raise ValueError(f"buffers: a row of {row.numel()} entries for {s} buffer entries")
    return out


def check_buffers(bufs: object, template: Mapping[str, torch.Tensor]) -> str | None:
    """Why ``bufs`` is not a set of buffers shaped as ``template``, or ``None``."""
    if not isinstance(bufs, dict):
        return f"a {type(bufs).__name__}, not a mapping of buffers"
    if list(bufs) != list(template):
        return f"names {sorted(bufs)[:4]} are not the model's {sorted(template)[:4]}"
    for n, t in template.items():
        v = bufs[n]
        if not (isinstance(v, torch.Tensor) and v.dtype == t.dtype and v.shape == t.shape):
            return f"{n} is not a {t.dtype} tensor of shape {tuple(t.shape)}"
    return None


def buffers_sha256(bufs: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over the buffers' names and bytes, in order."""
    h = hashlib.sha256()
    for n, v in bufs.items():
        h.update(n.encode() + b"\0")
        h.update(v.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def has_batch_statistics(module: nn.Module) -> bool:
    """Whether a train-mode forward mixes the samples of a batch (BatchNorm)."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


@torch.no_grad()
def trains_on_one_sample(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether a train-mode forward accepts a batch of one sample (``x[:1]``):
    ``BatchNorm1d`` on ``[1, C]`` has one value per channel and refuses it.
    Run on a copy under a forked generator; any other error is not this one's
    to report."""
    probe = copy.deepcopy(module).train()
    try:
        with forked_rng(0, x.device):
            probe(x[:1])
    except ValueError:
        return False
    return True


@torch.no_grad()
def random_in_train(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether ``module``'s train-mode forward draws random numbers.

    ``True`` for any dropout layer with ``p > 0``; otherwise a copy of the module
    runs in train mode on ``x`` under two seeds (and once more under the first):
    random when the two seeds give different outputs and the same seed the same.
    The copy absorbs any buffer update; the global generator is left as it was.
    """
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules()):
        return True
    probe = copy.deepcopy(module).train()
    outs = []
    for seed in (1, 1, 2):
        with forked_rng(seed, x.device):
            outs.append(probe(x))
    same = all(torch.equal(a, b) for a, b in zip(_leaves(outs[0]), _leaves(outs[1]), strict=False))
    diff = any(not torch.equal(a, b)
               for a, b in zip(_leaves(outs[0]), _leaves(outs[2]), strict=False))
    return same and diff


def _leaves(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for v in x for t in _leaves(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _leaves(v)]
    return []
