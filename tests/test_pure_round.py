"""The experiment holds no run state: ``state, metrics = exp.round(state)`` (#53).

What a run is lives in its :class:`~fedloom.engine.runstate.RunState`, the clients'
rows included (``st.clients``, updated in place and returned in the new state); the
experiment keeps only workspace between rounds (its row buffer, the module models
are loaded into). So two states advance side by side on one experiment, or two
experiments side by side, each exactly as alone.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import types
from typing import Any

import numpy as np
import pytest
import torch

from fedloom.client.sgd import _Scratch
from fedloom.config import load_config
from fedloom.engine.experiment import Experiment
from fedloom.engine.runstate import RunState, model_sha256
from fedloom.state import ClientStateStore

# Every kind of state a round writes: the feedback policy's rows and server state (EF
# over Top-k), the local method's rows and server state (SCAFFOLD), the server
# optimizer's (momentum), the iterates' mean, a stateful client selector (Oort).
STATEFUL = ["compression.name=topk", "compression.options.ratio=0.1",
            "compression.feedback=ef", "client.method=scaffold",
            "server.optimizer=momentum", "eval.average_iterates=true",
            "cohort.selection=oort"]
WALL_CLOCK = ("train_s", "agg_s", "wall_s")
_BY_IDENTITY = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                types.ModuleType)


def _exp(tiny: dict[str, Any], over: list[str] = STATEFUL) -> Experiment:
    return Experiment.from_config(load_config(tiny, over))


def _record(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if k not in WALL_CLOCK}


def _rows(st: RunState) -> dict[str, torch.Tensor]:
    ids = range(st.clients.num_clients)
    return {f: st.clients.gather(f, ids) for f in st.clients.fields}


def _alone(tiny: dict[str, Any], over: list[str], rounds: int) -> list[Any]:
    exp = _exp(tiny, over)
    st, out = exp.init(), []
    for _ in range(rounds):
        st, m = exp.round(st)
        out.append((model_sha256(st.w), _record(m)))
    exp.close()
    return out


def _digest(obj: Any, seen: dict[int, str], depth: int = 0) -> Any:
    """The contents of ``obj``, recursively (tensors and arrays by the SHA-256 of their
    bytes), so that two snapshots compare equal exactly when nothing reachable was
    changed. Workspace is taken by identity only: the module (every round's model and
    buffers are loaded into it) and a trainer's scratch (its flat module, built on first
    use and overwritten by every client's steps: fedloom.client.sgd._Scratch)."""
    if obj is None or isinstance(obj, bool | int | float | str | bytes | torch.dtype
                                 | torch.device):
        return obj
    if id(obj) in seen:  # a cycle, or an object reached twice: taken once
        return ("seen", seen[id(obj)])
    seen[id(obj)] = f"{type(obj).__name__}@{id(obj)}"
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        return ("tensor", t.dtype, tuple(t.shape), hashlib.sha256(t.numpy().tobytes()
                                                                   ).hexdigest())
    if isinstance(obj, np.ndarray):
        return ("array", obj.dtype.str, obj.shape, hashlib.sha256(obj.tobytes()).hexdigest())
    if isinstance(obj, torch.nn.Module | torch.Generator | _Scratch) or depth > 12:
        return ("object", seen[id(obj)])
    if isinstance(obj, dict):
        return {k: _digest(v, seen, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set | frozenset):
        items = sorted(obj, key=repr) if isinstance(obj, set | frozenset) else obj
        return [_digest(v, seen, depth + 1) for v in items]
    if isinstance(obj, functools.partial):
        return ("partial", _digest(obj.func, seen, depth + 1),
                _digest(obj.args, seen, depth + 1), _digest(obj.keywords, seen, depth + 1))
    if (hasattr(obj, "__dict__") and not isinstance(obj, _BY_IDENTITY)) or (
            dataclasses.is_dataclass(obj)):
        return (type(obj).__name__, _digest(vars(obj), seen, depth + 1))
    return ("object", seen[id(obj)])  # functions, classes, handles: by identity


def _snapshot(exp: Experiment) -> dict[str, Any]:
    return {name: (id(v), _digest(v, {})) for name, v in vars(exp).items()
            if name != "workspace"}


def test_two_states_of_one_experiment_share_no_rows(tiny):
    """Two init() calls give two stores; a round on A changes nothing of B (its rows
    included), and A's rows are those of the state A's round returned."""
    exp = _exp(tiny)
    a, b = exp.init(), exp.init()
    assert a.clients is not b.clients and a.clients.fields
    b_rows, b_all = _rows(b), _digest(vars(b), {})
    a1, _ = exp.round(a)
    assert a1.clients is a.clients  # updated in place, as documented
    assert any(bool(v.any()) for v in _rows(a1).values())
    assert all(torch.equal(v, _rows(b)[f]) for f, v in b_rows.items())
    assert not any(bool(v.any()) for v in _rows(b).values())
    assert _digest(vars(b), {}) == b_all
    exp.close()


def test_a_round_changes_nothing_of_its_state_but_the_rows(tiny):
    """exp.round(st) returns a new state; every field of ``st`` but its store keeps
    its contents (the same objects, the same values)."""
    exp = _exp(tiny)
    st = exp.init()
    for _ in range(2):
        before = {f: _digest(v, {}) for f, v in vars(st).items() if f != "clients"}
        ids = {f: id(v) for f, v in vars(st).items()}
        new, _ = exp.round(st)
        assert {f: _digest(v, {}) for f, v in vars(st).items() if f != "clients"} == before
        assert {f: id(v) for f, v in vars(st).items()} == ids
        st = new
    exp.close()


def test_a_round_leaves_the_experiments_attributes_as_they_were(tiny):
    """vars(exp), the workspace (the row buffer; the module and the trainer's scratch,
    see _digest) excepted: the same objects, equal contents, before and after a
    round, from the first round on."""
    exp = _exp(tiny)
    st = exp.init()
    for _ in range(2):
        before = _snapshot(exp)
        st, _ = exp.round(st)
        after = _snapshot(exp)
        changed = [k for k in before if before[k] != after[k]]
        assert not changed, changed
    exp.close()


@pytest.mark.parametrize("backend", ["sequential", "process"])
def test_interleaved_states_and_experiments_are_each_as_alone(tiny, backend):
    """Two states of one experiment, and a third experiment of another config, advanced
    round by round in turn (one row buffer written by each state's rounds in turn, the
    process backend's workers writing into it): each gives what it gives alone."""
    over = [*STATEFUL, f"backend.name={backend}",
            *(["backend.options.workers=2"] if backend == "process" else [])]
    other = ["compression.name=topk", "compression.options.ratio=0.2",
             "compression.feedback=ef", "client.method=ditto", "cohort.size=6"]
    rounds = 3
    want, want_other = _alone(tiny, over, rounds), _alone(tiny, other, rounds)
    exp, exp2 = _exp(tiny, over), _exp(tiny, other)
    try:
        a, b, c = exp.init(), exp.init(), exp2.init()
        got: dict[str, list[Any]] = {"a": [], "b": [], "c": []}
        for r in range(rounds):
            b, mb = exp.round(b)  # b first in round 1, then behind a
            got["b"].append((model_sha256(b.w), _record(mb)))
            if r == 0:
                continue
            a, ma = exp.round(a)
            got["a"].append((model_sha256(a.w), _record(ma)))
            c, mc = exp2.round(c)
            got["c"].append((model_sha256(c.w), _record(mc)))
        a, ma = exp.round(a)
        got["a"].append((model_sha256(a.w), _record(ma)))
        c, mc = exp2.round(c)
        got["c"].append((model_sha256(c.w), _record(mc)))
    finally:
        exp.close()
        exp2.close()
    assert got["a"] == want and got["b"] == want
    assert got["c"] == want_other


def test_copy_keeps_an_earlier_state(tiny):
    """state.copy() before a round: the copy goes on as the state would have."""
    exp = _exp(tiny)
    st, _ = exp.round(exp.init())
    kept = st.copy()
    assert kept.clients is not st.clients
    assert all(torch.equal(v, _rows(st)[f]) for f, v in _rows(kept).items())
    one, m1 = exp.round(st)
    two, m2 = exp.round(kept)
    assert model_sha256(one.w) == model_sha256(two.w) and _record(m1) == _record(m2)
    assert all(torch.equal(v, _rows(two)[f]) for f, v in _rows(one).items())
    exp.close()


def test_a_memmap_store_copy_and_checkpoint_are_its_own_rows(tmp_path):
    """Two memory-mapped stores in one directory (two states of one run): the second
    takes over the file names, each keeps reading and writing its own rows, and each
    one's snapshot holds its own."""
    a = ClientStateStore(4, {"h": _spec(3)}, storage="memmap", directory=tmp_path)
    a.scatter("h", [1], torch.ones(1, 3))
    b = a.blank()
    c = a.copy()
    b.scatter("h", [2], torch.full((1, 3), 2.0))
    assert torch.equal(a.gather("h", range(4))[1], torch.ones(3))
    assert not bool(a.gather("h", range(4))[2].any())
    assert not bool(b.gather("h", range(4))[1].any())
    assert torch.equal(c.gather("h", range(4)), a.gather("h", range(4)))
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    restored = a.blank()
    restored.load_state_dict(a.state_dict(snaps, tag="a"), snaps)
    assert torch.equal(restored.gather("h", range(4)), a.gather("h", range(4)))


def _spec(size: int) -> Any:
    from fedloom.state import FieldSpec

    return FieldSpec(size)


def test_checkpoint_is_the_state(tiny):
    """restore(checkpoint_state(st)) is st: every field, the client rows and the last
    evaluation's per-client numbers included; the restored state has a store of its own."""
    exp = _exp(tiny)
    st, _ = exp.round(exp.init())
    assert st.evaluation.client_acc is not None
    back = exp.restore(exp.checkpoint_state(st))
    assert back.clients is not st.clients
    assert all(torch.equal(v, _rows(back)[f]) for f, v in _rows(st).items())
    assert np.array_equal(back.evaluation.client_acc, st.evaluation.client_acc)
    keep = {f for f in vars(st) if f not in ("clients", "evaluation")}
    assert ({f: _digest(getattr(back, f), {}) for f in keep}
            == {f: _digest(getattr(st, f), {}) for f in keep})
    one, m1 = exp.round(st)
    two, m2 = exp.round(back)
    assert model_sha256(one.w) == model_sha256(two.w) and _record(m1) == _record(m2)
    exp.close()
