"""One lock-step local step: every client's forward and backward, written out by hand.

:func:`_step` runs a plan (:mod:`fedloom.engine.lockstep.plan`) on activations
``[m, n, …]`` and writes each client's gradient into its row of ``G``; the package
docstring (:mod:`fedloom.engine.lockstep`) gives the operations it runs.

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
from typing import cast

import torch
from torch.nn import functional as F

from fedloom.engine.lockstep.plan import _Op

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


def _forward(op: _Op, a: torch.Tensor, weight: torch.Tensor | None,
             bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A 2-d layer on ``a [N, C, H, W]``: the output, and the max-pool's indices —
    the calls ``nn.Conv2d`` / ``nn.MaxPool2d`` / ``nn.AvgPool2d`` make in training."""
    if op.kind == "conv":
        # a convolution always has its weight (plan._conv)
        return F.conv2d(a, cast(torch.Tensor, weight), bias, op.stride, op.padding,
                        op.dilation), None
    if op.kind == "maxpool":
        return torch.ops.aten.max_pool2d_with_indices(
            a, list(op.kernel), list(op.stride), list(op.padding), list(op.dilation),
            op.ceil_mode)
    return F.avg_pool2d(a, list(op.kernel), list(op.stride), list(op.padding), op.ceil_mode,
                        op.count_include_pad, op.divisor), None


