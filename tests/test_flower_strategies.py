"""fedloom's rules as drop-in Flower strategies for stock apps, and the stock mod.

The ClientApp here is written the way Flower's ``quickstart-pytorch`` example
writes one on the Message API: it builds its model, loads
``msg.content["arrays"].to_torch_state_dict()``, trains on its partition
(``node_config["partition-id"]``) with the ``lr`` of the train config, and
replies with ``ArrayRecord(model.state_dict())`` and
``MetricRecord({"train_loss": …, "num-examples": n})``. It knows nothing of
fedloom. The server side changes one line: ``FedAvg(...)`` → ``CRAFT(...)``.

Most runs use :class:`LocalGrid`, Flower's ``Grid`` in one process (each
message delivered as a copy, as the transport delivers one, to the ClientApp
with that node's own ``Context`` kept across rounds); one runs in Flower's
``run_simulation``.
"""

from __future__ import annotations

import copy
import math
import uuid
from collections import OrderedDict

import pytest
import torch
from torch import nn

flwr = pytest.importorskip("flwr")

from flwr.app import (  # noqa: E402
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedloom.aggregate.base import CohortInfo, make_aggregator  # noqa: E402
from fedloom.integrations.flower.records import StateLayout  # noqa: E402
from fedloom.integrations.flower.stock import CompressionMod, LocalPenalty  # noqa: E402
from fedloom.integrations.flower.strategies import (  # noqa: E402
    CRAFT,
    FedloomRule,
    IncompatibleReplies,
    Krum,
    QFedAvg,
)
from fedloom.params import Layout  # noqa: E402
from fedloom.server_opt import ServerOptimizer  # noqa: E402

IN, CLASSES, NODES = 12, 4, 5


# ----------------------------------------------------------- a stock Flower app
class Net(nn.Module):
    """A small model with a BatchNorm layer (parameters and buffers in its state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, 16)
        self.bn1 = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn1(self.fc1(x))))


def load_data(partition_id: int, dtype: torch.dtype = torch.float32, dim: int = IN):
    """Partition k: 40 + 10k points of a fixed linear labelling, its mean shifted by k
    (a non-IID split)."""
    g = torch.Generator().manual_seed(1000 + partition_id)
    n = 40 + 10 * partition_id
    x = torch.randn(n, dim, generator=g) + 0.5 * partition_id
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(dim, CLASSES, generator=teacher)
    return x.to(dtype), (x @ w).argmax(1)


def train_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    total = 0.0
    for i in range(0, len(y), 16):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16])
        loss.backward()
        opt.step()
        total += float(loss.detach())
    return total / math.ceil(len(y) / 16)


def stock_app(make_net=Net, dtype=torch.float32, attack=None, mods=None,
              dim=IN) -> ClientApp:
    """The stock ClientApp; ``attack(partition, round, state_dict) -> state_dict``
    turns some clients Byzantine (the test's business, not the app's)."""
    app = ClientApp(mods=mods or [])

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = make_net()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        pid = int(context.node_config["partition-id"])
        x, y = load_data(pid, dtype, dim)
        lr = float(msg.content["config"].get("lr", 0.1))
        loss = train_fn(model, x, y, lr)
        sd = model.state_dict()
        if attack is not None:
            sd = attack(pid, int(msg.content["config"]["server-round"]), sd,
                        msg.content["arrays"].to_torch_state_dict())
        content = RecordDict({"arrays": ArrayRecord(sd),
                              "metrics": MetricRecord({"train_loss": loss,
                                                       "num-examples": len(y)})})
        return Message(content=content, reply_to=msg)

    return app


class LocalGrid(Grid):
    """Flower's Grid in one process: a pushed message is delivered, as a copy, to
    the ClientApp with its node's Context (node ids 1000 + partition id); an
    exception in the app becomes an error reply, as Flower's runtime makes it."""

    def __init__(self, app: ClientApp, num_nodes: int = NODES) -> None:
        self.app = app
        self.contexts = {1000 + k: Context(run_id=1, node_id=1000 + k,
                                           node_config={"partition-id": k,
                                                        "num-partitions": num_nodes},
                                           state=RecordDict(), run_config={})
                         for k in range(num_nodes)}
        self.replies: dict[str, Message] = {}
        self.log: list[Message] = []  # every reply, for replaying into the engine

    def set_run(self, run):  # pragma: no cover (the abstract API; unused here)
        self._run = run

    @property
    def run(self):  # pragma: no cover
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            mid = str(uuid.uuid4())
            m.metadata.__dict__["_message_id"] = mid
            delivered = copy.deepcopy(m)
            try:
                reply = self.app(delivered, self.contexts[m.metadata.dst_node_id])
            except Exception as e:  # the runtime reports any failure
                reply = Message(Error(code=0, reason=f"{type(e).__name__}: {e}"),
                                reply_to=delivered)
            self.replies[mid] = reply
            self.log.append(reply)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


@pytest.fixture(autouse=True)
def task_identity():
    """Messages need the task's identity, which Flower's runtime sets; restored after."""
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved


def initial_arrays(make_net=Net, seed=0) -> ArrayRecord:
    torch.manual_seed(seed)
    return ArrayRecord(make_net().state_dict())


def run(strategy, app, rounds=3, arrays=None):
    grid = LocalGrid(app)
    config = ConfigRecord({"lr": 0.1})
    result = strategy.start(grid=grid, initial_arrays=arrays or initial_arrays(),
                            num_rounds=rounds, train_config=config)
    return result, grid


def global_loss(arrays: ArrayRecord, make_net=Net) -> float:
    model = make_net()
    model.load_state_dict(arrays.to_torch_state_dict())
    model.eval()
    with torch.no_grad():
        return sum(float(nn.functional.cross_entropy(model(x), y)) * len(y)
                   for x, y in (load_data(k) for k in range(NODES))) / sum(
                       len(load_data(k)[1]) for k in range(NODES))


def finite(arrays: ArrayRecord) -> bool:
    return all(bool(torch.isfinite(v.float()).all())
               for v in arrays.to_torch_state_dict().values())


# --------------------------------------------------------------- the layouts
def test_state_layout_splits_parameters_from_buffers_and_groups_like_the_module():
    """Keys → parameters and layer groups: equal to Layout.from_module for models with
    and without BatchNorm (fedloom's mlp, cnn, resnet and craft_cnn)."""
    from fedloom.config import ModelConfig
    from fedloom.models import build_model

    cases = [("mlp", (1, 28, 28), {"hidden": [20, 10]}),
             ("cnn", (1, 28, 28), {}),
             ("resnet", (3, 32, 32), {"depth": 8, "width": 4, "norm": "batch"}),
             ("craft_cnn", (3, 32, 32), {})]
    for name, shape, opts in cases:
        module = build_model(ModelConfig(name=name, options=opts), shape, 10, seed=0)
        rec = ArrayRecord(module.state_dict())
        sl = StateLayout.from_arrays(rec)
        assert sl.layout == Layout.from_module(module), name
        assert set(sl.buffers) == {n for n, _ in module.named_buffers()}, name
        w, bufs = sl.split(rec, torch.float64)
        assert torch.equal(w, Layout.from_module(module).flatten(module).double())
        back = sl.join(w, bufs).to_torch_state_dict()
        assert list(back) == list(module.state_dict())
        assert all(torch.equal(back[k], v) for k, v in module.state_dict().items())
        assert all(back[k].dtype == v.dtype for k, v in module.state_dict().items())


def test_state_layout_refuses_records_of_another_model():
    sl = StateLayout.from_arrays(initial_arrays())
    sd = Net().state_dict()
    for bad, why in [({k: v for k, v in sd.items() if k != "fc2.bias"}, "no tensor 'fc2.bias'"),
                     ({**sd, "extra": torch.zeros(1)}, "unknown tensor 'extra'"),
                     ({**sd, "fc1.bias": torch.zeros(3)}, "'fc1.bias' has shape"),
                     ({**sd, "fc1.bias": torch.zeros(16, dtype=torch.int64)},
                      "parameter 'fc1.bias' is torch.int64")]:
        with pytest.raises(ValueError, match=why):
            sl.split(ArrayRecord(OrderedDict(bad)), torch.float32)
    with pytest.raises(ValueError, match="not an ArrayRecord"):
        sl.split(ConfigRecord({"a": 1}), torch.float32)


# ---------------------------------------------------- equivalence with fedloom
def _replies(arrays: ArrayRecord, deltas, ns, nodes=None):
    """Replies whose arrays are the sent ones minus ``deltas`` (one per client)."""
    sd = arrays.to_torch_state_dict()
    sl = StateLayout.from_arrays(arrays)
    w, bufs = sl.split(arrays, torch.float64)
    out = []
    for i, (dlt, n) in enumerate(zip(deltas, ns, strict=True)):
        rec = sl.join(w - dlt, {k: v + i for k, v in bufs.items()})
        out.append(_reply(rec, n, (nodes or range(1000, 1000 + len(ns)))[i]))
    assert list(sd) == list(rec.to_torch_state_dict())
    return out, sl, w


def _reply(rec, n, node, metrics=None):
    send = Message(RecordDict({"arrays": rec}), dst_node_id=node,
                   message_type=MessageType.TRAIN)
    send.metadata.__dict__["_message_id"] = str(uuid.uuid4())
    content = RecordDict({"arrays": rec,
                          "metrics": MetricRecord({"num-examples": n, **(metrics or {})})})
    rep = Message(content, reply_to=send)
    rep.metadata.__dict__["_src_node_id"] = node
    return rep


class _Nodes:
    def __init__(self, ids):
        self.ids = ids

    def get_node_ids(self):
        return self.ids


@pytest.mark.parametrize("rule,kw,opt", [
    ("craft", {"groups": "layer", "precision": "float64"}, {"kind": "sgd", "lr": 0.1}),
    ("krum", {"f": 1}, {"kind": "sgd", "lr": 1.0}),
    ("fedavg", {}, {"kind": "momentum", "lr": 0.7, "momentum": 0.9}),
    ("craft", {}, {"kind": "adam", "lr": 0.05}),
])
def test_new_arrays_equal_fedloom_aggregator_and_server_step(rule, kw, opt):
    """Two rounds of fixed replies (near-collinear rows included): the strategy's new
    parameters equal ``w − η·opt(agg(rows, n))`` of fedloom's own aggregator and
    ServerOptimizer on the same rows, bit for bit in float64; buffers are the
    n-weighted mean (num_batches_tracked: the maximum)."""
    torch.manual_seed(3)
    arrays = ArrayRecord(OrderedDict((k, v.double() if v.is_floating_point() else v)
                                     for k, v in Net().state_dict().items()))
    strat = FedloomRule(rule, server_lr=opt["lr"], server_optimizer=opt["kind"],
                        server_options={k: v for k, v in opt.items() if k not in ("kind", "lr")},
                        dtype="float64", min_available_nodes=5, min_train_nodes=5, **kw)
    agg = make_aggregator(rule, **kw)
    sl = StateLayout.from_arrays(arrays)
    state = agg.init(sl.layout)
    server = ServerOptimizer(**opt)
    w_ref = sl.split(arrays, torch.float64)[0]
    opt_state = server.init(w_ref)
    ns = [30, 50, 40, 60, 45]
    for r in (1, 2):
        base = torch.randn(sl.layout.size, dtype=torch.float64)
        deltas = [base * (1 + 0.1 * i) + 0.01 * torch.randn_like(base) for i in range(5)]
        strat.configure_train(r, arrays, ConfigRecord(), _Nodes(list(range(1000, 1005))))
        replies, _, w = _replies(arrays, deltas, ns)
        new, metrics = strat.aggregate_train(r, list(reversed(replies)))  # any order
        # the rows as the server has them: w − w_k of the replies' arrays
        rows = torch.stack([w - sl.split(m.content["arrays"], torch.float64)[0]
                            for m in replies])
        info = CohortInfo(clients=torch.arange(5), round=r - 1, num_clients=5,
                          losses=torch.full((5,), float("nan"), dtype=torch.float64))
        d, state, _ = agg(rows, torch.tensor(ns, dtype=torch.float64), state, info=info)
        w_ref, opt_state = server.step(w, d, opt_state)
        got, bufs = sl.split(new, torch.float64)
        assert float((got - w_ref).abs().max()) == 0.0
        assert metrics["fedloom-accepted"] == 5 and metrics["fedloom-rejected"] == 0
        _, sent_bufs = sl.split(arrays, torch.float64)
        mean = sum((sent_bufs["bn1.running_mean"] + i) * n for i, n in enumerate(ns)) / sum(ns)
        assert torch.allclose(bufs["bn1.running_mean"], mean, rtol=0, atol=1e-12)
        assert int(bufs["bn1.num_batches_tracked"]) == int(
            sent_bufs["bn1.num_batches_tracked"]) + 4
        arrays = new


def test_screening_rejects_and_counts_bad_replies_and_never_applies_them():
    """Non-finite, absurdly large, undecodable (another model, no num-examples, a
    negative or a NaN count) replies are rejected and counted; the others aggregate
    to what they give alone; a round with nothing acceptable leaves the model as sent."""
    torch.manual_seed(0)
    arrays = initial_arrays()
    sl = StateLayout.from_arrays(arrays)
    w, bufs = sl.split(arrays, torch.float32)
    good = [torch.randn(sl.layout.size) * 0.01 for _ in range(3)]

    def rep(delta, node, n=50, metrics=None):
        return _reply(sl.join(w - delta, bufs), n, node, metrics)

    nan = torch.zeros(sl.layout.size)
    nan[3] = float("nan")
    other = _reply(ArrayRecord(OrderedDict(a=torch.zeros(3))), 50, 1005)
    no_n = _reply(sl.join(w, bufs), 50, 1006)
    no_n.content["metrics"] = MetricRecord({"train_loss": 1.0})
    bad = [rep(nan, 1003), rep(torch.full((sl.layout.size,), 1e6), 1004), other, no_n,
           rep(good[0], 1007, n=-3), rep(good[0], 1008, n=float("nan"))]
    strat = FedloomRule("fedavg", server_lr=1.0)
    strat.configure_train(1, arrays, ConfigRecord(), _Nodes(list(range(1000, 1009))))
    new, metrics = strat.aggregate_train(1, [rep(g, 1000 + i) for i, g in enumerate(good)] + bad)
    assert metrics["fedloom-rejected"] == 6 and metrics["fedloom-accepted"] == 3
    reasons = strat.history[-1]["rejected"]
    assert "non-finite" in reasons[1003] and "max_norm_ratio" in reasons[1004]
    assert "unknown tensor 'a'" in reasons[1005] and "num-examples" in reasons[1006]
    assert "must be a finite number > 0" in reasons[1007]
    assert "must be a finite number > 0" in reasons[1008]
    got = sl.split(new, torch.float32)[0]
    assert torch.allclose(got, w - sum(good) / 3, atol=1e-6)
    # Nothing acceptable: the step is skipped and the arrays sent come back.
    strat.configure_train(2, new, ConfigRecord(), _Nodes(list(range(1000, 1009))))
    same, metrics = strat.aggregate_train(2, [rep(nan, 1003), other])
    assert metrics["fedloom-step-skipped"] == 1 and metrics["fedloom-rejected"] == 2
    assert torch.equal(sl.split(same, torch.float32)[0], got)
    assert strat.totals == {"accepted": 3, "rejected": 8, "failed": 0, "skipped_rounds": 1}


class Broken:
    """A rule that raises on its first cohort and returns NaN on the next (the guards)."""

    def init(self, layout):
        return {"calls": torch.zeros(1)}

    def __call__(self, updates, weights, state, *, info=None):
        if info.round == 0:
            raise ValueError("ill-posed cohort")
        return torch.full((updates.shape[1],), float("nan"), dtype=updates.dtype), state, {}


def test_a_failing_rule_skips_the_step_and_keeps_its_state():
    """A rule that raises on the cohort, then one whose direction is not finite: each
    round's step is skipped, the arrays sent come back, the optimizer state stays."""
    torch.manual_seed(0)
    arrays = initial_arrays()
    sl = StateLayout.from_arrays(arrays)
    w, bufs = sl.split(arrays, torch.float32)
    strat = FedloomRule("test_flower_strategies:Broken", server_optimizer="momentum",
                        server_lr=1.0)
    for r, why in ((1, "the aggregator failed (ValueError: ill-posed cohort)"),
                   (2, "the aggregate is not finite")):
        strat.configure_train(r, arrays, ConfigRecord(), _Nodes([1000, 1001, 1002]))
        replies = [_reply(sl.join(w - 0.01 * torch.randn(sl.layout.size), bufs), 10, 1000 + i)
                   for i in range(3)]
        v_before = strat.opt_state[0]["v"].clone()  # (heavy ball's {v}, the step's None)
        new, metrics = strat.aggregate_train(r, replies)
        assert metrics["fedloom-step-skipped"] == 1 and metrics["fedloom-accepted"] == 3
        assert strat.history[-1]["skipped"] == why
        assert new is arrays
        assert torch.equal(strat.opt_state[0]["v"], v_before)


def test_options_are_checked_by_name_with_one_line():
    with pytest.raises(ValueError, match=r"aggregator\.options\.nope"):
        CRAFT(nope=1)
    with pytest.raises(ValueError, match="server_lr"):
        CRAFT(server_lr=-1)
    with pytest.raises(ValueError, match="dtype"):
        CRAFT(dtype="float8")
    with pytest.raises(ValueError, match="feedback: 'flare' adds a penalty"):
        CompressionMod("topk", {"ratio": 0.01}, feedback="flare")
    with pytest.raises(ValueError, match="feedback: 'ef21'"):
        CompressionMod("topk", {"ratio": 0.01}, feedback="ef21")
    with pytest.raises(ValueError, match="tau"):
        CompressionMod("topk", {"ratio": 0.01}, feedback="flare", app_applies_penalty=True,
                       feedback_options={"tau": -1.0})
    with pytest.raises(ValueError, match="ratio"):
        CompressionMod("topk", {"ratio": 7})
    # server_lr="auto" follows the engine's default: rprop's 1.0; the paper's step 0.1
    assert CRAFT().server.lr == 1.0 and CRAFT().aggregator.step == "rprop"
    assert CRAFT().aggregator.step_max == 100.0
    assert CRAFT(step="fixed").server.lr == 0.1 and CRAFT(step="fixed").aggregator.step == "fixed"


# ---------------------------------------------------------- stock simulations
def test_fedavg_to_craft_is_one_line_and_rejects_a_nan_client():
    """The same stock app under Flower's FedAvg and under fedloom's CRAFT: both train
    (global loss falls); a client that replies NaN weights in round 2 is rejected and
    counted by CRAFT, and CRAFT's model stays finite."""
    def nan_in_round_2(pid, rnd, sd, _):
        if pid == 2 and rnd == 2:
            sd = OrderedDict(sd)
            sd["fc1.weight"] = torch.full_like(sd["fc1.weight"], float("nan"))
        return sd

    start = global_loss(initial_arrays())
    flower, _ = run(FedAvg(fraction_evaluate=0.0, min_available_nodes=NODES), stock_app())
    craft, _ = run(CRAFT(fraction_evaluate=0.0, min_available_nodes=NODES, server_lr=1.0),
                   stock_app(attack=nan_in_round_2))
    for res in (flower, craft):
        assert finite(res.arrays) and global_loss(res.arrays) < start
    rejected = [m["fedloom-rejected"] for _, m in sorted(craft.train_metrics_clientapp.items())]
    assert rejected == [0, 1, 0]
    assert craft.train_metrics_clientapp[3]["craft_max_violation"] < 1e-6


def test_krum_survives_a_sign_flipping_client_that_breaks_fedavg():
    """Client 0 sends −8× its update (``w − 8(w_k − w)``, a scaled sign flip): under
    FedAvg the global loss rises above its start, under Krum it falls; Krum never
    picks the attacker, and nothing is rejected by screening (the attack is within
    the norm rules: Krum's selection is what stops it)."""
    def flip(pid, rnd, sd, sent):
        if pid != 0:
            return sd
        return OrderedDict((k, sent[k] - 8 * (v - sent[k]) if "running" not in k and
                            v.is_floating_point() else v) for k, v in sd.items())

    fedavg, _ = run(FedloomRule("fedavg", server_lr=1.0, fraction_evaluate=0.0,
                                min_available_nodes=NODES), stock_app(attack=flip), rounds=4)
    krum = Krum(f=1, fraction_evaluate=0.0, min_available_nodes=NODES)
    res, _ = run(krum, stock_app(attack=flip), rounds=4)
    assert finite(res.arrays)
    assert global_loss(res.arrays) < global_loss(initial_arrays()) < global_loss(fedavg.arrays)
    assert all(h["krum_best_client"] != krum.node_index[1000] for h in krum.history)
    assert krum.totals["rejected"] == 0 and krum.totals["accepted"] == 4 * NODES


def test_top1_sapef_through_the_mod():
    """Top-1 % + SA-PEF on the stock app through CompressionMod, decoded by CRAFT's
    ``compression=``: finite, nothing rejected, each client keeps a residual in its
    Context, the replies carry ~1 % of the coordinates and no arrays, and Flower's
    own FedAvg refuses such a reply instead of averaging it."""
    mod = CompressionMod("topk", {"ratio": 0.01}, feedback="sapef", alpha=0.5, seed=1)
    app = stock_app(mods=[mod])
    strat = CRAFT(compression="topk", compression_options={"ratio": 0.01}, server_lr=1.0,
                  fraction_evaluate=0.0, min_available_nodes=NODES)
    res, grid = run(strat, app)
    assert finite(res.arrays)
    assert strat.totals == {"accepted": 3 * NODES, "rejected": 0, "failed": 0,
                            "skipped_rounds": 0}
    d = strat.state_layout.layout.size
    for ctx in grid.contexts.values():
        e = ctx.state["fedloom.stock-feedback"].to_torch_state_dict()["residual"]
        assert e.numel() == d and float(e.norm()) > 0
    for rep in grid.log:
        assert not rep.content.array_records and "buffers" in rep.content["fedloom"]
        assert len(rep.content["fedloom"]["payload"]) < 0.1 * 4 * d
    # Undecodable without compression=: every compressed reply is rejected, counted,
    # and a round where all are rejected for that reason stops the run, saying the fix.
    plain = CRAFT(fraction_evaluate=0.0, min_available_nodes=NODES)
    with pytest.raises(IncompatibleReplies, match=r"no compression=.*fix: give the strategy"):
        run(plain, stock_app(mods=[CompressionMod("topk", {"ratio": 0.01},
                                                  feedback="ef")]), rounds=1)
    assert plain.totals["rejected"] == NODES and plain.totals["skipped_rounds"] == 1
    from flwr.serverapp.exception import InconsistentMessageReplies

    with pytest.raises(InconsistentMessageReplies):
        run(FedAvg(fraction_evaluate=0.0, min_available_nodes=NODES),
            stock_app(mods=[CompressionMod("topk", {"ratio": 0.01})]), rounds=1)


def test_sapef_mod_trains_the_app_from_the_step_ahead_point():
    """The arrays the wrapped app loads in a client's second round are ``w − α e``
    (SA-PEF's start point: the round's model less α times the residual the client
    kept after its first round); in its first round, with e = 0, the model itself."""
    seen = {}

    def spy(pid, rnd, sd, start):
        seen[pid] = start
        return sd

    mod = CompressionMod("topk", {"ratio": 0.05}, feedback="sapef", alpha=0.5)
    strat = FedloomRule("fedavg", compression="topk", compression_options={"ratio": 0.05},
                        fraction_evaluate=0.0, min_available_nodes=NODES)
    grid = LocalGrid(stock_app(mods=[mod], attack=spy))
    w0 = initial_arrays()
    first = strat.start(grid=grid, initial_arrays=w0, num_rounds=1)
    sl = strat.state_layout
    assert torch.equal(sl.split(ArrayRecord(seen[0]), torch.float32)[0],
                       sl.split(w0, torch.float32)[0])
    e1 = grid.contexts[1000].state["fedloom.stock-feedback"].to_torch_state_dict()["residual"]
    assert float(e1.norm()) > 0
    strat.start(grid=grid, initial_arrays=first.arrays, num_rounds=1)
    w1 = sl.split(first.arrays, torch.float32)[0]
    start = sl.split(ArrayRecord(seen[0]), torch.float32)[0]
    assert torch.allclose(start, w1 - 0.5 * e1, rtol=0, atol=1e-7)
    # the buffers are handed over as sent (only the parameters move)
    assert torch.equal(seen[0]["bn1.running_var"],
                       first.arrays.to_torch_state_dict()["bn1.running_var"])


# ------------------------------------------------- against fedloom's own engine
class _Float64Wire:
    """The dense vector as little-endian float64 under identity's header: the stock
    app's arrays are float64, and the engine's server half decodes the bytes it is
    given (identity's own wire is float32)."""

    def encode(self, x, *, gen=None):
        from fedloom.compress.base import pack
        from fedloom.compress.identity import CODEC_IDENTITY

        body = x.detach().to(torch.float64).contiguous().cpu().numpy().astype("<f8")
        return pack(CODEC_IDENTITY, x.shape[0], body.tobytes(), True)

    def decode(self, payload, d=None):
        import numpy as np

        from fedloom.compress.base import unpack_header
        from fedloom.compress.identity import CODEC_IDENTITY

        d, body = unpack_header(payload, CODEC_IDENTITY, d, True)
        return torch.from_numpy(np.frombuffer(body, dtype="<f8").copy())


def test_three_stock_rounds_of_craft_end_at_the_engines_model():
    """A 3-round run of the stock app (float64, fedloom's ``mlp`` architecture, every
    client every round) with ``CRAFT``; the recorded replies, fed round by round to
    fedloom's engine (``Experiment.finish_round`` of a config with the same rule,
    server step and screening), give the same final model: max difference 0 (the
    cohort in the same order; asserted below 1e-12, which any order would meet)."""
    from fedloom.compress.feedback import UplinkResult
    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment
    from fedloom.engine.objects import Components
    from fedloom.engine.runstate import RoundOutcome
    from fedloom.job import ClientResult

    cfg = load_config({
        "name": "stock", "seed": 0, "rounds": 3, "dtype": "float64",
        "data": {"name": "synthetic", "num_clients": NODES, "partition": {"name": "natural"},
                 "max_samples": 600},
        "model": {"name": "mlp", "options": {"hidden": [8]}}, "cohort": {"size": NODES},
        "aggregator": {"name": "craft", "options": {"precision": "float64"}},
        "server": {"lr": 0.5}, "checkpoint": {"every": 0}, "eval": {"every": 100}})
    exp = Experiment.from_config(cfg, components=Components(compressor=_Float64Wire()))
    st = exp.init()
    arrays = ArrayRecord(OrderedDict((k, v.clone()) for k, v in
                                     exp.layout.unflatten(st.w).items()))
    strat = CRAFT(server_lr=0.5, precision="float64", dtype="float64",
                  fraction_evaluate=0.0, min_available_nodes=NODES)
    app = stock_app(lambda: copy.deepcopy(exp.module), torch.float64, dim=exp.x.shape[1])
    res, grid = run(strat, app, arrays=arrays)
    sent = arrays
    for r in range(3):
        plan = exp.plan_round(st)
        replies = {m.metadata.src_node_id - 1000: m
                   for m in grid.log[r * NODES:(r + 1) * NODES]}
        w_sent = exp.layout.flatten(sent.to_torch_state_dict())
        results, ups = [], []
        for k in plan.cohort.tolist():
            c = replies[k].content
            g = w_sent - exp.layout.flatten(c["arrays"].to_torch_state_dict())
            results.append(ClientResult(k, torch.empty(0), int(c["metrics"]["num-examples"]),
                                        float(c["metrics"]["train_loss"]), 1))
            # the row is g itself: the server decodes it from the float64 wire
            ups.append(UplinkResult(exp.uplink.encode(g), None, {}))
        st, _ = exp.finish_round(st, plan, RoundOutcome(results, ups), t0=0.0, t_train=0.0,
                                 client_state=False)
        sent = ArrayRecord(OrderedDict((k, v.clone()) for k, v in
                                       exp.layout.unflatten(st.w).items()))
    got = exp.layout.flatten(res.arrays.to_torch_state_dict())
    assert float((got - st.w).abs().max()) < 1e-12
    assert float((got - exp.layout.flatten(arrays.to_torch_state_dict())).abs().max()) > 0


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # with the other Ray simulations, under `pytest -n`
def test_craft_in_flowers_run_simulation():
    """The one-line swap in Flower's own simulation runtime (Ray, 5 SuperNodes)."""
    pytest.importorskip("ray")
    from flwr.serverapp import ServerApp

    from conftest import flower_simulation

    out = {}
    server = ServerApp()

    @server.main()
    def main(grid, context):
        strategy = CRAFT(fraction_evaluate=0.0, min_available_nodes=NODES, server_lr=1.0)
        out["result"] = strategy.start(grid=grid, initial_arrays=initial_arrays(),
                                       num_rounds=2, train_config=ConfigRecord({"lr": 0.1}))
        out["strategy"] = strategy

    flower_simulation(server, stock_app(), NODES)
    res, strategy = out["result"], out["strategy"]
    assert finite(res.arrays) and global_loss(res.arrays) < global_loss(initial_arrays())
    assert strategy.totals["accepted"] == 2 * NODES and strategy.totals["rejected"] == 0


def test_rules_that_need_metrics_reject_replies_without_them():
    """q-FedAvg needs F_k(w) (metric ``start-loss``) and the client step: a reply
    without the metric is rejected and named, the others aggregate."""
    torch.manual_seed(0)
    arrays = initial_arrays()
    sl = StateLayout.from_arrays(arrays)
    w, bufs = sl.split(arrays, torch.float32)
    with pytest.raises(ValueError, match="client_lr"):
        QFedAvg().configure_train(1, arrays, ConfigRecord(), _Nodes([1000, 1001]))
    strat = QFedAvg(client_lr=0.1, q=1.0)
    strat.configure_train(1, arrays, ConfigRecord(), _Nodes([1000, 1001, 1002]))
    replies = [_reply(sl.join(w - 0.01 * torch.randn(sl.layout.size), bufs), 10, 1000 + i,
                      {"start-loss": 1.0 + i} if i else None) for i in range(3)]
    new, metrics = strat.aggregate_train(1, replies)
    assert metrics["fedloom-rejected"] == 1 and metrics["fedloom-accepted"] == 2
    assert "start-loss" in strat.history[-1]["rejected"][1000]
    assert finite(new) and not torch.equal(sl.split(new, torch.float32)[0], w)


def test_flowers_node_sampling_runs_seeded_and_leaves_the_global_generator():
    """Flower samples with ``random.sample``: under ``seed`` the same nodes are drawn
    by two strategies, another seed draws others, and Python's global generator is
    where it was."""
    import random

    def cohorts(seed):
        strat = FedloomRule("fedavg", seed=seed, fraction_train=0.3, min_train_nodes=1,
                            min_available_nodes=1)
        nodes = _Nodes(list(range(1000, 1020)))
        return [sorted(m.metadata.dst_node_id
                       for m in strat.configure_train(r, initial_arrays(), ConfigRecord(),
                                                      nodes)) for r in range(1, 6)]

    random.seed(123)
    before = random.getstate()
    a, b, c = cohorts(0), cohorts(0), cohorts(1)
    assert random.getstate() == before
    assert a == b and a != c and len(a[0]) == 6
    assert len({tuple(x) for x in a}) > 1  # rounds differ


def test_flare_on_a_stock_app_that_opts_in():
    """FLARE through the mod, the app adding the penalty with LocalPenalty: on the
    first local step of a client's second round the gradient grows by exactly
    fedloom's ``Penalty.grad`` (``τ_r m sign(w − (w − A))`` of the accumulator A it
    kept after round 1), on the next step by nothing; the run is finite, nothing
    is rejected, and it ends elsewhere than plain EF (the penalty changed training)."""
    from fedloom.job import Penalty

    seen = []

    def flare_app(mods):
        app = ClientApp(mods=mods)

        @app.train()
        def train(msg, context):
            model = Net()
            model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
            pen = LocalPenalty.from_message(msg, model)
            pid = int(context.node_config["partition-id"])
            x, y = load_data(pid)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step, i in enumerate(range(0, len(y), 16)):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x[i:i + 16]), y[i:i + 16]).backward()
                before = {n: p.grad.clone() for n, p in model.named_parameters()}
                pen.apply(model, step)
                if pid == 1 and step < 2:
                    seen.append((int(msg.content["config"]["server-round"]), step, pen,
                                 {n: p.detach().clone() for n, p in model.named_parameters()},
                                 {n: p.grad - before[n] for n, p in model.named_parameters()},
                                 msg.content.array_records.get("fedloom.penalty")))
                opt.step()
            return Message(RecordDict({"arrays": ArrayRecord(model.state_dict()),
                                       "metrics": MetricRecord({"num-examples": len(y)})}),
                           reply_to=msg)

        return app

    def strategy():
        return FedloomRule("fedavg", compression="topk", compression_options={"ratio": 0.05},
                           fraction_evaluate=0.0, min_available_nodes=NODES)

    mod = CompressionMod("topk", {"ratio": 0.05}, feedback="flare", app_applies_penalty=True,
                         feedback_options={"tau": 0.5, "penalty_steps": 1})
    strat = strategy()
    res, _ = run(strat, flare_app([mod]), rounds=2)
    assert finite(res.arrays) and strat.totals["rejected"] == 0
    r2 = [x for x in seen if x[0] == 2]
    (_, _, pen, w0, d0, rec), (_, _, _, _, d1, _) = r2
    sl = StateLayout.from_arrays(initial_arrays())
    vec = rec.to_torch_state_dict()
    flat = lambda m: torch.cat([m[n].reshape(-1) for n in sl.layout.names])  # noqa: E731
    ref = Penalty(vec["target"], pen.tau, 1, "l1", vec["mask"]).grad(flat(w0))
    assert pen.tau == pytest.approx(0.5 / 1.1 ** 2) and float(vec["mask"].sum()) > 0
    assert torch.allclose(flat(d0), ref, rtol=0, atol=1e-6)
    assert float(flat(d1).abs().max()) == 0.0
    ef, _ = run(strategy(), flare_app([CompressionMod("topk", {"ratio": 0.05}, feedback="ef")]),
                rounds=2)
    assert not torch.equal(sl.split(ef.arrays, torch.float32)[0],
                           sl.split(res.arrays, torch.float32)[0])


