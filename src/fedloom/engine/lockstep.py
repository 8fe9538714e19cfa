"""The ``lockstep`` backend: a cohort's clients train as one batched model.

All clients of a chunk keep their parameters in one ``W ∈ R^{m×d}`` (the flat
vectors of :mod:`fedloom.params`, stacked); a layer's weights are views
``W[:, slice].view(m, …)``. One local step runs every client's forward and
backward on activations ``[m, n, …]`` (client, sample, …) — ``torch.baddbmm``
for Linear, one call on the ``[m·n, C, H, W]`` view for ReLU and pooling,
``log_softmax`` over the last dimension of ``[m, n, C]`` — with the backward
written out by hand, the same operations autograd runs on one client:

    z = a Wᵀ + b                 (addmm per client → baddbmm)
    ℓ = −(1/B) Σ_i log softmax(z_i)[y_i]
    ∂ℓ/∂z = log_softmax_backward(−(1/B) e_{y}, log softmax(z))
    ∂ℓ/∂W = (∂ℓ/∂z)ᵀ a,  ∂ℓ/∂b = Σ_i ∂ℓ/∂z_i,  ∂ℓ/∂a = (∂ℓ/∂z) W
    ReLU: ∂ℓ/∂a = ∂ℓ/∂r · [r > 0]   (threshold_backward on the output, as autograd)
    Conv2d: z_k = conv2d(a_k, K_k, b_k); (∂ℓ/∂a_k, ∂ℓ/∂K_k, ∂ℓ/∂b_k) =
            convolution_backward(∂ℓ/∂z_k, a_k, K_k)       (client by client)
    MaxPool2d: r, i = max_pool2d_with_indices(a); ∂ℓ/∂a = max_pool2d_with_indices_backward
    AvgPool2d: ∂ℓ/∂a = avg_pool2d_backward(∂ℓ/∂r, a)
    Dropout(p): r_k = a_k · u_k, u_k = Bernoulli(1 − p)/(1 − p); ∂ℓ/∂a = ∂ℓ/∂r · u
    GroupNorm: r_k, μ_k, 1/σ_k = native_group_norm(a_k, γ_k, β_k);
               (∂ℓ/∂a_k, ∂ℓ/∂γ_k, ∂ℓ/∂β_k) = native_group_norm_backward(…)  (client by client)
    BatchNorm (train mode): c_k ← c_k + 1;  f = momentum (1/c_k if None);
               r_k, μ_k, 1/σ_k = native_batch_norm(a_k, γ_k, β_k, m̄_k, v̄_k, f)  — which
               sets m̄_k ← (1−f) m̄_k + f μ_k, v̄_k ← (1−f) v̄_k + f s²_k (unbiased) in place;
               (∂ℓ/∂a_k, ∂ℓ/∂γ_k, ∂ℓ/∂β_k) = native_batch_norm_backward(…)  (client by client)

(``convolution_backward``, ``native_group_norm_backward``,
``native_batch_norm_backward`` and the pools' ``*_backward`` are the ops
autograd's ``ConvolutionBackward0`` / ``NativeGroupNormBackward0`` /
``NativeBatchNormBackward0`` / ``MaxPool2DWithIndicesBackward0`` /
``AvgPool2DBackward0`` call) then applies :class:`~fedloom.client.sgd.LocalSGD`'s
rule as one update of all rows (``torch.optim.SGD``: dampening 0, no Nesterov;
d = g + shift + penalty + wd·w + μ(w − w₀), b ← β b + d, w ← w − η b). The
Python and autograd overhead of a step is paid once per chunk instead of once
per client: that is where it is faster than ``sequential`` on a CPU (and
``vmap``, whose ``functional_call`` tracing costs more than it saves there).

**Convolutions.** A grouped convolution over the clients (input
``[n, m·C, H, W]``, kernels ``[m·out, C, k, k]``, ``groups = m``) measured bit
for bit equal to per-client ``conv2d`` forward and ``convolution_backward`` in
float64 (torch's own ``slow_conv2d`` loops over the groups), but in float32 it
is oneDNN's grouped kernel: 2× slower than m calls of the per-client kernel
(profiled: 10 clients × 5 steps of a 8/16-channel CNN on 3×32×32, 274 ms
against 136 ms forward) and not the same sums. So each convolution runs client
by client with the call ``nn.Conv2d`` makes (``F.conv2d`` on ``a[k]``, a
contiguous ``[n, C, H, W]`` slice, and ``K_k`` a view of ``W``), and only the
layers around it are batched: the same kernels as ``sequential`` in both
dtypes. Pools and ReLU act per channel plane, so one call on ``[m·n, C, H, W]``
gives each plane the bits of its own call.

**Dropout.** torch's CPU dropout (``_dropout_impl``) draws ``noise``, shaped as
its input, with ``bernoulli_(1 − p)`` from the global generator, divides it by
``1 − p`` and multiplies; the sequential trainer reseeds that generator with
``derive_seed(gen_seed, step, −1, "dropout")`` before every step's forward.
Lock-step gives each client a ``torch.Generator`` of that seed at every step and
draws its masks on tensors of its own activations' shape, layer by layer in
the chain's order: the same draws, so the same masks (the global generator is
not touched). ``Dropout(p=0)`` draws nothing in torch and is an identity here.

**BatchNorm.** Its running statistics (``running_mean``, ``running_var``,
``num_batches_tracked``) are buffers, not parameters (:mod:`fedloom.buffers`):
each client gets its own copy of the buffers it starts from — its job's
(``model.buffers: local``, FedBN) or else the module's initial ones, as the
sequential trainer loads them — and its train-mode forwards update that copy
in place, step by step, exactly as ``nn.BatchNorm1d/2d`` updates the module's
(the count first, then the momentum or cumulative factor, then the kernel
``F.batch_norm`` reaches on the CPU); the client's result carries it, and the
server treats it as it treats the sequential path's. A batch with one value
per channel is refused with BatchNorm's own ``ValueError``, as on the
sequential path. Any other buffer sends the model to the sequential path.

**Bit for bit.** On CPU, ``torch.bmm``/``baddbmm`` run one GEMM per client with
the operands' own strides, the same BLAS call ``mm``/``addmm`` makes for one
client, except for products with ``contraction × rows × columns < 400``,
which torch computes with its own loop; those run client by client with
``mm``/``addmm``. Gradients are accumulated into a zeroed buffer (``0 + g``,
as autograd adds into the flat ``.grad``), elementwise updates on ``[m, d]``
give each row the bits of the same update on ``[d]``, and a client's loss is
``nll_loss`` of its own rows (torch's cascade summation, reported as the
sequential trainer does: the mean of the per-step Python floats). Clients'
batches are drawn exactly as the sequential trainer draws them (the same
derived generator and :meth:`LocalSGD.batch_indices`); clients whose batches
differ in size at a step (short last batches, ragged client sizes) run in one
group per batch size — no padding, which would change the GEMMs' shapes — and
a client whose steps are done (fewer samples, ``max_steps``) is masked out of
the update. Measured (``tests/test_lockstep.py``, torch 2.13 with MKL on
x86-64 AVX2): in float64 every client update, the final ``w`` and its
``model_sha256`` equal ``sequential``'s bit for bit — MLPs, and CNNs (the
built-in ``cnn``, ``leaf_cnn``, ``flare_cnn``, narrowed, and chains with
strided, dilated, padded and bias-free convolutions, max- and average pools)
— with ragged client sizes, momentum, weight decay, FedProx's μ, SCAFFOLD's
shift and FLARE's penalty; with dropout (a chain of pfl-research's benchmark
CNN's layers, the CRAFT code's CNN), GroupNorm and BatchNorm chains too
(BatchNorm1d/2d, momentum 0.1 and ``None``, with and without affine
parameters or running statistics, from the module's buffers and from each
job's: every update, loss and running statistic equal in float64 and float32;
whole runs under ``model.buffers: average`` and ``local``: the same global
model and buffers). In float32 they
agree to float32 rounding (the test
bounds the final ``w`` at rtol 1e-5, atol 1e-6; the narrowed CNNs measured
bit-equal): MKL's float32 batched GEMM sums the ``(∂ℓ/∂z)ᵀ a`` product of a
narrow layer (10 outputs) in another order than its single GEMM. On other
BLAS builds or devices the equality is what the tests measure there, not a
guarantee.

Supported models: ones ``torch.fx`` traces to a chain (each node feeds the
next) of ``nn.Linear`` (with or without bias), ``nn.Conv2d`` (zero padding,
numeric or ``"valid"``, any stride/dilation, ``groups = 1``),
``nn.MaxPool2d`` (without ``return_indices``), ``nn.AvgPool2d``, ``nn.Dropout``
(not in place, p < 1), ``nn.GroupNorm`` (affine; client by client, as Conv2d),
``nn.BatchNorm1d`` / ``nn.BatchNorm2d`` (client by client, each client's own
running statistics), ``nn.ReLU`` /
``torch.relu`` / ``F.relu``, ``nn.Flatten`` / ``torch.flatten`` (from dim 1),
``nn.Identity``, ending in the logits of the cross-entropy; every parameter
trained (in the layout), no buffers but BatchNorm's, no module called twice; the samples'
shape is carried through the chain (a Conv2d or pool sees ``[C, H, W]``, a
Linear one vector). Everything else trains on the sequential path with one
line in the log naming why: other layers (``BatchNorm3d``, ``Dropout2d``,
adaptive pools, ``LayerNorm``, grouped or ``"same"``-padded convolutions, recurrent), local methods
other than plain SGD/FedProx (``client.method``), ``client.amp``, data
augmentation, a random train-mode forward other than the chain's dropout, and
jobs that ask for a smoothness
probe or carry a method's objective, mask or μ (these per chunk).

The cohort runs in chunks of ``chunk`` clients (``backend.chunk``; default: as
many as fit in 4 MB of stacked parameters of the run's dtype, but at least 8
while they fit in 64 MB — 8 clients of the reference MLP in float32). Measured
on the reference workload (100 clients a round, MLP 784-200-10, one intra-op
thread, the 2-core machine shared with other jobs at load 7): a round's local
training took 4.3–4.4 s in chunks of 4 or 8 clients, 4.3–5.3 s in chunks of
16–32 and 5.4–6.3 s with all 100 at once, against 6.6–6.9 s on the sequential
path: the stacked weights of a whole cohort (64 MB) fall out of the cache at
every step. For a CNN (``cnn`` with 8/16 channels on 3×32×32, 533,754
parameters, 24 clients × 50 images, batch 10; load 9–10, one thread, second
of two interleaved passes) local training took 4.4 s in chunks of 1, 3.1 s of
2, 2.9 s of 4 and 2.8 s of 8 against 4.0 s sequential: the 4 MB rule alone
would give chunks of 1. Whole rounds (same machine, load 4.6–6.5, one thread,
five rounds of each backend interleaved): lockstep 8.4 s, sequential 14.5 s,
vmap 10.3 s (medians), 1.7× sequential; the final float32 models were
bit-equal to sequential's with one thread (with two, 1.5e-8 apart). The GEMMs
and convolutions are the same as sequential's (one per client and layer);
what lock-step saves is the per-client Python, module and autograd work of
every step — a larger share of a step the smaller the model.

``benchmarks/bench.py --only lockstep lockstep_cnn`` (sections 7 and 7b, one
thread, three timed rounds of each backend interleaved after a warm-up, the
machine at load 8–15 from other jobs): the reference MLP at 100 clients a
round, lockstep 9.17 s, sequential 12.34 s, vmap 8.87 s (1.35× sequential,
0.97× vmap); the CNN of section 7b (``cnn`` 8/16 channels, 3×32×32, 50
clients a round, batch 10) lockstep 7.61 s, sequential 8.76 s, vmap 11.33 s
(1.15× sequential, 1.49× vmap). Both final float32 models were bit-equal to
sequential's. The same CNN section with the default two threads at load
12–15 measured lockstep 103 s, sequential 257 s, vmap 138 s a round (2.5×;
fewer, larger calls leave fewer OpenMP barriers to spin at) and final models
1.4e-4 apart after four rounds: with two threads MKL's float32 ``bmm`` splits
its work otherwise than ``mm`` (one local epoch of 8 clients, 3×32×32 images,
two threads: the updates of the CNN, and of its convolutions with one Linear
layer, 7.5e-9 apart, of an MLP 3072-512-10 1.9e-8; a chain of convolutions and
pools alone 0.0; all three 0.0 with one thread).

On the idle machine (one full ``make bench``, ``benchmarks/results.md``) the
gain is smaller: at one thread, interleaved, the MLP at 100 a round 2.80 s
against sequential's 3.05 s (1.09×) and the CNN 2.53 s against 2.55 s (1.01×)
— a loaded machine taxes per-call overhead most, and that is what lock-step
saves; at the default two threads (section 1, not interleaved) lockstep 1.77 s
against sequential's 2.93 s (1.65×), and inside the ``process`` backend's two
single-thread workers (``backend.inner: lockstep``) 1.59 s, the fastest
fedloom round there.

Not supported yet (they fall back): residual networks — in the papers'
models the normalisation layers sit inside ``resnet``, ``resnet9`` and
``resnet18``, which are not chains, so GroupNorm and BatchNorm help only
user chains until branching graphs are supported —, ``Dropout2d``, adaptive
pools.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedloom.buffers import buffer_names
from fedloom.capabilities import BackendCaps
from fedloom.client.methods import LocalMethod
from fedloom.client.sgd import ClientJob, ClientResult, LocalSGD
from fedloom.client.transforms import StepContext, jobs_chain
from fedloom.config import BackendConfig
from fedloom.params import Layout
from fedloom.registry import register
from fedloom.rng import Purpose, derive_seed

__all__ = ["LockstepBackend", "job_reason", "lockstep_plan", "shape_reason"]

log = logging.getLogger("fedloom")

# torch's bmm/baddbmm compute products below this size (contraction × rows ×
# columns) with their own loop, not the BLAS GEMM that mm/addmm call.
_SMALL_GEMM = 400


@dataclass(frozen=True)
class _Op:
    """One layer of the chain: ``linear`` / ``conv`` (weight/bias slices of ``w``),
    ``relu``, ``flatten`` (per-sample dims ``start..end`` → one), ``maxpool`` or
    ``avgpool``; the 2-d layers' geometry as pairs."""

    kind: str
    weight: slice | None = None
    bias: slice | None = None
    shape: tuple[int, ...] = (0, 0)   # linear: (out, in); conv: (out, in, kh, kw)
    start: int = 1                    # flatten: per-sample dims, as nn.Flatten's
    end: int = -1
    kernel: tuple[int, int] = (1, 1)  # pooling
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    ceil_mode: bool = False
    count_include_pad: bool = True    # avgpool
    divisor: int | None = None        # avgpool's divisor_override
    p: float = 0.0                    # dropout
    groups: int = 1                   # groupnorm: groups and ε
    eps: float = 1e-5
    momentum: float | None = 0.1      # batchnorm: None is the cumulative average
    stats: tuple[str, str, str] | None = None  # batchnorm: its buffers' names
    dims: tuple[int, ...] = ()        # batchnorm: the per-sample ranks it takes

    @property
    def params(self) -> bool:
        return self.kind in ("linear", "conv", "groupnorm") or (
            self.kind == "batchnorm" and self.weight is not None)


