"""One lock-step local step: every client's forward and backward, written out by hand.

:func:`_step` runs a plan (:mod:`fedloom.engine.trainers.lockstep.plan`) on activations
``[m, n, …]`` and writes each client's gradient into its row of ``G``; the package
docstring (:mod:`fedloom.engine.trainers.lockstep`) gives the operations it runs. Each kind
of op has its forward and its backward, looked up by the op's dataclass in
``_FORWARD`` and ``_BACKWARD``; :func:`_step` is the loop over them.

Convolutions run client by client with the call ``nn.Conv2d`` makes (a grouped
convolution is slower in float32 and sums otherwise); pools and ReLU run once on
``[m·n, C, H, W]``. Dropout draws each client's masks from a generator of the
sequential trainer's seed, layer by layer: the same masks. BatchNorm updates each
client's own copy of its running statistics as ``nn.BatchNorm1d/2d`` does.
Products below torch's own-loop size run per client with ``mm``/``addmm``;
clients whose batches differ in size run in one group per size (no padding).

Measured (tests/test_lockstep.py, torch 2.13 with MKL, x86-64 AVX2): in float64
every client update and the final ``model_sha256`` equal ``sequential``'s bit
for bit (MLPs, CNNs, dropout, GroupNorm and BatchNorm chains, momentum, weight
decay, FedProx, SCAFFOLD, FLARE); in float32 within rtol 1e-5, atol 1e-6. On
other BLAS builds or devices the equality is what the tests measure there.
Each layer kind and why the sums are sequential's: docs/explanation/backends.md
(Lock-step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.nn import functional as F

from fedloom.engine.trainers.lockstep.plan import (
    _AvgPool,
    _BatchNorm,
    _Conv,
    _Dropout,
    _Flatten,
    _GroupNorm,
    _Linear,
    _MaxPool,
    _Op,
    _Relu,
)

# torch's bmm/baddbmm compute products below this size (contraction × rows ×
# columns) with their own loop, not the BLAS GEMM that mm/addmm call.
_SMALL_GEMM = 400


def _addmm(bias: torch.Tensor | None, a: torch.Tensor, wt: torch.Tensor) -> torch.Tensor:
    """``a @ wt (+ bias)`` per client, with the GEMM one client's F.linear calls."""
    if a.shape[2] * a.shape[1] * wt.shape[2] < _SMALL_GEMM:
        if bias is None:
            return torch.stack([a[k].mm(wt[k]) for k in range(a.shape[0])])
        return torch.stack([torch.addmm(bias[k], a[k], wt[k]) for k in range(a.shape[0])])
    if bias is None:
        return torch.bmm(a, wt)
    return torch.baddbmm(bias[:, None, :], a, wt)


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.shape[2] * a.shape[1] * b.shape[2] < _SMALL_GEMM:
        return torch.stack([a[k].mm(b[k]) for k in range(a.shape[0])])
    return torch.bmm(a, b)