# ------------------------------------------- what a stock app gets wrong (#36, 6-8)
def test_a_rule_whose_metric_no_reply_sends_stops_the_run_naming_the_fix():
    """FedFV on a stock app that sends no ``start-loss``: every reply is rejected for
    that one reason, so the run stops (``IncompatibleReplies``) naming the metric and
    how to compute it, instead of ending with the untrained model."""
    strat = FedloomRule("fedfv", fraction_evaluate=0.0, min_available_nodes=NODES)
    with pytest.raises(IncompatibleReplies, match=r"all 5 replies were rejected.*start-loss"
                       r".*fix: send 'start-loss'.*before training"):
        run(strat, stock_app())
    assert strat.totals["rejected"] == NODES and strat.totals["accepted"] == 0


def _bad_reply_round(strat, field, value, good_metrics=None):
    """One round of 3 good replies and one whose ``field`` is ``value`` (a metric, or
    the buffer ``bn1.num_batches_tracked``); returns (new arrays, metrics, sent w)."""
    torch.manual_seed(0)
    arrays = initial_arrays()
    sl = StateLayout.from_arrays(arrays)
    w, bufs = sl.split(arrays, torch.float32)
    strat.configure_train(1, arrays, ConfigRecord({"lr": 0.1}),
                          _Nodes(list(range(1000, 1004))))
    replies = []
    for i in range(4):
        b = OrderedDict(bufs)
        b["bn1.num_batches_tracked"] = b["bn1.num_batches_tracked"] + 3
        metrics = dict(good_metrics or {})
        if i == 3 and field == "buffer":
            b["bn1.num_batches_tracked"] = torch.tensor(value, dtype=torch.float32)
        n = 10 + i
        if i == 3 and field == "num-examples":
            n = value
        elif i == 3 and field != "buffer":
            metrics[field] = value
        rec = sl.join(w - 0.01 * torch.randn(sl.layout.size), b)
        if i == 3 and field == "buffer":  # join casts to the record's dtype: send it as is
            sd = rec.to_torch_state_dict()
            sd["bn1.num_batches_tracked"] = b["bn1.num_batches_tracked"]
            rec = ArrayRecord(sd)
        replies.append(_reply(rec, n, 1000 + i, metrics))
    new, metrics = strat.aggregate_train(1, replies)
    return new, metrics, sl, w


