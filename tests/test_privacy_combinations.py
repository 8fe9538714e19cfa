"""What combines with differential privacy (docs/howto/privacy.md, What combines
with DP): every registered aggregator and feedback policy classified for central
and local mode by hand (a new one must be added here), each refusal one line naming
its field; compression and error feedback under central DP keep the per-round bound
(the server clips the decoded rows: one client moves the model by at most C a
round, whatever the codec and the residual); robust rules run under local DP;
secure aggregation with central DP is the same mechanism and the same ε."""

from __future__ import annotations

import copy

import pytest
import torch

import fedloom
from conftest import TINY
from fedloom.aggregate.base import make_aggregator
from fedloom.compress.feedback import feedback_from_config
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment
from fedloom.params import Layout
from fedloom.privacy import Privacy, check_privacy
from fedloom.registry import available, build

# name: (allowed under central DP, allowed under local DP), with the reason
AGGREGATORS = {
    # the plain mean under unit weights: DP-FedAvg's sensitivity C / m̄ holds
    "fedavg": (True, True), "fedit": (True, True),
    # no bounded sensitivity of the DP-FedAvg kind (one client can move a median,
    # a trimmed mean, Krum's choice or a solver's weights by more than C / m̄);
    # FedNova's coefficients depend on the others' step counts: local DP only
    **{n: (False, True) for n in (
        "bulyan", "centered_clipping", "config", "coordmean", "craft", "fednova", "flame",
        "fltrust", "geomed", "geometric_median", "hetlora", "krum", "lora_exact", "median",
        "trimmed_mean")},
    # they read each client's unnoised loss: neither mode covers it
    **{n: (False, False) for n in ("afl", "fedfv", "fedlf", "qfedavg")},
}
# name: (central, local). Row-only policies keep their state on the client; a policy
# whose server keeps or broadcasts state built from the clients' messages is outside
# the noised sum (central), but post-processing of noisy messages (local)
FEEDBACK = {
    **{n: (True, True) for n in ("none", "ef", "ec_prox", "flare", "saef", "sapef")},
    **{n: (False, True) for n in ("cser", "ef21", "scafcom")},
}


def _check(mode: str, aggregator: str = "fedavg", feedback: str = "none",
           schedule: str | None = None) -> None:
    over = [f"compression.feedback={feedback}"]
    if schedule is not None:
        over.append(f"compression.feedback.options.alpha_schedule={schedule}")
    cfg = load_config(copy.deepcopy(TINY), over)
    p = Privacy(mode, clip=1.0, noise_multiplier=1.0, delta=1e-5, cohort_size=4,
                num_clients=10, seed=0)
    check_privacy(p, aggregator=make_aggregator(aggregator), aggregator_name=aggregator,
                  feedback=feedback_from_config(cfg.compression.feedback, Layout.flat(8)),
                  feedback_name=feedback, method=build("method", "sgd", {}, "m"),
                  method_name="sgd", w=torch.zeros(8))


def _refused(field: str, *args: str, **kw: str) -> None:
    with pytest.raises(ConfigError) as e:
        _check(*args, **kw)
    msg = str(e.value)
    assert msg.startswith(f"{field}: ") and "\n" not in msg, msg


def test_every_registered_rule_and_policy_is_classified():
    assert set(available("aggregator")) <= set(AGGREGATORS)
    assert set(available("feedback")) <= set(FEEDBACK)


@pytest.mark.parametrize("name", sorted(AGGREGATORS))
@pytest.mark.parametrize("mode", ["central", "local"])
def test_aggregators_with_dp(name, mode):
    if name not in available("aggregator"):
        pytest.skip(f"{name} is not registered in this tree")
    if AGGREGATORS[name][mode == "local"]:
        _check(mode, aggregator=name)
    else:
        _refused("aggregator.name", mode, aggregator=name)


@pytest.mark.parametrize("name", sorted(FEEDBACK))
@pytest.mark.parametrize("mode", ["central", "local"])
def test_feedback_policies_with_dp(name, mode):
    if FEEDBACK[name][mode == "local"]:
        _check(mode, feedback=name)
    else:
        _refused("compression.feedback.name", mode, feedback=name)


