"""The uplink's two halves (fedloom.compress.feedback.base): the server reads the
bytes it received, decoded by itself, never the client's own decode; the plain
client half does not decode at all."""

from __future__ import annotations

import copy
import dataclasses

import torch

import fedloom
from conftest import TINY
from fedloom.compress.feedback import ErrorFeedback, NoFeedback
from fedloom.config import load_config
from fedloom.engine.experiment import Experiment
from fedloom.registry import get

TOPK = ["compression.name=topk", "compression.options={ratio: 0.1}", "server.lr=1.0"]


class LyingEF(ErrorFeedback):
    """SA-PEF whose client half reports a decode 1e6 times too large (its own rows
    stay honest): a server that trusted it would aggregate 1e6-sized rows."""

    def uplink(self, g, state, comp, ctx, server):
        up = super().uplink(g, state, comp, ctx, server)
        up.sent = up.sent * 1e6
        return up


def test_the_server_decodes_the_bytes_not_the_clients_claim():
    honest = fedloom.run(copy.deepcopy(TINY), [*TOPK, "compression.feedback=sapef",
                                               "compression.feedback.options={alpha: 0.5}"])
    lying = fedloom.run(copy.deepcopy(TINY), TOPK, feedback=LyingEF(0.5, name="sapef"))
    assert lying.summary["rejected_updates_total"] == 0
    assert lying.summary["model_sha256"] == honest.summary["model_sha256"]


class CountingDecode:
    """A compressor wrapper that counts its decodes."""

    def __init__(self, inner) -> None:
        self.inner, self.decodes = inner, 0

    def encode(self, x, *, gen=None):
        return self.inner.encode(x, gen=gen)

    def decode(self, payload, d=None):
        self.decodes += 1
        return self.inner.decode(payload, d)


def test_plain_uplink_decodes_once_on_the_server_side():
    exp = Experiment.from_config(load_config(copy.deepcopy(TINY), TOPK))
    exp.algorithm = dataclasses.replace(exp.algorithm,
                                        compressor=CountingDecode(exp.algorithm.compressor))
    _, m = exp.round(exp.init())
    assert isinstance(exp.feedback, NoFeedback) and type(exp.feedback) is NoFeedback
    # one decode a client, the server's: the client half sent bytes only
    assert exp.uplink.decodes == m["cohort_size"] == TINY["cohort"]["size"]


def test_error_feedback_decodes_on_both_sides():
    # EF's rows need the client's own decode (e = u − C(u)); the server decodes again
    exp = Experiment.from_config(load_config(copy.deepcopy(TINY),
                                             [*TOPK, "compression.feedback=ef"]))
    exp.algorithm = dataclasses.replace(exp.algorithm,
                                        compressor=CountingDecode(exp.algorithm.compressor))
    exp.round(exp.init())
    assert exp.uplink.decodes == 2 * TINY["cohort"]["size"]


def test_ef21_sampled_row_is_the_servers_copy_plus_the_decode():
    """EF21 (mean: sampled): the row is h_k + C(g_k − h_k) from the server's copy of
    h_k and the bytes, equal to the client's new h_k."""
    fb = get("feedback", "ef21")(ef21_mean="sampled")
    comp = get("compressor", "topk")(ratio=0.2)
    from fedloom.compress.feedback import UplinkContext

    g, h = torch.randn(50, dtype=torch.float64), torch.randn(50, dtype=torch.float64)
    up = fb.uplink(g, {"h": h}, comp, UplinkContext(0, 0.1, 1, 0.0, torch.Generator()), {})
    up.sent = comp.decode(up.payload, 50).to(torch.float64)  # as the server half does
    assert torch.equal(fb.server_row(up, {"h": h}, {}), up.state["h"])