@pytest.mark.parametrize("make,field,value", [
    (lambda: FedloomRule("fednova", server_lr=1.0), "num-steps", float("nan")),
    (lambda: FedloomRule("fednova", server_lr=1.0), "num-steps", float("inf")),
    (lambda: FedloomRule("fednova", server_lr=1.0), "num-steps", 1e30),
    (lambda: FedloomRule("fedavg", server_lr=1.0), "num-examples", 1e39),
    (lambda: FedloomRule("fedavg", server_lr=1.0), "num-examples", 1e300),
    (lambda: FedloomRule("afl", server_lr=1.0), "start-loss", float("nan")),
    (lambda: FedloomRule("afl", server_lr=1.0), "start-loss", float("inf")),
    (lambda: QFedAvg(client_lr=0.1, q=1.0), "start-loss", float("nan")),
    (lambda: QFedAvg(client_lr=0.1, q=1.0), "start-loss", float("inf")),
    (lambda: FedloomRule("fedavg", server_lr=1.0), "buffer", 1e30),
])
def test_one_absurd_number_is_rejected_and_the_round_goes_on(make, field, value):
    """A non-finite or absurd count, loss or integer buffer in one reply: that reply
    is rejected and counted, with its reason, before aggregation; the other three
    step the model, and the global ``num_batches_tracked`` is theirs."""
    strat = make()
    good = {"num-steps": 5, "start-loss": 1.5}
    new, metrics, sl, w = _bad_reply_round(strat, field, value, good)
    assert metrics["fedloom-rejected"] == 1 and metrics["fedloom-accepted"] == 3
    assert metrics["fedloom-step-skipped"] == 0
    why = strat.history[-1]["rejected"][1003]
    assert ("num_batches_tracked" if field == "buffer" else field) in why
    got, bufs = sl.split(new, torch.float32)
    assert finite(new) and not torch.equal(got, w)
    assert int(bufs["bn1.num_batches_tracked"]) == 3


