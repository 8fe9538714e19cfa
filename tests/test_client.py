import math

import pytest
import torch
from torch import nn

from fedloom import Layout
from fedloom.client import LocalSGD, lr_at_round
from fedloom.config import ScheduleConfig
from fedloom.job import local_job
from fedloom.models import MLP


@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 5e-4)])
def test_local_sgd_matches_torch_optim_sgd(momentum, wd):
    torch.manual_seed(0)
    model = MLP(8, [6], 3).double()
    layout = Layout.from_module(model)
    x = torch.randn(40, 8, dtype=torch.float64)
    y = torch.randint(0, 3, (40,))
    w0 = layout.flatten(model)
    trainer = LocalSGD(model, layout, batch_size=16, epochs=2, momentum=momentum, weight_decay=wd)
    res = trainer.run(local_job(0, 0, w0, 0.1, x, y, gen_seed=7))
    # Reference: torch.optim.SGD over the same batches.
    ref = MLP(8, [6], 3).double()
    layout.load_into(ref, w0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=momentum, weight_decay=wd)
    gen = torch.Generator().manual_seed(7)
    for idx in trainer.batch_indices(40, gen):
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x[idx]), y[idx]).backward()
        opt.step()
    assert res.steps == 2 * math.ceil(40 / 16) == 6
    assert torch.allclose(res.update, w0 - layout.flatten(ref), atol=1e-12)


def test_fixed_steps_and_prox_pulls_towards_global():
    torch.manual_seed(0)
    model = MLP(4, [4], 2)
    layout = Layout.from_module(model)
    x, y = torch.randn(10, 4), torch.randint(0, 2, (10,))
    w0 = layout.flatten(model)
    plain = LocalSGD(model, layout, batch_size=4, steps=7).run(local_job(0, 0, w0, 0.5, x, y, 1))
    prox = LocalSGD(model, layout, batch_size=4, steps=7, prox_mu=1.0).run(
        local_job(0, 0, w0, 0.5, x, y, 1))
    assert plain.steps == prox.steps == 7
    assert prox.update.norm() < plain.update.norm()


def test_batches_cover_each_epoch_once():
    trainer = LocalSGD(nn.Linear(1, 1), Layout.flat(2), batch_size=3, epochs=2)
    b = trainer.batch_indices(10, torch.Generator().manual_seed(0))
    assert [len(i) for i in b] == [3, 3, 3, 1, 3, 3, 3, 1]
    assert sorted(torch.cat(b[:4]).tolist()) == list(range(10))
    assert sorted(torch.cat(b[4:]).tolist()) == list(range(10))


def test_lr_schedules_golden():
    const = ScheduleConfig("constant")
    assert lr_at_round(0.1, const, 50, 100) == 0.1
    exp = ScheduleConfig("exp", gamma=0.999)
    assert lr_at_round(0.01, exp, 0, 500) == 0.01
    assert lr_at_round(0.01, exp, 100, 500) == pytest.approx(0.01 * 0.999**100)
    cos = ScheduleConfig("cosine", warmup=5, final_lr=0.003)
    # warm-up: 0.1·(t+1)/5; then cosine from 0.1 (t = 5) to 0.003 (t = 199)
    assert lr_at_round(0.1, cos, 0, 200) == pytest.approx(0.02)
    assert lr_at_round(0.1, cos, 4, 200) == pytest.approx(0.1)
    assert lr_at_round(0.1, cos, 5, 200) == pytest.approx(0.1)
    assert lr_at_round(0.1, cos, 199, 200) == pytest.approx(0.003)
    mid = 5 + (199 - 5) / 2
    assert lr_at_round(0.1, cos, int(mid), 200) == pytest.approx(0.0515, abs=1e-12)