def _forward(op: _Conv | _MaxPool | _AvgPool, a: torch.Tensor, weight: torch.Tensor | None,
             bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A 2-d layer on ``a [N, C, H, W]``: the output, and the max-pool's indices —
    the calls ``nn.Conv2d`` / ``nn.MaxPool2d`` / ``nn.AvgPool2d`` make in training."""
    if isinstance(op, _Conv):
        # a convolution always has its weight (plan._conv)
        return F.conv2d(a, cast(torch.Tensor, weight), bias, op.stride, op.padding,
                        op.dilation), None
    if isinstance(op, _MaxPool):
        return torch.ops.aten.max_pool2d_with_indices(
            a, list(op.kernel), list(op.stride), list(op.padding), list(op.dilation),
            op.ceil_mode)
    return F.avg_pool2d(a, list(op.kernel), list(op.stride), list(op.padding), op.ceil_mode,
                        op.count_include_pad, op.divisor), None


@dataclass
class _Run:
    """What each op's forward and backward reads in one step: the rows' parameters
    ``W``, their gradients ``G`` (written), ``m`` clients of ``n`` samples each, the
    clients' dropout generators and buffers."""

    W: torch.Tensor
    G: torch.Tensor
    m: int
    n: int
    gens: list[torch.Generator] | None
    bufs: list[dict[str, torch.Tensor]] | None


def _step(plan: list[_Op], W: torch.Tensor, X: torch.Tensor, Y: torch.Tensor,
          G: torch.Tensor, seeds: list[int] | None = None,
          bufs: list[dict[str, torch.Tensor]] | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One local step's forward and backward for every row of ``W`` on its batch
    ``X [m, n, ...]``, ``Y [m, n]``: the gradients are written into ``G`` (every slice);
    returns the log-probabilities and the labels. Activations are ``[m, n, ...]``
    throughout; a pool runs once on the ``[m·n, C, H, W]`` view of them. ``seeds``:
    each row's seed of this step's dropout masks; ``bufs``: each row's buffers
    (BatchNorm's running statistics, updated in place). Each op kind's forward and
    backward: ``_FORWARD`` and ``_BACKWARD``."""
    gens = None
    if seeds is not None:
        gens = []
        for sd in seeds:
            gens.append(torch.Generator(device=W.device))
            gens[-1].manual_seed(sd)
    r = _Run(W, G, X.shape[0], X.shape[1], gens, bufs)
    a = X
    saved: list[Any] = []
    for op in plan:
        a, s = _FORWARD[type(op)](op, a, r)
        saved.append(s)
    lsm = torch.log_softmax(a, -1)
    # ∂ℓ/∂log-softmax of the mean cross-entropy, as nll_loss's backward: −1/n at y
    g = torch.zeros_like(lsm)
    g.scatter_(2, Y[:, :, None], float(-(1.0 / torch.tensor(float(r.n), dtype=lsm.dtype))))
    g = torch._log_softmax_backward_data(g, lsm, -1, lsm.dtype)
    # nothing before the first trained layer needs a gradient
    first = next(i for i, op in enumerate(plan) if op.params)
    for i in range(len(plan) - 1, first - 1, -1):
        g = _BACKWARD[type(plan[i])](plan[i], g, saved[i], r, i > first)
    return lsm, Y


# The forwards: (op, activations, run) → (output, what its backward needs).

def _linear_forward(op: _Linear, a: torch.Tensor, r: _Run) -> tuple[torch.Tensor, Any]:
    out, inp = op.shape
    wt = r.W[:, op.weight].view(r.m, out, inp).transpose(1, 2)
    return _addmm(r.W[:, op.bias] if op.bias is not None else None, a, wt), a


def _conv_forward(op: _Conv, a: torch.Tensor, r: _Run) -> tuple[torch.Tensor, Any]:
    # client by client: the convolution one client's nn.Conv2d runs (a grouped
    # convolution over the clients is another, slower kernel in float32)
    a = a.contiguous()
    wk = r.W[:, op.weight].view(r.m, *op.shape)
    bk = r.W[:, op.bias] if op.bias is not None else None
    return torch.stack([_forward(op, a[k], wk[k], bk[k] if bk is not None else None)[0]
                        for k in range(r.m)]), a


def _groupnorm_forward(op: _GroupNorm, a: torch.Tensor, r: _Run) -> tuple[torch.Tensor, Any]:
    # client by client, the call nn.GroupNorm makes (F.group_norm →
    # native_group_norm on the contiguous input); saved: its mean and 1/σ
    a = a.contiguous()
    hw = math.prod(a.shape[3:])
    gam, bet = r.W[:, op.weight], r.W[:, op.bias]
    outs, stats = [], []
    for k in range(r.m):
        o, mu, rstd = torch.ops.aten.native_group_norm(
            a[k], gam[k], bet[k], r.n, op.channels, hw, op.groups, op.eps)
        outs.append(o)
        stats.append((mu, rstd))
    return torch.stack(outs), (a, stats)


def _batchnorm_forward(op: _BatchNorm, a: torch.Tensor, r: _Run) -> tuple[torch.Tensor, Any]:
    """Train-mode BatchNorm client by client, as ``nn.BatchNorm1d/2d`` runs it: count
    the batch (``num_batches_tracked += 1``), the factor ``momentum`` (``1/count`` for
    ``momentum=None``), then ``native_batch_norm`` (what ``F.batch_norm`` reaches on
    the CPU) on the client's contiguous activations with its own running statistics,
    updated in place."""
    a = a.contiguous()
    gam = r.W[:, op.weight] if op.weight is not None else None
    bet = r.W[:, op.bias] if op.bias is not None else None
    outs, stats = [], []
    for k in range(a.shape[0]):
        rm = rv = None
        factor = 0.0 if op.momentum is None else op.momentum
        if op.stats is not None:
            assert r.bufs is not None
            b = r.bufs[k]
            rm, rv, count = b[op.stats[0]], b[op.stats[1]], b[op.stats[2]]
            count.add_(1)
            if op.momentum is None:
                factor = 1.0 / float(count)
        # F.batch_norm's own check (one value a channel); private, so not in torch's stubs
        F._verify_batch_size(a[k].size())  # type: ignore[attr-defined]
        o, mu, rstd = torch.ops.aten.native_batch_norm(
            a[k], gam[k] if gam is not None else None, bet[k] if bet is not None else None,
            rm, rv, True, factor, op.eps)
        outs.append(o)
        stats.append((rm, rv, mu, rstd))
    return torch.stack(outs), (a, stats)


def _pool_forward(op: _MaxPool | _AvgPool, a: torch.Tensor,
                  r: _Run) -> tuple[torch.Tensor, Any]:
    flat = a.reshape(r.m * r.n, *a.shape[2:])
    out, idx = _forward(op, flat, None, None)
    return out.view(r.m, r.n, *out.shape[1:]), (flat, idx)


def _relu_forward(op: _Relu, a: torch.Tensor, r: _Run) -> tuple[torch.Tensor, Any]:
    a = torch.relu(a)
    return a, a


def _dropout_forward(op: _Dropout, a: torch.Tensor, r: _Run) -> tuple[torch.Tensor, Any]:
    # torch's CPU dropout: noise ~ Bernoulli(1 − p) drawn on a tensor shaped as
    # the client's activations, noise /= 1 − p, out = a·noise — each client
    # from its own generator, in the order of its layers, as it draws them
    assert r.gens is not None
    gens = r.gens
    noise = torch.stack([torch.empty_like(a[k]).bernoulli_(1 - op.p, generator=gens[k])
                         for k in range(r.m)]).div_(1 - op.p)
    return a * noise, noise


def _flatten_forward(op: _Flatten, a: torch.Tensor, r: _Run) -> tuple[torch.Tensor, Any]:
    # the per-sample dims start..end are 2.. in [m, n, ...]
    end = op.end if op.end < 0 else op.end + 1
    return a.flatten(2, end), a.shape


_FORWARD: dict[type, Callable[[Any, torch.Tensor, _Run], tuple[torch.Tensor, Any]]] = {
    _Linear: _linear_forward, _Conv: _conv_forward, _GroupNorm: _groupnorm_forward,
    _BatchNorm: _batchnorm_forward, _MaxPool: _pool_forward, _AvgPool: _pool_forward,
    _Relu: _relu_forward, _Dropout: _dropout_forward, _Flatten: _flatten_forward,
}


# The backwards: (op, ∂ℓ/∂output, what its forward saved, run, whether a layer below
# needs ∂ℓ/∂input) → ∂ℓ/∂input (or the gradient as it was where none needs it).

def _linear_backward(op: _Linear, g: torch.Tensor, s: torch.Tensor, r: _Run,
                     need_input: bool) -> torch.Tensor:
    out, inp = op.shape
    r.G[:, op.weight].view(r.m, out, inp).copy_(_mm(g.transpose(1, 2), s))
    if op.bias is not None:
        r.G[:, op.bias].copy_(g.sum(1))
    if need_input:
        g = _mm(g, r.W[:, op.weight].view(r.m, out, inp))
    return g


def _conv_backward(op: _Conv, g: torch.Tensor, s: torch.Tensor, r: _Run,
                   need_input: bool) -> torch.Tensor:
    wk = r.W[:, op.weight].view(r.m, *op.shape)
    bias = op.bias is not None

    def one(k: int):
        # the op autograd's ConvolutionBackward0 calls for one client
        return torch.ops.aten.convolution_backward(
            g[k], s[k], wk[k], [op.shape[0]] if bias else None,
            list(op.stride), list(op.padding), list(op.dilation), False, [0, 0], 1,
            [need_input, True, bias])

    return _client_backward(r, one, op, need_input, g)


def _groupnorm_backward(op: _GroupNorm, g: torch.Tensor, s: tuple, r: _Run,
                        need_input: bool) -> torch.Tensor:
    a_in, stats = s
    hw = math.prod(a_in.shape[3:])
    gam = r.W[:, op.weight]
    g = g.contiguous()

    def one(k: int):
        # the op autograd's NativeGroupNormBackward0 calls for one client
        return torch.ops.aten.native_group_norm_backward(
            g[k], a_in[k], stats[k][0], stats[k][1], gam[k], r.n, op.channels, hw,
            op.groups, [need_input, True, True])

    return _client_backward(r, one, op, need_input, g)


def _batchnorm_backward(op: _BatchNorm, g: torch.Tensor, s: tuple, r: _Run,
                        need_input: bool) -> torch.Tensor:
    a_in, stats = s
    gam = r.W[:, op.weight] if op.weight is not None else None
    g = g.contiguous()

    def one(k: int):
        # the op autograd's NativeBatchNormBackward0 calls for one client (train
        # mode: the batch's saved mean and 1/σ; the running statistics unused)
        rm, rv, mu, rstd = stats[k]
        return torch.ops.aten.native_batch_norm_backward(
            g[k], a_in[k], gam[k] if gam is not None else None, rm, rv, mu, rstd,
            True, op.eps, [need_input, gam is not None, op.bias is not None])

    return _client_backward(r, one, op, need_input, g)


def _maxpool_backward(op: _MaxPool, g: torch.Tensor, s: tuple, r: _Run,
                      need_input: bool) -> torch.Tensor:
    flat, idx = s
    gf = torch.ops.aten.max_pool2d_with_indices_backward(
        g.reshape(r.m * r.n, *g.shape[2:]), flat, list(op.kernel), list(op.stride),
        list(op.padding), list(op.dilation), op.ceil_mode, idx)
    return gf.view(r.m, r.n, *gf.shape[1:])


def _avgpool_backward(op: _AvgPool, g: torch.Tensor, s: tuple, r: _Run,
                      need_input: bool) -> torch.Tensor:
    flat, _ = s
    gf = torch.ops.aten.avg_pool2d_backward(
        g.reshape(r.m * r.n, *g.shape[2:]), flat, list(op.kernel), list(op.stride),
        list(op.padding), op.ceil_mode, op.count_include_pad, op.divisor)
    return gf.view(r.m, r.n, *gf.shape[1:])


def _relu_backward(op: _Relu, g: torch.Tensor, s: torch.Tensor, r: _Run,
                   need_input: bool) -> torch.Tensor:
    return torch.ops.aten.threshold_backward(g, s, 0)


def _dropout_backward(op: _Dropout, g: torch.Tensor, s: torch.Tensor, r: _Run,
                      need_input: bool) -> torch.Tensor:
    return g * s  # MulBackward0: grad · noise


def _flatten_backward(op: _Flatten, g: torch.Tensor, s: torch.Size, r: _Run,
                      need_input: bool) -> torch.Tensor:
    return g.reshape(s)


_BACKWARD: dict[type, Callable[[Any, torch.Tensor, Any, _Run, bool], torch.Tensor]] = {
    _Linear: _linear_backward, _Conv: _conv_backward, _GroupNorm: _groupnorm_backward,
    _BatchNorm: _batchnorm_backward, _MaxPool: _maxpool_backward,
    _AvgPool: _avgpool_backward, _Relu: _relu_backward, _Dropout: _dropout_backward,
    _Flatten: _flatten_backward,
}


def _client_backward(r: _Run, one, op: _Conv | _GroupNorm | _BatchNorm, need_input: bool,
                     g: torch.Tensor) -> torch.Tensor:
    """A layer's backward client by client: ``one(k)`` is client ``k``'s
    ``(∂ℓ/∂input, ∂ℓ/∂weight, ∂ℓ/∂bias)`` (autograd's own op for the layer); the
    parameter gradients are written into ``G``'s rows (each parameter's slice once a
    step, so ``G`` needs no zeroing first); returns the stacked input gradients, or
    ``g`` as it was where no layer below needs them."""
    dxs = []
    for k in range(r.m):
        dx, dw, db = one(k)
        if op.weight is not None:
            r.G[k, op.weight].copy_(dw.reshape(-1))
        if op.bias is not None:
            r.G[k, op.bias].copy_(db.reshape(-1))
        dxs.append(dx)
    return torch.stack(dxs) if need_input else g