def lockstep_plan(module: nn.Module, layout: Layout) -> tuple[list[_Op] | None, str | None]:
    """The module as a chain of supported layers, or ``(None, why not)``."""
    names = {n for n, _ in module.named_parameters()}
    if names != set(layout._by_name):
        return None, "the model has frozen parameters"
    import torch.fx  # only here: tracing is this backend's business

    try:
        gm = torch.fx.symbolic_trace(module)
    except Exception as e:  # anything fx cannot trace is not a chain we know
        return None, f"the model cannot be traced by torch.fx ({type(e).__name__})"
    mods = dict(module.named_modules())
    ops: list[_Op] = []
    prev = None
    seen: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            if prev is not None:
                return None, "the model takes more than one input"
            prev = node
            continue
        if node.op == "output":
            if node.args[0] is not prev:
                return None, "the model's output is not the last layer's"
            break
        tensors = [a for a in node.all_input_nodes]
        if tensors != [prev] or len(prev.users) != 1:
            return None, f"the model is not a chain of layers (at {node.name})"
        op = _as_op(node, mods, layout, seen)
        if isinstance(op, str):
            return None, op
        if op is not None:
            ops.append(op)
        prev = node
    if not any(o.params for o in ops):
        return None, "the model has no Linear or Conv2d layer"
    # every buffer must be a BatchNorm's running statistics (per client, see _train)
    owned = {n for o in ops if o.stats is not None for n in o.stats}
    other = [n for n in buffer_names(module) if n not in owned]
    if other:
        return None, f"the model has buffers other than BatchNorm's ({other[0]})"
    return ops, None


