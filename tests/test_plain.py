"""fedloom.plain: checkpoint state as tensors and plain data, rebuilt exactly;
anything that could make a reader run code is refused on the way out and on
the way in."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch

from fedloom import CohortInfo, Layout, make_aggregator
from fedloom.plain import TAG, PlainDataError, decode, encode, state_type
from fedloom.registry import available


@state_type
@dataclasses.dataclass
class _Point:
    x: torch.Tensor
    n: int = 0
    arr: np.ndarray | None = None


@dataclasses.dataclass
class _Unregistered:
    x: int = 0


def _through_file(obj):
    """encode → torch.save → torch.load(weights_only=True) → decode."""
    buf = io.BytesIO()
    torch.save(encode(obj), buf)
    buf.seek(0)
    return decode(torch.load(buf, weights_only=True))


def _same(a, b) -> bool:
    """Equal values of the same types, NumPy dtypes and bits (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (np.ndarray, np.generic)):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, float) and a != a:
        return b != b
    return a == b


ARRAYS = {
    "float32": np.array([1.5, -0.0, np.nan, np.inf], np.float32),
    "float64_2d": np.arange(12, dtype=np.float64).reshape(3, 4) / 7,
    "big_endian": np.arange(5, dtype=">f8"),
    "non_contiguous": np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2],
    "fortran": np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3)),
    "empty": np.zeros((0, 3), np.float32),
    "zero_d": np.array(7, np.int8),
    "bool": np.array([True, False, True]),
    "uint64_max": np.array([np.iinfo(np.uint64).max], np.uint64),
    "complex": np.array([1 + 2j], np.complex128),
    "float16": np.array([0.1, 65504], np.float16),
    "datetime": np.array(["2026-12-02"], "datetime64[D]"),
}
SCALARS = {"f32": np.float32(0.1), "f64": np.float64(1 / 3), "i64": np.int64(-5),
           "bool": np.bool_(True)}


def test_every_kind_of_state_value_comes_back_exactly():
    state = {
        "arrays": ARRAYS, "scalars": SCALARS,
        "tensors": [torch.arange(6, dtype=torch.float64).reshape(2, 3),
                    torch.tensor([1.5], dtype=torch.bfloat16), torch.zeros(0)],
        "plain": [None, True, 0, -(2**100), 1e308, float("nan"), "é", b"\x00\xff", (1, (2, 3))],
        3: {"int keys": 1},
        "dataclass": _Point(torch.ones(2), 3, np.arange(3, dtype=np.uint8)),
    }
    back = _through_file(state)
    assert _same(back, state)
    # rebuilt arrays own their memory and can be written (the state store writes rows)
    back["arrays"]["float32"][0] = 2.0
    assert state["arrays"]["float32"][0] == 1.5


def test_parameters_come_back_as_plain_tensors():
    p = torch.nn.Parameter(torch.ones(3))
    back = _through_file({"p": p})["p"]
    assert type(back) is torch.Tensor and torch.equal(back, p.detach())


@pytest.mark.parametrize("value, match", [
    (object(), r"state\.v: a builtins\.object cannot be checkpointed"),
    ({1, 2}, r"state\.v: a builtins\.set cannot"),
    (np.array([object()]), r"state\.v: a NumPy array of dtype object"),
    (np.zeros(2, dtype=[("a", "f4")]), r"state\.v: a NumPy array of dtype"),
    (_Unregistered(), r"state\.v: a .*_Unregistered is not a registered state type"),
    ({TAG: "ndarray"}, r"state\.v: the key '__fedloom__' is reserved"),
    ({1.5: 0}, r"state\.v: a dict key 1\.5"),
    ({(1, 2): 0}, r"state\.v: a dict key \(1, 2\)"),
    ([1, [2, lambda: 0]], r"state\.v\[1\]\[1\]: a builtins\.function"),
    (_Point(torch.ones(1), arr=np.array([None])), r"state\.v\.arr: a NumPy array of dtype"),
])
def test_values_that_could_not_be_read_back_safely_are_refused(value, match):
    with pytest.raises(PlainDataError, match=match):
        encode({"v": value})


def _array_record(**change):
    rec = encode(np.arange(4, dtype=np.float32))
    rec.update(change)
    return rec


@pytest.mark.parametrize("record, match", [
    ({TAG: "dataclass", "type": "os.system", "fields": {}}, r"'os\.system' is not registered"),
    ({TAG: "dataclass", "type": f"{__name__}._Unregistered", "fields": {}},
     r"_Unregistered' is not registered"),
    ({TAG: "dataclass", "type": f"{__name__}._Point", "fields": {"bogus": 1}},
     r"_Point that does not match its class"),
    ({TAG: "pickle"}, r"unknown encoding 'pickle'"),
    (_array_record(dtype="|O"), r"dtype object is never checkpointed"),
    (_array_record(shape=[5]), r"its bytes do not match"),
    (_array_record(shape=[-4]), r"its bytes do not match"),
    (_array_record(bytes=torch.zeros(16)), r"its bytes do not match"),
    (_array_record(dtype="not a dtype"), r"a damaged array"),
])
def test_damaged_or_unknown_encodings_are_refused(record, match):
    with pytest.raises(PlainDataError, match=match):
        decode({"v": record})


def test_state_type_takes_dataclasses_only():
    with pytest.raises(TypeError, match="not a dataclass"):
        state_type(int)


# ---------------------------------------------- every aggregator's state, as saved
D = 30
LAYOUT = Layout([("a.weight", (4, 5)), ("a.bias", (4,)), ("b.weight", (6,))],
                [["a.weight", "a.bias"], ["b.weight"]])


def _cohort(seed: int):
    gen = torch.Generator().manual_seed(seed)
    m = 6
    U = torch.randn(m, D, generator=gen, dtype=torch.float64)
    return (U,
            torch.randint(5, 50, (m,), generator=gen).double(),
            CohortInfo(clients=torch.arange(m), round=seed, num_clients=20,
                       losses=torch.rand(m, generator=gen, dtype=torch.float64) + 0.5,
                       steps=torch.randint(1, 10, (m,), generator=gen), lr=0.1, momentum=0.0,
                       start_losses=torch.rand(m, generator=gen, dtype=torch.float64) + 0.5,
                       reference=U.mean(0)))  # FLTrust's: some row has a positive cosine


@pytest.mark.parametrize("name", available("aggregator"))
def test_every_aggregators_state_is_checkpointed_and_steps_on_identically(name):
    """Two rounds, the state through a checkpoint's encoding, a third round: the same
    aggregate and state as without the checkpoint."""
    agg = make_aggregator(name)
    state = agg.init(LAYOUT)
    for r in range(2):
        U, n, info = _cohort(r)
        _, state, _ = agg(U, n, state, info=info)
    U, n, info = _cohort(2)
    a, sa, _ = agg(U, n, state, info=info)
    b, sb, _ = agg(U, n, _through_file(state), info=info)
    assert torch.equal(a, b)
    assert _same(_through_file(sa), _through_file(sb))
