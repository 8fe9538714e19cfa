"""Error-feedback policies for compressed uplinks.

A policy holds settings. Each client's state (residual ``e_k``, EF21's
``h_k``, SCAFCOM's ``c_k`` and ``v_k``) is rows of the per-client store,
gathered for the cohort and scattered back for the **accepted** clients only —
a client that is not sampled keeps its state untouched. Server-side state
(SA-PEF's ``L̂``, EF21's ``ḡ``, SCAFCOM's ``c``) goes in and comes back. All
formulas use the pseudo-gradient sign ``g_k = w − w_k``. ``g_k`` holds the
trainable parameters only: module buffers (BatchNorm statistics) are never
compressed and never enter a residual or any other state of a policy
(:mod:`fedloom.buffers`).

- ``none``: send ``C(g_k)``.
- ``ef`` (Seide et al. 2014; Stich & Karimireddy 2019): ``u = e + g``, send
  ``C(u)``, ``e ← u − C(u)``.
- ``sapef`` — SA-PEF (arXiv 2601.20738): step ahead ``x_0 = w − α e``, train,
  ``g = w − x_T`` (from the **received** w, so it includes the shift),
  ``u = (1 − α) e + g``, send ``C(u)``, ``e ← u − C(u)``. α = 0 is EF,
  α = 1 is SAEF (``saef``). ``alpha_schedule``: ``constant`` (public default
  0.85) or ``theory``: ``α* = 1/(1 + 12 s_r²)``, ``s_r = η_r L̂ T``, the
  minimiser of the paper's residual contraction
  ``(1 − 1/δ)[2(1 − α)² + 24 α² s_r²]``, or ``residual`` (fedloom's; the
  paper's future work, an α from online estimates): see :func:`residual_alpha`.
- ``ef21`` (Richtárik, Sokolov & Fatkhullin, "EF21: A New, Simpler,
  Theoretically Better, and Practically Faster Error Feedback", NeurIPS
  2021), delta form: ``c_k = C(g_k − h_k)``, ``h_k ← h_k + c_k``. Under
  partial participation two rules exist (``compression.ef21_mean``):
  ``all`` (default) is EF21-PP (Fatkhullin, Sokolov, Gorbunov, Li &
  Richtárik, "EF21 with Bells & Whistles", arXiv 2110.03294, Algorithm
  EF21-PP): the step is the mean over **all** N clients' stored ``h_k``,
  ``ḡ ← ḡ + (1/N) Σ_{k∈S} c_k``; ``sampled`` steps along the mean of the
  sampled clients' ``h_k`` only. See :class:`EF21`.
- ``cser`` (Xie et al. 2020, simplified as in SA-PEF's code): EF, and every
  ``H`` rounds each client also sends the top ``reset_ratio`` of its residual;
  the server subtracts their mean ``ē`` from the model (pseudo-gradient sign)
  and broadcasts it; each client's residual becomes ``e − ē``.
- ``flare`` and ``ec_prox``: see :mod:`fedloom.compress.flare`.
- ``scafcom`` (Huang, Li, Yin & Ye, "Stochastic Controlled Averaging for
  Federated Learning with Communication Compression", ICLR 2024): SCAFFOLD
  local steps with ``c − c_k``; ``v_k ← (1−β)v_k + β(g_k/(η_l S) + c_k − c)``,
  ``δ_k = v_k − c_k``, send ``C(δ_k)``, ``c_k ← c_k + C(δ_k)``, and
  ``c ← c + (m/N) mean C(δ_k)``; ``S`` is the sum of the local optimizer's
  step multipliers (``K`` for plain SGD). See :class:`SCAFCOM`.

Every policy keeps ``u == decode(payload) + e_new`` (the residual is computed
from the decoded payload, so float16 values or quantisation error stay in the
residual), exactly for sparsifiers and casts.

Online smoothness ``L̂`` for ``theory``: each sampled client measures
``‖∇f(x_1) − ∇f(x_0)‖ / ‖x_1 − x_0‖`` on its first batch across its first
local step (a secant estimate along the local trajectory); ``L̂`` is the
running maximum over rounds of the cohort median, so one noisy batch does not
drive α* to 0. Until a first estimate exists, ``alpha`` is used.
"""

from __future__ import annotations

from fedloom.compress.feedback.base import NoFeedback, UplinkContext, UplinkResult
from fedloom.compress.feedback.base import RoundEnd as RoundEnd
from fedloom.compress.feedback.base import ServerState as ServerState
from fedloom.compress.feedback.ef import CSER, ErrorFeedback
from fedloom.compress.feedback.ef import SCHEDULES as SCHEDULES
from fedloom.compress.feedback.ef import Schedule as Schedule
from fedloom.compress.feedback.ef import residual_alpha as residual_alpha
from fedloom.compress.feedback.ef21 import EF21
from fedloom.compress.feedback.factories import cser as cser
from fedloom.compress.feedback.factories import ef21 as ef21
from fedloom.compress.feedback.factories import error_feedback as error_feedback
from fedloom.compress.feedback.factories import feedback_from_config, make_feedback
from fedloom.compress.feedback.factories import no_feedback as no_feedback
from fedloom.compress.feedback.factories import scafcom as scafcom
from fedloom.compress.feedback.factories import step_ahead_ef as step_ahead_ef
from fedloom.compress.feedback.factories import step_ahead_partial_ef as step_ahead_partial_ef
from fedloom.compress.feedback.scafcom import SCAFCOM
from fedloom.job import local_step_sum

__all__ = ["CSER", "EF21", "SCAFCOM", "ErrorFeedback", "NoFeedback", "UplinkContext",
           "UplinkResult", "feedback_from_config", "local_step_sum", "make_feedback"]
