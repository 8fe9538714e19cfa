"""The built-in feedback policies' registrations (their factories, in the order
``fedloom algorithms`` has always registered them), :func:`make_feedback` and
:func:`feedback_from_config` (:mod:`fedloom.compress.feedback`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fedloom.compress.feedback.base import NoFeedback
from fedloom.compress.feedback.ef import CSER, ErrorFeedback
from fedloom.compress.feedback.ef21 import EF21
from fedloom.compress.feedback.scafcom import SCAFCOM
from fedloom.registry import Range, accepted_options, build, get, register

# ------------------------------------------------------------------ registry
# Each policy is a factory registered under its name; its signature is the schema
# of ``compression.feedback.options`` (types, defaults, Range bounds: an unknown key
# or a value out of range is refused when the config loads). A factory that takes
# ``layout`` gets the model's parameter layout.


@register("feedback", "none")
def no_feedback() -> NoFeedback:
    """Send ``C(g_k)``; no state (plain compressed FedAvg).

    Reference:
        paper: McMahan et al., "Communication-Efficient Learning of Deep Networks
            from Decentralized Data", AISTATS 2017 (FedAvg), with the update compressed.
        code: none needed (one call of the compressor).
        departures: none.
    """
    return NoFeedback()


@register("feedback", "ef")
def error_feedback() -> ErrorFeedback:
    """Error feedback: ``u = e + g``, send ``C(u)``, ``e ← u − C(u)``.

    Reference:
        paper: Seide et al., "1-Bit Stochastic Gradient Descent and its Application
            to Data-Parallel Distributed Training of Speech DNNs", Interspeech 2014;
            Stich & Karimireddy, "The Error-Feedback Framework: Better Rates for SGD
            with Delayed Gradients and Compressed Communication", 2019.
        code: Dawitkiros/SA-PEF (its EF client, SA-PEF at α = 0).
        departures: ``g`` is the local-training pseudo-gradient ``w − w_k``; the
            residual is ``u − decode(payload)`` (quantisation error stays in it).
    """
    return ErrorFeedback(0.0, "constant", "ef")


@register("feedback", "saef")
def step_ahead_ef() -> ErrorFeedback:
    """SAEF: SA-PEF with α = 1 (the client starts at ``w − e`` and sends ``C(g)``).

    Reference:
        paper: SA-PEF (step-ahead partial error feedback), arXiv 2601.20738.
        code: Dawitkiros/SA-PEF (SAEF client).
        departures: as ``sapef``.
    """
    return ErrorFeedback(1.0, "constant", "saef")


@register("feedback", "sapef")
def step_ahead_partial_ef(alpha: Annotated[float, Range(ge=0, le=1)] = 0.85,
                          alpha_schedule: Literal["constant", "theory", "residual"] = "constant",
                          alpha_kappa: Annotated[float, Range(gt=0)] = 10.0) -> ErrorFeedback:
    """SA-PEF: start at ``w − α e``, send ``C((1 − α) e + g)``, keep the rest.

    ``alpha_schedule="theory"`` uses ``α* = 1/(1 + 12 s²)``, ``s = η L̂ T``, with
    the online smoothness estimate ``L̂`` of the module docstring;
    ``alpha_schedule="residual"`` uses ``α_r = min(alpha, κ·median_k ‖Δ_k‖/‖e_k‖)``
    from the last round's accepted clients (``κ`` = ``alpha_kappa``; the trust region
    of :func:`residual_alpha`), ``alpha`` in the first round.

    Reference:
        paper: SA-PEF (step-ahead partial error feedback), arXiv 2601.20738.
        code: Dawitkiros/SA-PEF (constant α, public default 0.85).
        departures: ``theory`` estimates ``L̂`` online (running max of the cohort
            median of a secant estimate on the first local step); ``residual`` is
            fedloom's (the paper names adaptive α as future work); the public code
            has constant α only.
    """
    return ErrorFeedback(alpha, alpha_schedule, "sapef", alpha_kappa)


@register("feedback", "ef21")
def ef21(ef21_mean: Literal["all", "sampled"] = "all") -> EF21:
    """EF21 in delta form; ``ef21_mean`` picks the partial-participation rule.

    Reference:
        paper: Richtárik, Sokolov & Fatkhullin, "EF21", NeurIPS 2021; EF21-PP in
            Fatkhullin et al., "EF21 with Bells & Whistles", arXiv 2110.03294.
        code: none public in the repositories behind the results pages
            (Dawitkiros/SA-PEF, RanGreidi/FLARE have no EF21).
        departures: pseudo-gradients instead of ``∇f_k(w)``; cohorts drawn without
            replacement; the step goes through the configured aggregator and server
            optimizer (see :class:`EF21`).
    """
    return EF21(ef21_mean)


@register("feedback", "cser")
def cser(period: Annotated[int, Range(ge=1)] = 5,
         reset_ratio: Annotated[float, Range(gt=0, le=1)] = 0.1) -> CSER:
    """EF plus an error reset every ``period`` rounds (top ``reset_ratio`` of ``e``).

    Reference:
        paper: Xie et al., "CSER: Communication-efficient SGD with Error Reset",
            NeurIPS 2020.
        code: Dawitkiros/SA-PEF (its simplified CSER, followed here).
        departures: the simplified rule of SA-PEF's code, not the paper's full
            CSER with partial synchronisation.
    """
    return CSER(period, reset_ratio)


@register("feedback", "scafcom")
def scafcom(beta: Annotated[float, Range(gt=0, le=1)] = 0.2) -> SCAFCOM:
    """SCAFFOLD with compressed control-variate updates and local momentum β.

    Reference:
        paper: Huang, Li, Yin & Ye, "Stochastic Controlled Averaging for Federated
            Learning with Communication Compression", ICLR 2024.
        code: Dawitkiros/SA-PEF (``SCAFCOMClient``, ``ScaffoldLike``).
        departures: ``client.momentum`` is honoured through ``S``; rows are in
            pseudo-gradient units (``server.lr = γ/(η_l S)``); the step's mean is the
            configured aggregator (see :class:`SCAFCOM`).
    """
    return SCAFCOM(beta)


def make_feedback(name: str, **options: Any) -> NoFeedback:
    """Build feedback policy ``name`` (registered, an entry point, or ``module:attr``)
    with its options by name (``make_feedback("sapef", alpha=0.5)``); an unknown
    option or name raises a one-line ``ValueError``. ``schedule`` is accepted as
    the former name of ``alpha_schedule``."""
    if "schedule" in options and "alpha_schedule" not in options:
        options["alpha_schedule"] = options.pop("schedule")
    try:
        fb: NoFeedback = build("feedback", name, options, "compression.feedback.options")
        return fb
    except KeyError as e:
        raise ValueError(f"compression.feedback.name: {e.args[0] if e.args else e}") from None


def feedback_from_config(feedback: Any, layout: Any = None) -> NoFeedback:
    """The policy of a ``compression.feedback`` section (``{name, options}``): its
    factory with the section's options, and ``layout`` when the factory takes it."""
    try:
        factory = get("feedback", feedback.name)
    except KeyError as e:
        raise ValueError(f"compression.feedback.name: {e.args[0] if e.args else e}") from None
    opts = {**feedback.options, **accepted_options(factory, {"layout": layout})}
    fb: NoFeedback = build("feedback", feedback.name, opts, "compression.feedback.options")
    return fb