@pytest.mark.parametrize("mode", ["central", "local"])
@pytest.mark.parametrize("schedule", ["theory", "residual"])
def test_step_ahead_schedules_that_send_unnoised_norms_are_refused(mode, schedule):
    _refused("compression.feedback.options.alpha_schedule", mode, feedback="sapef",
             schedule=schedule)


def _steps(over: list[str]) -> tuple[list[float], list[dict]]:
    """Each round's ‖w_{t+1} − w_t‖ and the metrics of a TINY run."""
    ws: list[torch.Tensor] = []

    def keep(state, metrics):
        ws.append(state.w.detach().double().clone())

    res = fedloom.run(copy.deepcopy(TINY), over, callbacks=[keep])
    exp = Experiment.from_config(load_config(copy.deepcopy(TINY), over))
    try:
        w0 = exp.init().w.detach().double()
    finally:
        exp.close()
    prev = [w0, *ws[:-1]]
    return [float((b - a).norm()) for a, b in zip(prev, ws, strict=True)], res.metrics


@pytest.mark.parametrize("codec", [
    ["compression.name=topk", "compression.options={ratio: 0.1}", "compression.feedback=ef"],
    ["compression.name=sign", "compression.feedback=ef"],
    ["compression.name=qsgd"],
])
def test_central_dp_bounds_each_round_after_the_codec_and_error_feedback(codec):
    """z = 0 isolates the clip: the server clips each decoded row to C, so the mean
    over the fixed denominator (4 rows at most, m̄ = 4) and a server step of 1 move
    the model by at most C a round — what the noise is calibrated to, whatever the
    codec scaled or the residual carried (every row was clipped)."""
    c = 1e-3
    steps, metrics = _steps([*codec, "privacy.mode=central", f"privacy.clip={c}",
                             "privacy.noise_multiplier=0", "server.lr=1.0",
                             "server.optimizer=sgd", "checkpoint.every=0"])
    assert all(s <= c * (1 + 1e-5) for s in steps), steps
    assert all(m["dp_clipped"] == m["cohort_size"] for m in metrics)
    assert min(steps) > 0.1 * c  # four clipped rows, not all of one direction


def test_local_dp_composes_with_robust_rules_and_secure_aggregation_with_central():
    # local: the server post-processes noisy messages; a robust rule runs on them
    for agg in ("median", "krum"):
        res = fedloom.run(copy.deepcopy(TINY), ["privacy.mode=local", "privacy.clip=1.0",
                                                f"aggregator.name={agg}", "rounds=1",
                                                "checkpoint.every=0",
                                                "privacy.accountant=rdp"])
        assert torch.isfinite(res.w).all() and res.summary["dp_epsilon"] > 0
    # central with secure aggregation: the server noises the sum it unmasks (in process
    # nothing is masked): the same model and the same ε as without the flag
    over = ["privacy.mode=central", "compression.name=identity", "compression.options={}",
            "compression.feedback=none", "rounds=2", "checkpoint.every=0",
            "privacy.accountant=rdp"]
    plain = fedloom.run(copy.deepcopy(TINY), over)
    sa = fedloom.run(copy.deepcopy(TINY), [*over, "server.secure_aggregation=true"])
    assert torch.equal(plain.w, sa.w)
    assert sa.summary["dp_epsilon"] == plain.summary["dp_epsilon"]
    # local with secure aggregation: each client's own noise, its own ε
    loc = fedloom.run(copy.deepcopy(TINY), [*over, "privacy.mode=local",
                                            "server.secure_aggregation=true"])
    assert loc.summary["dp_accounting"]["unit"] == "a client's messages"
    with pytest.raises(ConfigError, match=r"^compression\.name: "):
        fedloom.run(copy.deepcopy(TINY), [*over, "server.secure_aggregation=true",
                                          "compression.name=topk",
                                          "compression.options={ratio: 0.1}"])