def _as_op(node, mods: dict[str, nn.Module], layout: Layout,
           seen: set[str]) -> _Op | str | None:
    """The node as an op, ``None`` for an identity, or why it is not supported."""
    if node.op == "call_module":
        if node.target in seen:
            return "a layer is called twice (shared weights)"
        seen.add(node.target)
        mod = mods[node.target]
        if isinstance(mod, nn.Identity):
            return None
        if isinstance(mod, nn.ReLU):
            return _Op("relu")
        if isinstance(mod, nn.Flatten):
            return _flatten(mod.start_dim, mod.end_dim)
        if type(mod) is nn.Linear:
            p = node.target + "."
            w = layout._by_name[p + "weight"]
            b = layout._by_name.get(p + "bias")
            return _Op("linear", w.slice, b.slice if b is not None else None,
                       (mod.out_features, mod.in_features))
        if type(mod) is nn.Conv2d:
            return _conv(node.target, mod, layout)
        if type(mod) in (nn.MaxPool2d, nn.AvgPool2d):
            return _pool(node.target, mod)
        if type(mod) is nn.GroupNorm:
            if not mod.affine:
                return f"GroupNorm without affine parameters ({node.target}) is not supported"
            w = layout._by_name[node.target + ".weight"]
            b = layout._by_name[node.target + ".bias"]
            return _Op("groupnorm", w.slice, b.slice, (mod.num_channels,),
                       groups=mod.num_groups, eps=float(mod.eps))
        if type(mod) in (nn.BatchNorm1d, nn.BatchNorm2d):
            return _batchnorm(node.target, mod, layout)
        if type(mod) is nn.Dropout:
            if mod.inplace:
                return f"in-place Dropout ({node.target}) is not supported"
            if mod.p == 0:  # torch's dropout returns its input and draws nothing
                return None
            if mod.p >= 1:
                return f"Dropout(p={mod.p}) ({node.target}) is not supported"
            return _Op("dropout", p=float(mod.p))
        return f"layer {type(mod).__name__} ({node.target}) is not supported"
    if node.op == "call_function" and node.target in (torch.relu, F.relu):
        if node.kwargs.get("inplace") or len(node.args) > 1:
            return "in-place relu is not supported"
        return _Op("relu")
    if node.op == "call_function" and node.target is torch.flatten:
        a, kw = node.args, node.kwargs
        start = a[1] if len(a) > 1 else kw.get("start_dim", 0)
        end = a[2] if len(a) > 2 else kw.get("end_dim", -1)
        return _flatten(start, end)
    return f"operation {node.target} ({node.name}) is not supported"


