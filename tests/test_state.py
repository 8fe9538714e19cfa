import hashlib

import numpy as np
import pytest
import torch

from fedloom import ClientStateStore, FieldSpec


@pytest.mark.parametrize("storage", ["dense", "memmap"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_store_gather_scatter_zero_default_and_untouched_rows(tmp_path, storage, dtype):
    store = ClientStateStore(6, {"e": FieldSpec(5)}, storage=storage, dtype=dtype,
                             directory=tmp_path)
    assert store.kinds["e"] == storage
    assert torch.equal(store.gather("e", [0, 5]), torch.zeros(2, 5))
    rows = torch.tensor([[1.0, 2, 3, 4, 5], [-1, -2, -3, -4, -0.5]])
    store.scatter("e", [1, 3], rows)
    assert torch.equal(store.gather("e", [3, 1]), rows.flip(0))
    assert torch.equal(store.gather("e", [0, 2, 4, 5]), torch.zeros(4, 5))
    snap = store.state_dict()
    store.scatter("e", [1], torch.full((1, 5), 9.0))
    store.load_state_dict(snap)
    assert torch.equal(store.gather("e", [1]), rows[:1])


def test_store_auto_picks_memmap_above_threshold(tmp_path):
    store = ClientStateStore(1000, {"big": FieldSpec(1000), "small": FieldSpec(1)},
                             storage="auto", memmap_above_mb=1.0, directory=tmp_path)
    assert store.kinds == {"big": "memmap", "small": "dense"}
    assert (tmp_path / "state-big.bin").exists()


def test_store_fp16_rounds_and_errors():
    store = ClientStateStore(2, {"e": FieldSpec(2)}, storage="dense", dtype="float16")
    store.scatter("e", [0], torch.tensor([[1 / 3, 1000.1]]))
    got = store.gather("e", [0])
    assert got.dtype == torch.float32
    assert np.allclose(got.numpy(), [[1 / 3, 1000.1]], rtol=1e-3)
    with pytest.raises(IndexError):
        store.gather("e", [2])
    with pytest.raises(KeyError):
        store.gather("x", [0])
    with pytest.raises(ValueError, match="shape"):
        store.scatter("e", [0, 1], torch.zeros(1, 2))


def test_memmap_snapshot_files_are_sparse_and_restore(tmp_path):
    store = ClientStateStore(64, {"e": FieldSpec(100_000)}, storage="memmap",
                             directory=tmp_path / "live")
    rows = torch.randn(2, 100_000)
    store.scatter("e", [3, 60], rows)
    snap = store.state_dict(tmp_path / "ckpt", tag="r1")
    f = tmp_path / "ckpt" / "state-e-r1.bin"
    assert snap == {"e": {"file": "state-e-r1.bin", "bytes": 64 * 100_000 * 4,
                          "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}}
    assert f.stat().st_size == 64 * 100_000 * 4
    assert f.stat().st_blocks * 512 < f.stat().st_size / 4  # the untouched rows are holes
    store.scatter("e", [3], torch.zeros(1, 100_000))
    store.load_state_dict(snap, tmp_path / "ckpt")
    assert torch.equal(store.gather("e", [3, 60]), rows)
    assert torch.equal(store.gather("e", [0, 63]), torch.zeros(2, 100_000))
    with pytest.raises(ValueError, match="snapshot missing"):
        store.load_state_dict({"e": {"file": "nope.bin"}}, tmp_path / "ckpt")


def test_memmap_store_survives_a_resume(tmp_path):
    """An EF run with memmap state, stopped after round 2 and resumed, gives the
    uninterrupted run's bits; only the snapshot files of the two checkpoints kept
    (last.pt and prev.pt) remain."""
    from conftest import TINY, stop_and_resume

    over = ["compression.name=topk", "compression.options.ratio=0.1",
            "compression.feedback=ef", "state.storage=memmap", "rounds=4"]
    ref, res = stop_and_resume(TINY, over, tmp_path / "run")
    assert res.summary["model_sha256"] == ref.summary["model_sha256"]
    snaps = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("state-*.bin"))
    assert snaps == ["state-fb.residual-r3.bin", "state-fb.residual-r4.bin"]
