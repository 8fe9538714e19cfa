"""Error-feedback policies for compressed uplinks.

Per-client state (residual ``e_k``, EF21's ``h_k``, SCAFCOM's ``c_k``, ``v_k``) is rows of
the per-client store, written back for the accepted clients only; server state goes in
and comes back. Formulas use ``g_k = w − w_k`` (trainable parameters only).

- ``none``: send ``C(g_k)``.
- ``ef`` (Seide et al. 2014; Stich & Karimireddy 2019): ``u = e + g``, send
  ``C(u)``, ``e ← u − C(u)``.
- ``sapef`` — SA-PEF (arXiv 2601.20738): start from ``w − α e``, then ``u = (1 − α) e + g``,
  send ``C(u)``, ``e ← u − C(u)``; α = 0 is EF, α = 1 is ``saef``; ``alpha_schedule``
  ``constant``, ``theory`` (``α* = 1/(1 + 12 s_r²)``) or ``residual`` (:func:`residual_alpha`).
- ``ef21`` (Richtárik, Sokolov & Fatkhullin, NeurIPS 2021): ``c_k = C(g_k − h_k)``,
  ``h_k ← h_k + c_k``; under partial participation EF21-PP (arXiv 2110.03294,
  ``ef21_mean: all``) or the sampled clients' mean. See :class:`EF21`.
- ``cser`` (Xie et al. 2020, simplified as in SA-PEF's code): EF plus a periodic
  reset of the residuals' mean.
- ``flare`` and ``ec_prox``: see :mod:`fedloom.compress.flare`.
- ``scafcom`` (Huang, Li, Yin & Ye, ICLR 2024): SCAFFOLD local steps, a momentum
  ``v_k`` of the corrected gradient, send ``C(v_k − c_k)``. See :class:`SCAFCOM`.

Every policy keeps ``u == decode(payload) + e_new`` (the residual is computed from the
decoded payload), exactly for sparsifiers and casts. Each policy's rule in full, the state
and the online smoothness ``L̂`` of ``theory``: docs/explanation/methods.md (Error feedback
in detail).
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