def _conv(name: str, mod: nn.Conv2d, layout: Layout) -> _Op | str:
    if mod.groups != 1:
        return f"a grouped Conv2d ({name}, groups={mod.groups}) is not supported"
    if mod.padding_mode != "zeros":
        return f"Conv2d padding_mode {mod.padding_mode} ({name}) is not supported"
    pad = mod.padding
    if isinstance(pad, str):
        if pad != "valid":  # "same" may pad asymmetrically: another kernel call
            return f"Conv2d padding='{pad}' ({name}) is not supported"
        pad = (0, 0)
    w = layout._by_name[name + ".weight"]
    b = layout._by_name.get(name + ".bias")
    kh, kw = mod.kernel_size
    return _Op("conv", w.slice, b.slice if b is not None else None,
               (mod.out_channels, mod.in_channels, kh, kw), stride=_pair(mod.stride),
               padding=_pair(pad), dilation=_pair(mod.dilation))


def _batchnorm(name: str, mod: nn.BatchNorm1d | nn.BatchNorm2d, layout: Layout) -> _Op:
    w = layout._by_name.get(name + ".weight") if mod.affine else None
    b = layout._by_name.get(name + ".bias") if mod.affine else None
    stats = None
    if mod.track_running_stats:
        stats = (f"{name}.running_mean", f"{name}.running_var", f"{name}.num_batches_tracked")
    return _Op("batchnorm", w.slice if w is not None else None,
               b.slice if b is not None else None, (mod.num_features,), eps=float(mod.eps),
               momentum=None if mod.momentum is None else float(mod.momentum), stats=stats,
               dims=(1, 2) if isinstance(mod, nn.BatchNorm1d) else (3,))


