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


The package: :mod:`fedloom.engine.lockstep.plan` (the model as a chain of the
layers lock-step runs, and which models those are), :mod:`fedloom.engine.lockstep.step`
(one local step's forward and backward for every client: convolutions, dropout,
BatchNorm, and why the result is sequential's bit for bit) and
:mod:`fedloom.engine.lockstep.backend` (:class:`LockstepBackend`: chunks, the
fallbacks to the sequential path, the measurements). Importing the package registers
the backend ``lockstep``.
"""

from __future__ import annotations

from fedloom.engine.lockstep.backend import (  # noqa: F401  (re-exported)
    LockstepBackend,
    job_reason,
    shape_reason,
    trainer_reason,
)
from fedloom.engine.lockstep.plan import lockstep_plan

__all__ = ["LockstepBackend", "job_reason", "lockstep_plan", "shape_reason"]
