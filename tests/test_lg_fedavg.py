"""LG-FedAvg (fedloom.client.lg_fedavg): FedPer's rule with the body personal. The
suite every personalised method passes is tests/test_personalised.py."""

from __future__ import annotations

import pytest
import torch

import fedloom
from conftest import TINY
from fedloom.client.lg_fedavg import lg_split
from fedloom.params import Layout


def _layout(groups: int) -> Layout:
    layers = [torch.nn.Linear(4, 4) for _ in range(groups)]
    return Layout.from_module(torch.nn.Sequential(*layers))


def test_the_body_is_personal_by_default():
    layout = _layout(3)
    assert lg_split(layout, None) == [g.name for g in layout.groups[:2]]
    assert lg_split(layout, ["x"]) == ["x"]  # named groups are checked by head_groups


def test_a_model_of_one_group_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^client\.method\.options\.personal: the model has "
                                         r"one layer group; LG-FedAvg needs a body and a head$"):
        lg_split(_layout(1), None)


def test_it_is_fedper_with_the_body_named_bit_for_bit():
    """The default split is FedPer's rule with ``personal`` = every group but the last
    (the tiny MLP's first Linear): the same model and personal accuracy; FedPer's own
    default (the head personal) is another model."""
    lg = fedloom.run(TINY, ["client.method=lg_fedavg", "rounds=2"])
    body = lg_split(Layout.from_module(lg.model), None)
    per = fedloom.run(TINY, ["client.method=fedper", f"client.method.options.personal={body}",
                             "rounds=2"])
    assert lg.summary["model_sha256"] == per.summary["model_sha256"]
    assert lg.summary["personal_acc_mean"] == per.summary["personal_acc_mean"]
    head = fedloom.run(TINY, ["client.method=fedper", "rounds=2"])
    assert head.summary["model_sha256"] != lg.summary["model_sha256"]