def test_rejections_name_the_partition_and_reach_flowers_log_with_level_and_time():
    """With ``partition_id_mod`` a rejected client is named by its partition-id; fedloom's
    warning reaches the handlers of Flower's logger, as a WARNING with fedloom's name
    and time; Flower's "Received N results" line is there; the round's metrics say
    what the replies carried against the dense model."""
    import logging

    from flwr.common.logger import FLOWER_LOGGER

    from fedloom.integrations.flower.stock import partition_id_mod

    def nan_from_2(pid, rnd, sd, _):
        if pid == 2:
            sd = OrderedDict(sd)
            sd["fc1.weight"] = torch.full_like(sd["fc1.weight"], float("nan"))
        return sd

    seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record)

    keep = Keep(level=logging.INFO)
    FLOWER_LOGGER.addHandler(keep)
    try:
        strat = CRAFT(fraction_evaluate=0.0, min_available_nodes=NODES, server_lr=1.0)
        res, _ = run(strat, stock_app(attack=nan_from_2, mods=[partition_id_mod]), rounds=1)
    finally:
        FLOWER_LOGGER.removeHandler(keep)
    lines = [(r.levelname, r.getMessage()) for r in seen]
    warned = [m for lvl, m in lines if lvl == "WARNING" and "partition-id 2 (node 1002)" in m]
    assert warned and warned[0].startswith("[fedloom ") and "non-finite update" in warned[0]
    assert ("INFO", "aggregate_train: Received 5 results and 0 failures") in lines
    assert strat.partitions == {1000 + k: k for k in range(NODES)}
    m = res.train_metrics_clientapp[1]
    d = strat.state_layout.layout.size
    assert m["fedloom-dense-bytes"] == m["fedloom-uplink-bytes"] == NODES * 4 * d