def test_batch_indices_of_a_client_without_samples_is_an_error_not_a_hang():
    model = MLP(8, [6], 3)
    trainer = LocalSGD(model, Layout.from_module(model), batch_size=4, steps=5)
    with pytest.raises(ValueError, match="no training sample"):
        trainer.batch_indices(0, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("epochs,max_steps", [(None, None), (3, None), (2, 4)])
def test_job_batches_are_the_batches_train_draws(epochs, max_steps, monkeypatch):
    """The batched backends and APFL draw a client's batches with ``job_batches``:
    it must give exactly the index batches ``train`` steps over (recorded here by
    wrapping ``epoch_batches``, which ``train`` draws its epochs' permutations and
    batches with), and another ``gen_seed`` another order."""
    model = MLP(4, [4], 2)
    layout = Layout.from_module(model)
    x, y = torch.randn(11, 4), torch.randint(0, 2, (11,))
    trainer = LocalSGD(model, layout, batch_size=3, epochs=1)
    job = local_job(0, 0, layout.flatten(model), 0.1, x, y, gen_seed=13, epochs=epochs,
                    max_steps=max_steps)
    seen: list[list[torch.Tensor]] = []
    real = LocalSGD.epoch_batches

    def record(self, *a, **k):
        plan = real(self, *a, **k)
        seen.append([perm[s:e] for perm, spans in plan for s, e in spans])
        return plan

    monkeypatch.setattr(LocalSGD, "epoch_batches", record)  # a frozen dataclass: the class
    _, _, steps, _ = trainer.train(job)
    monkeypatch.setattr(LocalSGD, "epoch_batches", real)
    got = trainer.job_batches(job)
    assert len(seen) == 1 and steps == len(got) == len(seen[0])
    assert all(torch.equal(a, b) for a, b in zip(got, seen[0], strict=True))
    other = trainer.job_batches(local_job(0, 0, job.w, 0.1, x, y, gen_seed=14, epochs=epochs,
                                          max_steps=max_steps))
    assert not all(torch.equal(a, b) for a, b in zip(got, other, strict=True))


class _Same:
    """A local transform that leaves the direction as it is: its presence alone sends
    the step through the chain (the gradient copied into the flat vector first)."""

    def init(self, W: torch.Tensor) -> None:
        return None

    def update(self, D: torch.Tensor, state: None, ctx: object) -> tuple[torch.Tensor, None]:
        return D, None


class _SmallCNN(nn.Module):
    """Conv, pooling, dropout and a dense layer, plus a parameter the loss never reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Dropout(0.25), nn.Flatten())
        self.head = nn.Linear(4 * 3 * 3, 3)
        self.unused = nn.Parameter(torch.tensor([-0.0, 0.0, 1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_direct_step_is_the_chain_step_bit_for_bit(dtype):
    """With nothing but the gradient in the direction, each parameter steps by
    autograd's tensor (no flat gradient): the same bits as the chain's step on the
    flat vector, dropout masks included, and a parameter without a gradient
    (-0.0 entry too) stays exactly where it was."""
    torch.manual_seed(0)
    model = _SmallCNN().to(dtype)
    layout = Layout.from_module(model)
    x, y = torch.randn(23, 2, 8, 8, dtype=dtype), torch.randint(0, 3, (23,))
    w0 = layout.flatten(model)
    trainer = LocalSGD(model, layout, batch_size=5, epochs=2, random_forward=True)
    direct = trainer.run(local_job(3, 1, w0, 0.3, x, y, gen_seed=11))
    # the step took autograd's tensors as they were: nothing went through the flat gradient
    assert not trainer._flat_module().g.any()
    chained = trainer.run(local_job(3, 1, w0, 0.3, x, y, gen_seed=11, transforms=(_Same(),)))
    probed = trainer.run(local_job(3, 1, w0, 0.3, x, y, gen_seed=11, probe=True))
    assert direct.steps == chained.steps == probed.steps == 10
    assert direct.update.abs().sum() > 0
    assert torch.equal(direct.update, chained.update)
    assert torch.equal(direct.update, probed.update)
    assert direct.loss == chained.loss == probed.loss
    unused = layout.tensors[[t.name for t in layout.tensors].index("unused")].slice
    w_k, _, _, _ = trainer.train(local_job(3, 1, w0, 0.3, x, y, gen_seed=11))
    assert torch.equal(w_k[unused], w0[unused])
    assert torch.equal(torch.signbit(w_k[unused]), torch.tensor([True, False, False]))
