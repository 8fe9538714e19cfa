"""The local step's chain of gradient transforms (fedloom.client.transforms):
each term is its formula, the chain with a step is torch.optim.SGD, and the
batched chain ``[m, d]`` is the one-client chain row by row, bit for bit — the
property that lets the sequential, vmap and lock-step trainers share it."""

from __future__ import annotations

import pytest
import torch

from fedloom.client.transforms import (
    Mask,
    Momentum,
    PenaltyTerm,
    Prox,
    Shift,
    StepContext,
    WeightDecay,
    chain,
    local_chain,
)
from fedloom.job import Penalty

D = 17


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed), dtype=torch.float64)


def test_each_term_is_its_formula():
    g, w, w0, s = (_randn(D, seed=i) for i in range(4))
    ctx = StepContext(0, w, w0)
    mask = (torch.arange(D) % 3 != 0).double()
    assert torch.equal(Shift(s).update(g, None, ctx)[0], g + s)
    assert torch.allclose(WeightDecay(0.1).update(g, None, ctx)[0], g + 0.1 * w)
    assert torch.allclose(Prox(0.5).update(g, None, ctx)[0], g + 0.5 * (w - w0))
    assert torch.equal(Mask(mask).update(g, None, ctx)[0], g * mask)
    pen = Penalty(target=w0, tau=0.3, steps=2, kind="l1")
    assert torch.equal(PenaltyTerm((pen,)).update(g, None, ctx)[0], g + 0.3 * torch.sign(w - w0))
    # the penalty regularises the first `steps` steps only
    late = StepContext(2, w, w0)
    assert torch.equal(PenaltyTerm((pen,)).update(g, None, late)[0], g)


def test_momentum_restarts_from_the_first_direction():
    m = Momentum(0.9)
    g1, g2 = _randn(D, seed=1), _randn(D, seed=2)
    ctx = StepContext(0, g1, g1)
    d1, b = m.update(g1, m.init(g1), ctx)
    assert torch.equal(d1, g1) and d1 is not g1  # a copy: the gradient buffer is reused
    d2, _ = m.update(g2, b, ctx)
    assert torch.allclose(d2, 0.9 * g1 + g2)


def test_an_empty_chain_is_the_identity():
    g = _randn(D, seed=0)
    c = local_chain([None], [None], [None])
    assert c.transforms == ()
    assert c.update(g, c.init(g), StepContext(0, g, g))[0] is g


@pytest.mark.parametrize("wd, beta", [(0.0, 0.9), (1e-2, 0.0), (1e-2, 0.9)])
def test_the_chain_with_a_step_is_torch_optim_sgd_bit_for_bit(wd, beta):
    """Weight decay then heavy ball, then ``w ← w − η·D``: torch.optim.SGD's
    update (dampening 0, no Nesterov, foreach off), the same bits in float64."""
    w = _randn(D, seed=0)
    p = torch.nn.Parameter(w.clone())
    opt = torch.optim.SGD([p], lr=0.05, momentum=beta, weight_decay=wd, foreach=False)
    c = local_chain(weight_decay=wd, momentum=beta)
    state = c.init(w)
    for t in range(5):
        g = _randn(D, seed=10 + t)
        p.grad = g.clone()
        opt.step()
        with torch.no_grad():
            d, state = c.update(g.clone(), state, StepContext(t, w, w))
            w.sub_(d, alpha=0.05)
    assert torch.equal(w, p.detach())


def _clients(m: int):
    shifts = [_randn(D, seed=100 + k) if k % 2 else None for k in range(m)]
    pens = [Penalty(target=_randn(D, seed=200 + k), tau=0.1 * (k + 1), steps=1 + k % 3,
                    kind="l1" if k % 2 else "l2",
                    mask=(torch.arange(D) % 2 == 0).double() if k == 1 else None)
            if k != 2 else None for k in range(m)]
    masks = [(torch.arange(D) % (k + 2) != 0).double() if k % 3 == 0 else None
             for k in range(m)]
    return shifts, pens, masks


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_batched_chain_is_the_one_client_chain_row_by_row(dtype):
    """Five clients, each with its own mix of shift, penalty and mask (some none),
    weight decay, FedProx and momentum, over six steps in which clients finish at
    different steps: every live row of the batched chain equals that client's own
    one-client chain, bit for bit."""
    m, T = 5, 6
    steps = [6, 2, 4, 6, 1]
    shifts, pens, masks = _clients(m)

    def cast(x):
        return None if x is None else x.to(dtype)

    shifts, masks = [cast(s) for s in shifts], [cast(x) for x in masks]
    pens = [None if p is None else Penalty(p.target.to(dtype), p.tau, p.steps, p.kind,
                                           cast(p.mask)) for p in pens]
    settings = {"weight_decay": 1e-2, "prox_mu": 0.1, "momentum": 0.9}
    W0 = _randn(m, D, seed=7).to(dtype)
    W = W0.clone()
    batched = local_chain(shifts, pens, masks, like=W, **settings)
    bstate = batched.init(W)
    ones = [local_chain([shifts[k]], [pens[k]], [masks[k]], **settings) for k in range(m)]
    w1 = [W0[k].clone() for k in range(m)]
    s1 = [c.init(w1[k]) for k, c in enumerate(ones)]
    for t in range(T):
        G = _randn(m, D, seed=50 + t).to(dtype)
        live = [t < s for s in steps]
        with torch.no_grad():
            Dm, bstate = batched.update(G.clone(), bstate, StepContext(t, W, W0, live=live))
            for k in range(m):
                if not live[k]:
                    continue
                d, s1[k] = ones[k].update(G[k].clone(), s1[k], StepContext(t, w1[k], W0[k]))
                assert torch.equal(Dm[k], d), (t, k)
                w1[k].sub_(d, alpha=0.05)
            lr = torch.tensor([0.05 if x else 0.0 for x in live], dtype=dtype)[:, None]
            W.addcmul_(lr, Dm, value=-1.0)
    for k in range(m):
        assert torch.equal(W[k], w1[k]), k