def test_the_round_metrics_say_what_the_mod_saved():
    """Top-1 % through CompressionMod: the round's ``fedloom-uplink-bytes`` (the
    payloads) against ``fedloom-dense-bytes`` (the same replies' parameters dense)."""
    mod = CompressionMod("topk", {"ratio": 0.01}, feedback="sapef", alpha=0.5)
    strat = CRAFT(compression="topk", compression_options={"ratio": 0.01}, server_lr=1.0,
                  fraction_evaluate=0.0, min_available_nodes=NODES)
    res, grid = run(strat, stock_app(mods=[mod]), rounds=1)
    m = res.train_metrics_clientapp[1]
    d = strat.state_layout.layout.size
    assert m["fedloom-dense-bytes"] == NODES * 4 * d
    assert m["fedloom-uplink-bytes"] == sum(len(r.content["fedloom"]["payload"])
                                            for r in grid.log)
    assert m["fedloom-uplink-bytes"] < 0.1 * m["fedloom-dense-bytes"]
    assert strat.partitions == {1000 + k: k for k in range(NODES)}  # the mod says it


def test_an_aggregator_object_is_the_strategy_its_name_builds():
    """``FedloomRule(aggregator=<object>)`` (and a server optimizer object): the same
    new arrays as the rule and optimizer named by strings, bit for bit in float64."""
    from fedloom.registry import get

    torch.manual_seed(5)
    arrays = ArrayRecord(OrderedDict((k, v.double() if v.is_floating_point() else v)
                                     for k, v in Net().state_dict().items()))
    common = {"dtype": "float64", "min_available_nodes": 5, "min_train_nodes": 5}
    by_name = FedloomRule("craft", server_lr=0.5, server_optimizer="momentum",
                          server_options={"momentum": 0.9}, groups="layer", **common)
    by_obj = FedloomRule(make_aggregator("craft", groups="layer"),
                         server_optimizer=get("server_optimizer", "momentum")(lr=0.5,
                                                                              momentum=0.9),
                         **common)
    assert by_obj.aggregator_name == "object fedloom.aggregate.craft.CRAFT"
    a = b = arrays
    sl = StateLayout.from_arrays(arrays)
    for r in (1, 2):
        base = torch.randn(sl.layout.size, dtype=torch.float64)
        deltas = [base * (1 + 0.1 * i) + 0.01 * torch.randn_like(base) for i in range(5)]
        out = []
        for strat, arr in ((by_name, a), (by_obj, b)):
            strat.configure_train(r, arr, ConfigRecord(), _Nodes(list(range(1000, 1005))))
            replies, _, _ = _replies(arr, deltas, [30, 50, 40, 60, 45])
            out.append(strat.aggregate_train(r, replies)[0])
        a, b = out
        assert torch.equal(sl.split(a, torch.float64)[0], sl.split(b, torch.float64)[0])


def test_an_aggregator_object_takes_no_options_and_no_auto_step():
    agg = make_aggregator("craft")
    with pytest.raises(ValueError, match="groups: options of an aggregator given as an object"):
        FedloomRule(agg, server_lr=1.0, groups="layer")
    with pytest.raises(ValueError, match=r"server_lr: 'auto' .* give server_lr"):
        FedloomRule(agg)


def test_a_rule_that_declares_only_capabilities_gets_its_metrics():
    """The strategy reads what a rule needs through its declared capabilities (a
    rule of a user's own with no loose ``requires`` flag)."""
    from fedloom.capabilities import AggregatorCaps

    class NeedsLosses:
        capabilities = AggregatorCaps(requires=frozenset({"start_losses"}))

        def init(self, layout):
            return None

        def __call__(self, updates, weights, state, *, info=None):
            return updates.mean(0), state, {}

    assert FedloomRule(NeedsLosses(), server_lr=1.0).requires == {"start_losses"}
