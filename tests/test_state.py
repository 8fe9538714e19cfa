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
    # the digest: SHA-256 of the tag, the size and each non-zero 1 MB piece with its index
    raw = f.read_bytes()
    h = hashlib.sha256(b"fedloom-state-chunks-1" + len(raw).to_bytes(8, "little"))
    for c in range(0, len(raw), 1 << 20):
        if any(raw[c:c + (1 << 20)]):
            h.update((c >> 20).to_bytes(8, "little") + raw[c:c + (1 << 20)])
    assert snap == {"e": {"file": "state-e-r1.bin", "bytes": 64 * 100_000 * 4,
                          "chunks_sha256": h.hexdigest()}}
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


# ----------------------------------------------------- state at scale: holes stay holes
ROW = 300_000  # float32 entries: 1.2 MB a row, more than a 1 MB snapshot piece


def _holes_supported(d) -> bool:
    """Whether ``d``'s file system keeps holes and reports them (``SEEK_DATA``)."""
    import errno
    import os

    probe = d / ".probe"
    with open(probe, "wb") as f:
        f.truncate(4 << 20)
    try:
        fd = os.open(probe, os.O_RDONLY)
        try:
            os.lseek(fd, 0, os.SEEK_DATA)
            return False  # data where there is none: holes are not reported
        except OSError as e:
            return e.errno == errno.ENXIO and probe.stat().st_blocks == 0
        finally:
            os.close(fd)
    finally:
        probe.unlink()


@pytest.fixture
def holes(tmp_path):
    if not _holes_supported(tmp_path):
        pytest.skip("the file system of the temporary directory keeps no holes")
    return tmp_path


def _reads(monkeypatch):
    """Every ``(offset, length)`` a snapshot copy reads."""
    import fedloom.state as st

    seen: list[tuple[int, int]] = []
    real = st._pread

    def spy(fd, n, offset):
        seen.append((offset, n))
        return real(fd, n, offset)

    monkeypatch.setattr(st, "_pread", spy)
    return seen


def _in_rows(offset: int, n: int, rows: set[int], row_bytes: int) -> bool:
    """Whether ``[offset, offset + n)`` meets one of ``rows``."""
    return any(offset < (r + 1) * row_bytes and r * row_bytes < offset + n for r in rows)


def test_memmap_file_is_created_sparse_and_written_rows_only_cost_disk(holes):
    store = ClientStateStore(200, {"e": FieldSpec(ROW)}, storage="memmap", directory=holes)
    f = holes / "state-e.bin"
    assert f.stat().st_size == 200 * ROW * 4 and f.stat().st_blocks == 0  # no zero fill
    store.scatter("e", [7, 150], torch.ones(2, ROW))
    store.flush()
    used = f.stat().st_blocks * 512
    # two rows (plus at most one file-system block at each end of each row)
    assert 2 * ROW * 4 <= used <= 2 * ROW * 4 + 4 * 65536


def test_snapshot_and_restore_never_read_untouched_rows(holes, monkeypatch):
    """A checkpoint of a store whose other rows were never written reads only
    the pieces that meet written rows, writes a file as sparse, and a restore
    reads only those pieces of the snapshot; the rows read back are right."""
    n, written = 200, {3, 4, 120}
    rb = ROW * 4
    store = ClientStateStore(n, {"e": FieldSpec(ROW)}, storage="memmap", directory=holes / "live")
    rows = torch.randn(3, ROW, generator=torch.Generator().manual_seed(0))
    store.scatter("e", sorted(written), rows)
    seen = _reads(monkeypatch)
    snap = store.state_dict(holes / "ckpt", tag="r1")
    assert seen and all(_in_rows(o, k, written, rb) for o, k in seen)
    # at most the written rows plus one partial piece at each end of each run of rows
    assert sum(k for _, k in seen) <= len(written) * rb + 4 * (1 << 20)
    f = holes / "ckpt" / "state-e-r1.bin"
    assert f.stat().st_blocks * 512 <= len(written) * rb + 4 * 65536  # 64 KB parts
    seen.clear()
    store.scatter("e", [3], torch.zeros(1, ROW))
    store.load_state_dict(snap, holes / "ckpt")
    assert seen and all(_in_rows(o, k, written, rb) for o, k in seen)
    assert torch.equal(store.gather("e", sorted(written)), rows)
    assert torch.equal(store.gather("e", [0, 199]), torch.zeros(2, ROW))
    live = holes / "live" / "state-e.bin"
    assert live.stat().st_blocks * 512 <= len(written) * rb + 4 * 65536