def _pool(name: str, mod: nn.MaxPool2d | nn.AvgPool2d) -> _Op | str:
    k = _pair(mod.kernel_size)
    # nn's pools take stride None (or empty) for "the kernel size"
    stride = _pair(mod.stride) if mod.stride not in (None, ()) else k
    if isinstance(mod, nn.MaxPool2d):
        if mod.return_indices:
            return f"MaxPool2d with return_indices ({name}) is not supported"
        return _Op("maxpool", kernel=k, stride=stride, padding=_pair(mod.padding),
                   dilation=_pair(mod.dilation), ceil_mode=bool(mod.ceil_mode))
    return _Op("avgpool", kernel=k, stride=stride, padding=_pair(mod.padding),
               ceil_mode=bool(mod.ceil_mode), count_include_pad=bool(mod.count_include_pad),
               divisor=mod.divisor_override)


def _pair(v) -> tuple[int, int]:
    if isinstance(v, int):
        return (v, v)
    t = tuple(int(x) for x in v)
    return (t[0], t[0]) if len(t) == 1 else (t[0], t[1])


def _flatten(start: int = 1, end: int = -1) -> _Op | str:
    if start != 1:
        return "a flatten that merges the batch dimension is not supported"
    return _Op("flatten", start=start, end=end)


def shape_reason(plan: list[_Op], sample: tuple[int, ...]) -> str | None:
    """Why the chain cannot run on samples of shape ``sample`` (None: it can): every
    Linear must see one feature vector per sample (``F.linear`` on more dimensions is
    another kernel), every Conv2d and pool an image ``[C, H, W]`` per sample (fewer
    dimensions would be read as one unbatched image), and the logits must be one
    vector per sample. The shapes are carried through the chain on the meta device."""
    shape = tuple(sample)
    for op in plan:
        if op.kind == "flatten":
            end = op.end if op.end >= 0 else len(shape) + 1 + op.end  # nn.Flatten counts the batch
            end = max(end, 1)
            shape = (math.prod(shape[:end]), *shape[end:])
        elif op.kind == "linear":
            if len(shape) != 1:
                return f"a Linear layer on {len(shape)}-dimensional samples"
            if shape[0] != op.shape[1]:
                return f"a Linear layer of {op.shape[1]} inputs on {shape[0]} features"
            shape = (op.shape[0],)
        elif op.kind == "groupnorm":
            if len(shape) < 1 or shape[0] != op.shape[0]:
                return f"a GroupNorm of {op.shape[0]} channels on samples of shape {list(shape)}"
        elif op.kind == "batchnorm":
            if len(shape) not in op.dims or shape[0] != op.shape[0]:
                return (f"a BatchNorm of {op.shape[0]} features on samples of shape "
                        f"{list(shape)}")
        elif op.kind in ("conv", "maxpool", "avgpool"):
            if len(shape) != 3:
                return f"a {op.kind} layer on {len(shape)}-dimensional samples"
            try:
                shape = tuple(_forward(op, torch.empty((1, *shape), device="meta"),
                                       torch.empty(op.shape, device="meta"), None)[0]
                              .shape[1:])
            except RuntimeError as e:  # the layer cannot take these images
                return f"a {op.kind} layer on samples of shape {list(shape)} ({e})"
    return None if len(shape) == 1 else f"logits of {len(shape)} dimensions per sample"


