"""The ``lockstep`` backend: a cohort's clients train as one batched model.

All clients of a chunk keep their parameters in one ``W ∈ R^{m×d}`` (the flat
vectors of :mod:`fedloom.params`, stacked); a layer's weights are views
``W[:, slice].view(m, …)``. One local step runs every client's forward and
backward on activations ``[m, n, …]`` (client, sample, …) — ``torch.baddbmm``
for Linear, one call on the ``[m·n, C, H, W]`` view for ReLU and pooling,
``log_softmax`` over the last dimension of ``[m, n, C]``; convolutions and norm
layers client by client — with the backward written out by hand (the ops
autograd calls), then :class:`~fedloom.client.sgd.LocalSGD`'s rule as one update
of all rows. The Python and autograd overhead of a step is paid once per chunk
instead of once per client: that is where it is faster than ``sequential`` on a
CPU (and ``vmap``). Results are ``sequential``'s bit for bit in float64
(:mod:`fedloom.engine.trainers.lockstep.step`).

The package: :mod:`~fedloom.engine.trainers.lockstep.plan` (which models it runs),
:mod:`~fedloom.engine.trainers.lockstep.step` (one step's forward and backward) and
:mod:`~fedloom.engine.trainers.lockstep.backend` (chunks, fallbacks). Importing it
registers the backend ``lockstep``. Each operation written out:
docs/explanation/backends.md (Lock-step).
"""

from __future__ import annotations

from fedloom.engine.trainers.lockstep.backend import (  # noqa: F401  (re-exported)
    LockstepBackend,
    job_reason,
    shape_reason,
    trainer_reason,
)
from fedloom.engine.trainers.lockstep.plan import lockstep_plan

__all__ = ["LockstepBackend", "job_reason", "lockstep_plan", "shape_reason"]