def _step(plan: list[_Op], W: torch.Tensor, X: torch.Tensor, Y: torch.Tensor,
          G: torch.Tensor, seeds: list[int] | None = None,
          bufs: list[dict[str, torch.Tensor]] | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One local step's forward and backward for every row of ``W`` on its batch
    ``X [m, n, ...]``, ``Y [m, n]``: the gradients are written into ``G`` (every slice);
    returns the log-probabilities and the labels. Activations are ``[m, n, ...]``
    throughout; a pool runs once on the ``[m·n, C, H, W]`` view of them. ``seeds``:
    each row's seed of this step's dropout masks; ``bufs``: each row's buffers
    (BatchNorm's running statistics, updated in place)."""
    m, n = X.shape[0], X.shape[1]
    gens = None
    if seeds is not None:
        gens = []
        for sd in seeds:
            gens.append(torch.Generator(device=W.device))
            gens[-1].manual_seed(sd)
    a = X
    saved: list[object] = []
    for op in plan:
        if op.kind == "linear":
            out, inp = op.shape
            saved.append(a)
            wt = W[:, op.weight].view(m, out, inp).transpose(1, 2)
            a = _addmm(W[:, op.bias] if op.bias is not None else None, a, wt)
        elif op.kind == "conv":
            # client by client: the convolution one client's nn.Conv2d runs (a grouped
            # convolution over the clients is another, slower kernel in float32)
            a = a.contiguous()
            saved.append(a)
            wk = W[:, op.weight].view(m, *op.shape)
            bk = W[:, op.bias] if op.bias is not None else None
            a = torch.stack([_forward(op, a[k], wk[k], bk[k] if bk is not None else None)[0]
                             for k in range(m)])
        elif op.kind == "groupnorm":
            # client by client, the call nn.GroupNorm makes (F.group_norm →
            # native_group_norm on the contiguous input); saved: its mean and 1/σ
            a = a.contiguous()
            c = op.shape[0]
            hw = math.prod(a.shape[3:])
            gam: torch.Tensor | None  # the batch norm has none without affine parameters
            gam, bet = W[:, op.weight], W[:, op.bias]
            outs, stats = [], []
            for k in range(m):
                o, mu, rstd = torch.ops.aten.native_group_norm(
                    a[k], gam[k], bet[k], n, c, hw, op.groups, op.eps)
                outs.append(o)
                stats.append((mu, rstd))
            saved.append((a, stats))
            a = torch.stack(outs)
        elif op.kind == "batchnorm":
            a = a.contiguous()
            outs, stats = _batchnorm_forward(op, a, W, bufs)
            saved.append((a, stats))
            a = torch.stack(outs)
        elif op.kind in ("maxpool", "avgpool"):
            flat = a.reshape(m * n, *a.shape[2:])
            out_, idx = _forward(op, flat, None, None)
            saved.append((flat, idx))
            a = out_.view(m, n, *out_.shape[1:])
        elif op.kind == "relu":
            a = torch.relu(a)
            saved.append(a)
        elif op.kind == "dropout":
            # torch's CPU dropout: noise ~ Bernoulli(1 − p) drawn on a tensor shaped as
            # the client's activations, noise /= 1 − p, out = a·noise — each client
            # from its own generator, in the order of its layers, as it draws them
            assert gens is not None
            noise = torch.stack([torch.empty_like(a[k]).bernoulli_(1 - op.p, generator=gens[k])
                                 for k in range(m)]).div_(1 - op.p)
            a = a * noise
            saved.append(noise)
        else:  # flatten the per-sample dims start..end (2.. in [m, n, ...])
            saved.append(a.shape)
            end = op.end if op.end < 0 else op.end + 1
            a = a.flatten(2, end)
    lsm = torch.log_softmax(a, -1)
    # ∂ℓ/∂log-softmax of the mean cross-entropy, as nll_loss's backward: −1/n at y
    g = torch.zeros_like(lsm)
    g.scatter_(2, Y[:, :, None], float(-(1.0 / torch.tensor(float(n), dtype=lsm.dtype))))
    g = torch._log_softmax_backward_data(g, lsm, -1, lsm.dtype)
    # nothing before the first trained layer needs a gradient
    first = next(i for i, op in enumerate(plan) if op.params)
    for i in range(len(plan) - 1, first - 1, -1):
        op, s = plan[i], saved[i]
        if op.kind == "linear":
            assert isinstance(s, torch.Tensor)
            out, inp = op.shape
            G[:, op.weight].view(m, out, inp).copy_(_mm(g.transpose(1, 2), s))
            if op.bias is not None:
                G[:, op.bias].copy_(g.sum(1))
            if i > first:
                g = _mm(g, W[:, op.weight].view(m, out, inp))
        elif op.kind == "conv":
            assert isinstance(s, torch.Tensor)
            wk = W[:, op.weight].view(m, *op.shape)
            bias = op.bias is not None

            def conv_bwd(k: int, g=g, s=s, wk=wk, op=op, i=i, bias=bias):
                # the op autograd's ConvolutionBackward0 calls for one client
                return torch.ops.aten.convolution_backward(
                    g[k], s[k], wk[k], [op.shape[0]] if bias else None,
                    list(op.stride), list(op.padding), list(op.dilation), False, [0, 0], 1,
                    [i > first, True, bias])

            g = _client_backward(m, conv_bwd, G, op, i > first, g)
        elif op.kind == "groupnorm":
            assert isinstance(s, tuple)
            a_in, stats = s
            c = op.shape[0]
            hw = math.prod(a_in.shape[3:])
            gam = W[:, op.weight]
            g = g.contiguous()

            def gn_bwd(k: int, g=g, a_in=a_in, stats=stats, gam=gam, c=c, hw=hw, op=op, i=i):
                # the op autograd's NativeGroupNormBackward0 calls for one client
                return torch.ops.aten.native_group_norm_backward(
                    g[k], a_in[k], stats[k][0], stats[k][1], gam[k], n, c, hw, op.groups,
                    [i > first, True, True])

            g = _client_backward(m, gn_bwd, G, op, i > first, g)
        elif op.kind == "batchnorm":
            assert isinstance(s, tuple)
            a_in, stats = s
            gam = W[:, op.weight] if op.weight is not None else None
            g = g.contiguous()

            def bn_bwd(k: int, g=g, a_in=a_in, stats=stats, gam=gam, op=op, i=i):
                # the op autograd's NativeBatchNormBackward0 calls for one client (train
                # mode: the batch's saved mean and 1/σ; the running statistics unused)
                rm, rv, mu, rstd = stats[k]
                return torch.ops.aten.native_batch_norm_backward(
                    g[k], a_in[k], gam[k] if gam is not None else None, rm, rv, mu, rstd,
                    True, op.eps, [i > first, gam is not None, op.bias is not None])

            g = _client_backward(m, bn_bwd, G, op, i > first, g)
        elif op.kind in ("maxpool", "avgpool"):
            assert isinstance(s, tuple)
            flat, idx = s
            gf = g.reshape(m * n, *g.shape[2:])
            if op.kind == "maxpool":
                gf = torch.ops.aten.max_pool2d_with_indices_backward(
                    gf, flat, list(op.kernel), list(op.stride), list(op.padding),
                    list(op.dilation), op.ceil_mode, idx)
            else:
                gf = torch.ops.aten.avg_pool2d_backward(
                    gf, flat, list(op.kernel), list(op.stride), list(op.padding),
                    op.ceil_mode, op.count_include_pad, op.divisor)
            g = gf.view(m, n, *gf.shape[1:])
        elif op.kind == "relu":
            assert isinstance(s, torch.Tensor)
            g = torch.ops.aten.threshold_backward(g, s, 0)
        elif op.kind == "dropout":  # MulBackward0: grad · noise
            assert isinstance(s, torch.Tensor)
            g = g * s
        else:
            assert isinstance(s, torch.Size)
            g = g.reshape(s)
    return lsm, Y


def _client_backward(m: int, one, G: torch.Tensor, op: _Op, need_input: bool,
                     g: torch.Tensor) -> torch.Tensor:
    """A layer's backward client by client: ``one(k)`` is client ``k``'s
    ``(∂ℓ/∂input, ∂ℓ/∂weight, ∂ℓ/∂bias)`` (autograd's own op for the layer); the
    parameter gradients are written into ``G``'s rows (each parameter's slice once a
    step, so ``G`` needs no zeroing first); returns the stacked input gradients, or
    ``g`` as it was where no layer below needs them."""
    dxs = []
    for k in range(m):
        dx, dw, db = one(k)
        if op.weight is not None:
            G[k, op.weight].copy_(dw.reshape(-1))
        if op.bias is not None:
            G[k, op.bias].copy_(db.reshape(-1))
        dxs.append(dx)
    return torch.stack(dxs) if need_input else g


def _batchnorm_forward(op: _Op, a: torch.Tensor, W: torch.Tensor,
                       bufs: list[dict[str, torch.Tensor]] | None
                       ) -> tuple[list[torch.Tensor], list[tuple]]:
    """Train-mode BatchNorm client by client, as ``nn.BatchNorm1d/2d`` runs it: count
    the batch (``num_batches_tracked += 1``), the factor ``momentum`` (``1/count`` for
    ``momentum=None``), then ``native_batch_norm`` (what ``F.batch_norm`` reaches on
    the CPU) on the client's contiguous activations with its own running statistics,
    updated in place. Returns the outputs and what the backward needs."""
    gam = W[:, op.weight] if op.weight is not None else None
    bet = W[:, op.bias] if op.bias is not None else None
    outs, saved = [], []
    for k in range(a.shape[0]):
        rm = rv = None
        factor = 0.0 if op.momentum is None else op.momentum
        if op.stats is not None:
            assert bufs is not None
            b = bufs[k]
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
        saved.append((rm, rv, mu, rstd))
    return outs, saved
