"""Byzantine clients (fedloom.attack): who attacks, what arrives, bad options."""

import pytest
import torch

import fedloom
from fedloom.attack import byzantine_clients
from fedloom.config import ConfigError, load_config
from fedloom.engine.experiment import Experiment


def test_attackers_are_a_seeded_fixed_fraction():
    a = byzantine_clients(7, 100, 0.1)
    assert len(a) == 10 and all(0 <= k < 100 for k in a)
    assert byzantine_clients(7, 100, 0.1) == a           # same seed, same clients
    assert byzantine_clients(8, 100, 0.1) != a           # the seed decides them
    assert byzantine_clients(7, 100, 0.0) == frozenset()
    assert len(byzantine_clients(7, 10, 0.25)) == 2       # round(2.5) = 2 (banker's)


def test_sign_flip_reaches_the_aggregator_as_minus_scale_times_the_update(tiny):
    """Every client attacks: FedAvg's step is −s times the honest step (the honest
    updates are the same bits; the identity uplink carries float32, so the two
    steps agree to float32 rounding)."""
    base = ["rounds=1", "dtype=float64", "cohort.size=4"]
    w0 = Experiment.from_config(load_config(tiny, base)).init().w
    honest = fedloom.run(tiny, base).w
    hostile = fedloom.run(tiny, [*base, "attack.fraction=1.0", "attack.options.scale=3"]).w
    step = honest - w0
    assert float(step.abs().max()) > 1e-3
    assert torch.allclose(hostile - w0, -3 * step, rtol=0, atol=1e-6 * float(step.abs().max()))
    # no attacker: the run is the honest one, bit for bit
    none = fedloom.run(tiny, [*base, "attack.fraction=0.0", "attack.options.scale=3"]).w
    assert torch.equal(none, honest)


@pytest.mark.parametrize(("override", "field"), [
    ("attack.options.scale=-1", "attack.options.scale"),
    ("attack.options.bogus=1", "attack.options.bogus"),
    ("attack.name=nope", "attack.name"),
    ("attack.fraction=1.5", "attack.fraction"),
])
def test_bad_attack_options_name_the_field(tiny, override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        fedloom.run(tiny, ["rounds=1", "attack.fraction=0.5", override])