def trainer_reason(trainer: LocalSGD, method: LocalMethod,
                   plan: list[_Op] | None = None) -> str | None:
    """Why local training with these settings is not lock-step's (None: it is). A
    random train-mode forward is lock-step's where it is the plan's dropout (the only
    random layer a plan admits)."""
    if type(method) is not LocalMethod:
        return f"local method {method.name} is not plain SGD/FedProx"
    if trainer.amp != "none":
        return f"client.amp {trainer.amp}"
    if trainer.augment is not None:
        return "data augmentation"
    if trainer.random_forward and not (
            plan is not None and any(o.kind == "dropout" for o in plan)):
        return "the train-mode forward draws random numbers"
    return None


def job_reason(jobs: Sequence[ClientJob]) -> str | None:
    """Why these jobs are not lock-step's (None: they are)."""
    for j in jobs:
        if j.probe_smoothness:
            return "a job asks for the smoothness probe"
        if j.objective is not None or j.grad_mask is not None or j.prox_mu is not None:
            return "a job carries a local method's objective, mask or prox weight"
    return None


class LockstepBackend:
    """See the module docstring."""

    name = "lockstep"
    capabilities = BackendCaps()  # trains on the samples each job carries

    def __init__(self, trainer: LocalSGD, method: LocalMethod, chunk: int | None = None,
                 x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> None:
        self.trainer, self.method, self.x, self.y = trainer, method, x, y
        self.plan, reason = lockstep_plan(trainer.module, trainer.layout)
        self.reason = trainer_reason(trainer, method, self.plan) or reason
        self.enabled = self.reason is None
        p = next(trainer.module.parameters(), None)
        size = p.element_size() if p is not None else 4
        # Cache-sized chunks: a step streams each client's weights, gradient and
        # momentum several times; 4 MB of stacked weights keeps them in cache. At
        # least 8 clients (up to 64 MB): a CNN's few weights are not what its step
        # streams, and chunks of 1-2 clients save little of the per-client work.
        per = size * max(1, trainer.layout.size)
        self.chunk = chunk or max(1, min(max((4 << 20) // per, 8), (64 << 20) // per))
        self._noted: set[str] = set()

    def _note(self, why: str) -> None:
        if why not in self._noted:  # one line per reason, not one per round
            self._noted.add(why)
            log.info("backend lockstep: %s; training on the sequential path", why)

    def _sequential(self, jobs: Sequence[ClientJob]) -> list[ClientResult | None]:
        return [self.method.run(self.trainer, j) for j in jobs]

    def train_cohort(self, jobs: Sequence[ClientJob]) -> list[ClientResult | None]:
        if self.reason is not None:
            self._note(self.reason)
            return self._sequential(jobs)
        out: list[ClientResult | None] = []
        for s in range(0, len(jobs), self.chunk):
            part = list(jobs[s : s + self.chunk])
            assert self.plan is not None
            why = job_reason(part) or shape_reason(self.plan, tuple(part[0].x.shape[1:]))
            if why is not None:
                self._note(why)
                out += self._sequential(part)
            else:
                out += self._train(part)
        return out

    # ------------------------------------------------------------------ training
    def _train(self, jobs: list[ClientJob]) -> list[ClientResult]:
        tr, m = self.trainer, len(jobs)
        assert self.plan is not None
        W0 = torch.stack([j.w for j in jobs])
        W = torch.stack([j.start if j.start is not None else j.w for j in jobs])
        start_loss = [tr.full_loss(j.w, j.x, j.y, buffers=j.buffers) if j.start_loss else None
                      for j in jobs]
        batches = [tr.job_batches(j) for j in jobs]
        steps = [len(b) for b in batches]
        src_x, src_y, table = self._table(jobs, batches, W.device)
        # The direction's terms, as the sequential trainer's (fedloom.client.transforms).
        direction = jobs_chain(jobs, W, weight_decay=tr.weight_decay, prox_mu=tr.prox_mu,
                               momentum=tr.momentum, extra=tr.transforms)
        dstate = direction.init(W)
        lrs = [float(j.lr) for j in jobs]
        lr_col = torch.tensor(lrs, dtype=W.dtype, device=W.device)[:, None]
        G = torch.zeros_like(W)
        losses: list[list[torch.Tensor]] = [[] for _ in range(m)]
        every = torch.arange(m, device=W.device)
        dropout = any(o.kind == "dropout" for o in self.plan)
        bufs = self._start_buffers(jobs)
        for t in range(max(steps)):
            # Clients with a batch at step t, grouped by its size (one group: all).
            groups: dict[int, list[int]] = {}
            for k in range(m):
                if t < steps[k]:
                    groups.setdefault(len(batches[k][t]), []).append(k)
            active = sum(len(g) for g in groups.values())
            G.zero_()
            for n, ks in groups.items():
                rows = every if len(ks) == m else torch.tensor(ks, device=W.device)
                idx = table[rows, t, :n]
                whole = len(ks) == m
                Gr = G if whole else torch.zeros(len(ks), W.shape[1], dtype=W.dtype,
                                                 device=W.device)
                # the seed of step t's dropout masks, as the sequential trainer reseeds
                seeds = ([derive_seed(jobs[k].gen_seed, t, -1, Purpose.DROPOUT) for k in ks]
                         if dropout else None)
                lsm, Y = _step(self.plan, W if whole else W[rows], src_x[idx], src_y[idx], Gr,
                               seeds, [bufs[k] for k in ks])
                if not whole:
                    G[rows] = Gr
                for r, k in enumerate(ks):
                    # the client's own loss: nll_loss of its rows, the sequential bits
                    losses[k].append(F.nll_loss(lsm[r], Y[r]).detach())
            with torch.no_grad():
                # (a finished client's momentum buffer is never used again)
                D, dstate = direction.update(G, dstate, StepContext(
                    t, W, W0, live=[t < s for s in steps]))
                if active == m and len(set(lrs)) == 1:
                    W.sub_(D, alpha=lrs[0])
                else:  # per-client η, finished clients η = 0 (w − 0 is w, bit for bit)
                    live = torch.tensor([1.0 if t < s else 0.0 for s in steps],
                                        dtype=W.dtype, device=W.device)[:, None]
                    W.addcmul_(lr_col * live, D, value=-1.0)
        out = []
        for k, j in enumerate(jobs):
            loss_sum = 0.0
            for v in losses[k]:  # Python floats in step order, as LocalSGD sums them
                loss_sum += float(v)
            out.append(ClientResult(j.client, (j.w - W[k]).contiguous(), int(j.y.shape[0]),
                                    loss_sum / max(1, steps[k]), steps[k], start_loss[k],
                                    buffers=bufs[k]))
        return out

    def _start_buffers(self, jobs: list[ClientJob]) -> list[dict[str, torch.Tensor]]:
        """Each client's own copy of the buffers it starts from — the job's, else the
        module's initial ones, as the sequential trainer loads them — which its
        train-mode forwards update in place and its result carries."""
        fm = self.trainer._flat_module()
        if not fm.buffers:
            return [{} for _ in jobs]
        out = []
        for j in jobs:
            start = j.buffers if j.buffers else fm.init_buffers
            out.append({n: torch.empty_like(v).copy_(start.get(n, fm.init_buffers[n]))
                        for n, v in fm.buffers.items()})
        return out

    def _table(self, jobs: list[ClientJob], batches: list[list[torch.Tensor]],
               dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The source rows and an ``[m, T, B]`` table of every client's batch
        positions into them (unused cells: −1, never read)."""
        m = len(jobs)
        if self.x is not None and all(j.data_index is not None for j in jobs):
            src_x, src_y = self.x, self.y
            owners = [j.data_index for j in jobs]
        else:
            src_x = torch.cat([j.x for j in jobs])
            src_y = torch.cat([j.y for j in jobs])
            offs = [0]
            for j in jobs:
                offs.append(offs[-1] + int(j.y.shape[0]))
            owners = [torch.arange(offs[k], offs[k + 1]) for k in range(m)]
        T = max(len(b) for b in batches)
        B = max(len(i) for b in batches for i in b)
        table = torch.full((m, T, B), -1, dtype=torch.long)
        for k, b in enumerate(batches):
            own = owners[k].cpu()
            for t, i in enumerate(b):
                table[k, t, : len(i)] = own[i]
        assert src_y is not None
        return src_x, src_y, table.to(dev)


# -------------------------------------------------------------------- the step
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
        return F.conv2d(a, weight, bias, op.stride, op.padding, op.dilation), None
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
    ``X [m, n, ...]``, ``Y [m, n]``: the gradients are added into ``G`` (zeroed);
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
            G[:, op.weight].view(m, out, inp).add_(_mm(g.transpose(1, 2), s))
            if op.bias is not None:
                G[:, op.bias].add_(g.sum(1))
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
    parameter gradients are added into ``G``'s rows (``0 + g``, elementwise: the bits
    of adding them in the layer's shape); returns the stacked input gradients, or
    ``g`` as it was where no layer below needs them."""
    dxs = []
    for k in range(m):
        dx, dw, db = one(k)
        if op.weight is not None:
            G[k, op.weight].add_(dw.reshape(-1))
        if op.bias is not None:
            G[k, op.bias].add_(db.reshape(-1))
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
        F._verify_batch_size(a[k].size())  # F.batch_norm's own check (one value a channel)
        o, mu, rstd = torch.ops.aten.native_batch_norm(
            a[k], gam[k] if gam is not None else None, bet[k] if bet is not None else None,
            rm, rv, True, factor, op.eps)
        outs.append(o)
        saved.append((rm, rv, mu, rstd))
    return outs, saved


@register("backend", "lockstep")
def _lockstep(trainer: LocalSGD, method: LocalMethod, cfg: BackendConfig | None = None,
              x: torch.Tensor | None = None, y: torch.Tensor | None = None) -> LockstepBackend:
    return LockstepBackend(trainer, method,
                           chunk=(cfg.chunk or None) if cfg is not None else None, x=x, y=y)