def test_chain_composes_in_order():
    g = _randn(D, seed=0)
    s = torch.ones(D, dtype=torch.float64)
    mask = torch.zeros(D, dtype=torch.float64)
    ctx = StepContext(0, g, g)
    # shift then mask: nothing left; mask then shift: the shift
    assert torch.equal(chain(Shift(s), Mask(mask)).update(g, (None, None), ctx)[0],
                       torch.zeros(D, dtype=torch.float64))
    assert torch.equal(chain(Mask(mask), Shift(s)).update(g, (None, None), ctx)[0], s)


# ------------------------------------------------ a user's transform in a run
class ClipNorm:
    """A user's term: each client's direction scaled to norm at most ``c`` (one
    definition on ``[d]`` and ``[m, d]``: the norm is over the last dimension)."""

    def __init__(self, c: float) -> None:
        self.c = c

    def init(self, W):
        return None

    def update(self, D, state, ctx):
        n = torch.linalg.vector_norm(D, dim=-1, keepdim=True)
        return D * (self.c / n).clamp(max=1.0), state


def _tiny():
    import copy

    from conftest import TINY

    return copy.deepcopy(TINY)


def test_a_users_transform_runs_the_same_on_every_client_backend():
    import fedloom

    ov = ["dtype=float64", "rounds=2"]
    runs = {b: fedloom.run(_tiny(), [*ov, f"backend.name={b}"], transforms=[ClipNorm(0.5)])
            for b in ("sequential", "lockstep", "vmap")}
    plain = fedloom.run(_tiny(), ov)
    shas = {b: r.summary["model_sha256"] for b, r in runs.items()}
    assert shas["lockstep"] == shas["sequential"]  # lock-step is sequential's bits
    assert torch.allclose(runs["vmap"].w, runs["sequential"].w, atol=1e-12)
    assert shas["sequential"] != plain.summary["model_sha256"]


def test_a_transform_named_in_the_config_is_the_object():
    """``client.transforms: [{name: module:attr, options}]`` builds the same term."""
    import fedloom

    ov = ["rounds=2", "client.transforms=[{name: test_transforms:ClipNorm, options: {c: 0.5}}]"]
    by_name = fedloom.run(_tiny(), ov)
    by_obj = fedloom.run(_tiny(), ["rounds=2"], transforms=[ClipNorm(0.5)])
    assert by_name.summary["model_sha256"] == by_obj.summary["model_sha256"]


@pytest.mark.parametrize("value, match", [
    ("[x]", r"client\.transforms\[0\]: must be a mapping"),
    ("[{options: {}}]", r"client\.transforms\[0\]: must be a mapping with a name"),
    ("[{name: nosuch}]", r"client\.transforms\[0\]\.name: .*nosuch"),
    ("[{name: test_transforms:ClipNorm, bogus: 1}]",
     r"client\.transforms\[0\]\.bogus: unknown"),
    ("[{name: test_transforms:ClipNorm, options: {d: 1}}]",
     r"client\.transforms\[0\]\.options"),
])
def test_bad_transform_entries_are_one_line(value, match):
    import fedloom
    from fedloom.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        fedloom.run(_tiny(), ["rounds=1", f"client.transforms={value}"])


# --------------------------------------------- a method's terms, client by client
class _Scale:
    """A per-client term without ``stack``: the batched chain runs it row by row."""

    def __init__(self, c: float) -> None:
        self.c = c

    def init(self, W):
        return 0

    def update(self, D, state, ctx):
        return D * (self.c + state), state + 1  # state: steps taken so far


def _job(k: int, w: torch.Tensor, terms: tuple) -> object:
    from fedloom.job import local_job

    return local_job(k, 0, w, 0.1, torch.zeros(1, 1), torch.zeros(1, dtype=torch.long), k,
                     transforms=terms)


@pytest.mark.parametrize("terms", [
    # one class that stacks (Mask): one [m, d] term
    lambda k: (Mask((torch.arange(D) % (k + 2) != 0).double()),),
    # a term of the client's own without stack, and clients without terms
    lambda k: (_Scale(0.5 * k),) if k != 1 else (),
], ids=["stacked", "row_by_row"])
def test_a_methods_terms_in_the_batched_chain_are_each_clients_own(terms):
    from fedloom.client.transforms import PerClient, jobs_chain

    m, steps = 4, [3, 3, 1, 3]
    W0 = _randn(m, D, seed=9)
    jobs = [_job(k, W0[k], terms(k)) for k in range(m)]
    batched = jobs_chain(jobs, W0.clone(), weight_decay=0.01, momentum=0.9)
    assert any(isinstance(t, PerClient) for t in batched.transforms) == (terms(1) == ())
    bstate = batched.init(W0)
    ones = [local_chain([None], [None], [None], weight_decay=0.01, momentum=0.9,
                        per_client=[j.transforms]) for j in jobs]
    states = [c.init(W0[k]) for k, c in enumerate(ones)]
    for t in range(3):
        G = _randn(m, D, seed=70 + t)
        live = [t < s for s in steps]
        Dm, bstate = batched.update(G.clone(), bstate, StepContext(t, W0, W0, live=live))
        for k in range(m):
            if live[k]:
                d, states[k] = ones[k].update(G[k].clone(), states[k],
                                              StepContext(t, W0[k], W0[k]))
                assert torch.equal(Dm[k], d), (t, k)