def test_snapshot_digest_is_of_the_content_not_of_the_holes(holes):
    """The same bytes with written zeros instead of holes have the same digest
    (a file system may fill holes); one changed byte in a row never written is
    damage, found on restore."""
    from fedloom.state import _bytes_chunks, _chunk_digest

    store = ClientStateStore(20, {"e": FieldSpec(ROW)}, storage="memmap", directory=holes / "a")
    store.scatter("e", [5], torch.full((1, ROW), 2.0))
    snap = store.state_dict(holes / "ckpt", tag="r1")
    f = holes / "ckpt" / "state-e-r1.bin"
    raw = f.read_bytes()
    assert _chunk_digest(len(raw), _bytes_chunks(raw)) == snap["e"]["chunks_sha256"]
    dense = holes / "ckpt" / "dense.bin"
    dense.write_bytes(raw)  # every byte written: no holes
    other = ClientStateStore(20, {"e": FieldSpec(ROW)}, storage="memmap",
                             directory=holes / "b")
    other.load_state_dict({"e": {**snap["e"], "file": "dense.bin"}}, holes / "ckpt")
    assert torch.equal(other.gather("e", [5]), torch.full((1, ROW), 2.0))
    b = bytearray(raw)
    b[15 * ROW * 4 + 11] = 1  # in client 15's row, which was never written
    f.write_bytes(bytes(b))
    for storage in ("memmap", "dense"):
        s = ClientStateStore(20, {"e": FieldSpec(ROW)}, storage=storage,
                             directory=holes / storage)
        with pytest.raises(ValueError, match=r"state-e-r1\.bin: state snapshot damaged"):
            s.load_state_dict(snap, holes / "ckpt")
        assert torch.equal(s.gather("e", [15]), torch.zeros(1, ROW))  # not loaded


def test_snapshot_of_the_earlier_format_whole_file_sha256_still_loads(tmp_path):
    store = ClientStateStore(4, {"e": FieldSpec(10)}, storage="memmap", directory=tmp_path / "l")
    store.scatter("e", [2], torch.arange(10.0)[None])
    snap = store.state_dict(tmp_path / "ckpt", tag="r1")
    f = tmp_path / "ckpt" / "state-e-r1.bin"
    old = {"e": {"file": f.name, "bytes": snap["e"]["bytes"],
                 "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}}
    for storage in ("memmap", "dense"):
        s = ClientStateStore(4, {"e": FieldSpec(10)}, storage=storage,
                             directory=tmp_path / storage)
        s.load_state_dict(old, tmp_path / "ckpt")
        assert torch.equal(s.gather("e", [2]), torch.arange(10.0)[None])
    f.write_bytes(f.read_bytes()[:-1] + b"\x01")
    with pytest.raises(ValueError, match="state snapshot damaged"):
        ClientStateStore(4, {"e": FieldSpec(10)}, storage="memmap",
                         directory=tmp_path / "x").load_state_dict(old, tmp_path / "ckpt")


def test_ef_run_with_checkpoints_reads_and_stores_only_sampled_clients_rows(holes, monkeypatch):
    """A memmap EF run of 100 clients (2 a round, a checkpoint every round): the
    snapshot copies read only the rows of clients that were sampled, and the
    live file and every snapshot hold no more disk than those rows."""
    import fedloom
    import fedloom.state as st
    from conftest import TINY

    written: set[int] = set()
    real_set = st._RowFile.set

    def record(self, idx, rows):
        written.update(idx.tolist())
        return real_set(self, idx, rows)

    monkeypatch.setattr(st._RowFile, "set", record)
    seen = _reads(monkeypatch)
    over = ["data.num_clients=100", "data.partition=iid", "model.options.hidden=[4096]",
            "cohort.size=2", "rounds=3", "compression.name=topk",
            "compression.options.ratio=0.01", "compression.feedback=ef",
            "state.storage=memmap", "eval.every=3"]
    res = fedloom.run(TINY, over, out=holes / "run")
    d = res.summary["num_parameters"]
    rb = d * 4
    assert rb > 1 << 20 and 2 <= len(written) <= 6
    assert seen and all(_in_rows(o, k, written, rb) for o, k in seen)
    files = [holes / "run" / "state" / "state-fb.residual.bin",
             *(holes / "run" / "checkpoints").glob("state-*.bin")]
    assert len(files) == 3  # the live file, the snapshots of last.pt and prev.pt
    for f in files:
        assert f.stat().st_size == 100 * rb
        assert f.stat().st_blocks * 512 <= len(written) * rb + 2 * len(written) * 65536, f
