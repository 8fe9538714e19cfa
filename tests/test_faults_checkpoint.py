"""Fault matrix of the run directory: damaged checkpoints, state snapshots,
config and metrics files, a kill during a checkpoint write, two runs on one
directory.

Every damage either falls back to the intact ``prev.pt`` (same ``model_sha256``
and metrics as an uninterrupted run, one warning naming both files) or ends
with exit status 2 and one line naming the damaged file — never a traceback,
never a resume to a different model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import fedloom
from conftest import TINY
from fedloom import cli
from fedloom.engine.runs.checkpoint import load_checkpoint, save_checkpoint

DENSE = ["rounds=3", "checkpoint.every=1"]
MEMMAP = [*DENSE, "compression.name=topk", "compression.options.ratio=0.1",
          "compression.feedback=ef", "state.storage=memmap"]


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    # curves.png is not what these tests check, and matplotlib's layout is most of
    # a finished resume's time here.
    monkeypatch.setattr("fedloom.report.plots.write_run_plots", lambda *a, **k: None)


def _stopped_run(root: Path, ov: list[str]) -> tuple[Path, str, list[dict]]:
    """A run stopped after round 2 of 3 (so ``last.pt`` is round 2, ``prev.pt``
    round 1), and the uninterrupted run's ``model_sha256`` and metrics."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    ref = fedloom.run(TINY, ov)

    def stop(st, m):
        if st.next_round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fedloom.run(TINY, ov, out=root / "run", callbacks=[stop])
    return root / "run", ref.summary["model_sha256"], ref.metrics


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return _stopped_run(tmp_path_factory.mktemp("dense"), DENSE)


@pytest.fixture(scope="module")
def memmap(tmp_path_factory):
    return _stopped_run(tmp_path_factory.mktemp("memmap"), MEMMAP)


def _copy(base: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(base, out, symlinks=True)
    shutil.copy(base.with_name("tiny.yaml"), tmp_path / "tiny.yaml")
    return out


def _resume(out: Path, ov: list[str], capsys, *extra: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = cli.main(["run", str(out.with_name("tiny.yaml")), *ov, "--out", str(out), "--quiet",
                   "--resume", *extra])
    return rc, [x for x in capsys.readouterr().err.splitlines() if x.strip()]


def _stable(ms: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.endswith("_s")} for m in ms]


def _summary_sha(out: Path) -> str:
    return json.loads((out / "summary.json").read_text())["model_sha256"]


# ----------------------------------------------------------------- damage kinds
def _w_bytes(path: Path) -> bytes:
    return load_checkpoint(path)["w"].numpy().tobytes()


def _flip_tensor(p: Path) -> None:
    """Flip one bit in the middle of the model tensor's data record."""
    w = _w_bytes(p)
    b = bytearray(p.read_bytes())
    i = b.find(w)
    assert i >= 0
    b[i + len(w) // 2] ^= 0x10
    p.write_bytes(bytes(b))


def _resave(p: Path, change) -> None:
    st = load_checkpoint(p)
    change(st)
    save_checkpoint(p, st)  # a file with a valid digest: the content checks must catch it


def _to_dir(p: Path) -> None:
    p.unlink()
    p.mkdir()


def _dangling(p: Path) -> None:
    p.unlink()
    p.symlink_to(p.with_name("nowhere"))


CKPT_DAMAGE = {
    "truncated_to_0": lambda p: p.write_bytes(b""),
    "truncated_half": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "flipped_tensor_byte": _flip_tensor,
    "garbage": lambda p: p.write_bytes(bytes((7 * i + 3) % 256 for i in range(p.stat().st_size))),
    "text": lambda p: p.write_text("not a checkpoint\n"),
    "directory": _to_dir,
    "dangling_link": _dangling,
    "missing_key_store": lambda p: _resave(p, lambda st: st.pop("store")),
    "w_wrong_shape": lambda p: _resave(p, lambda st: st.update(w=st["w"][:-3])),
    "other_config": lambda p: _resave(p, lambda st: st.update(
        config={**st["config"], "seed": 99})),
}


@pytest.mark.parametrize("kind", sorted(CKPT_DAMAGE))
def test_damaged_checkpoints_exit_2_with_one_line(dense, tmp_path, capsys, caplog, kind):
    """last.pt and prev.pt both damaged: nothing to fall back on, so exit 2 and
    one line naming both files; nothing of the run is changed."""
    base, _, _ = dense
    out = _copy(base, tmp_path)
    for p in (out / "checkpoints").glob("*.pt"):
        CKPT_DAMAGE[kind](p)
    before = (out / "metrics.jsonl").read_bytes()
    rc, err = _resume(out, DENSE, capsys)
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("fedloom: error: "), err
    assert "last.pt: " in err[0]
    assert "prev.pt: " in err[0] and "no intact checkpoint" in err[0]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert (out / "metrics.jsonl").read_bytes() == before
    assert not (out / "summary.json").exists()


@pytest.mark.parametrize("kind", ["truncated_to_0", "flipped_tensor_byte", "directory",
                                  "missing_key_store"])
def test_damaged_last_falls_back_to_prev_with_the_uninterrupted_result(
        dense, tmp_path, capsys, caplog, kind):
    base, ref_sha, ref_metrics = dense
    out = _copy(base, tmp_path)
    CKPT_DAMAGE[kind](out / "checkpoints" / "last.pt")
    caplog.set_level(logging.WARNING, logger="fedloom")
    rc, err = _resume(out, DENSE, capsys)
    assert rc == 0, err
    assert _summary_sha(out) == ref_sha
    got = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert _stable(got) == _stable(ref_metrics)
    warn = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warn) == 1 and "\n" not in warn[0], warn
    assert "last.pt" in warn[0] and "resumed from" in warn[0] and "prev.pt (round 1)" in warn[0]
    assert (out / "checkpoints" / "last.pt.damaged").exists()
    # the rotation goes on from the intact files: a later resume needs no fallback
    caplog.clear()
    rc, err = _resume(out, DENSE, capsys)
    assert rc == 0 and _summary_sha(out) == ref_sha
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_flipped_byte_inside_a_tensor_record_is_caught(dense, tmp_path):
    from fedloom.engine.runs.checkpoint import CheckpointError

    p = tmp_path / "last.pt"
    shutil.copy(dense[0] / "checkpoints" / "last.pt", p)
    w = load_checkpoint(p)["w"]
    _flip_tensor(p)
    with pytest.raises(CheckpointError, match=r"last\.pt: content does not match its SHA-256"):
        load_checkpoint(p)
    # the digest covers the header's claims too: a restored byte loads again
    b = bytearray(p.read_bytes())
    b[b.find(w.numpy().tobytes()[:16]) + len(w.numpy().tobytes()) // 2] ^= 0x10
    p.write_bytes(bytes(b))
    assert torch.equal(load_checkpoint(p)["w"], w)


def test_checkpoint_without_digest_loads_with_a_warning(dense, tmp_path, caplog):
    """A checkpoint written before the digest existed (a bare torch.save file)."""
    st = load_checkpoint(dense[0] / "checkpoints" / "last.pt")
    p = tmp_path / "old.pt"
    torch.save(st, p)
    caplog.set_level(logging.WARNING, logger="fedloom")
    assert torch.equal(load_checkpoint(p)["w"], st["w"])
    assert any("without a digest" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------- larger than the memory left
def _sparse_checkpoint(p: Path, size: int) -> None:
    """``p``: a sparse file of ``size`` bytes whose header says it holds that many
    (a hole for its content: only the header is written)."""
    head = f"fedloom-checkpoint 3 sha256={'0' * 64} bytes={{}}\n"
    head = head.format(size - len(head.format(size)))
    assert len(head) + int(head.split("bytes=")[1]) == size
    p.unlink()
    with open(p, "wb") as f:
        f.write(head.encode())
        f.truncate(size)


def _fell_back(out: Path, ref_sha: str, warn: str) -> None:
    assert _summary_sha(out) == ref_sha
    assert "\n" not in warn and "Traceback" not in warn, warn
    assert "resumed from" in warn and "prev.pt (round 1)" in warn, warn
    assert (out / "checkpoints" / "last.pt.damaged").exists()


def test_a_checkpoint_larger_than_the_memory_left_is_refused_unread(
        dense, tmp_path, capsys, caplog, monkeypatch):
    """A last.pt of 1 GiB (sparse, its header matching its size) whose load needs
    twice that, with 512 MiB said to be available: refused before its content is
    read, and the resume goes on from prev.pt with one warning naming it."""
    from fedloom.engine.runs import checkpoint

    base, ref_sha, _ = dense
    out = _copy(base, tmp_path)
    _sparse_checkpoint(out / "checkpoints" / "last.pt", 2**30)
    monkeypatch.setattr(checkpoint, "available_memory", lambda: 512 * 2**20)
    read = checkpoint._read_fd

    def small_reads(fd: int, n: int) -> bytes:
        assert n < 2**20, "read a checkpoint that cannot fit in the memory left"
        return read(fd, n)

    monkeypatch.setattr(checkpoint, "_read_fd", small_reads)
    caplog.set_level(logging.WARNING, logger="fedloom")
    rc, err = _resume(out, DENSE, capsys)
    assert rc == 0, err
    warn = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warn) == 1, warn
    assert (f"last.pt: {2**30} bytes: loading it takes about 2.2 GB of memory and 537 MB "
            "is available; refused unread") in warn[0], warn
    _fell_back(out, ref_sha, warn[0])


def test_running_out_of_memory_while_loading_is_damage(dense, tmp_path, capsys, caplog,
                                                       monkeypatch):
    """A MemoryError while last.pt is read or decoded (the memory left was less than
    the check was told): the resume goes on from prev.pt, one warning."""
    from fedloom.engine.runs import checkpoint

    base, ref_sha, _ = dense
    out = _copy(base, tmp_path)
    payload = checkpoint._payload

    def oom_for_last(path: Path, data: bytes):
        if path.name == "last.pt":
            raise MemoryError
        return payload(path, data)

    monkeypatch.setattr(checkpoint, "_payload", oom_for_last)
    caplog.set_level(logging.WARNING, logger="fedloom")
    rc, err = _resume(out, DENSE, capsys)
    assert rc == 0, err
    warn = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warn) == 1 and "last.pt: ran out of memory while loading it" in warn[0], warn
    _fell_back(out, ref_sha, warn[0])


def test_a_4_gib_checkpoint_under_a_3_gib_address_space_limit(dense, tmp_path):
    """The issue's case, in a process limited to 3 GiB of address space (``prlimit
    --as``): a 4 GiB last.pt whose header matches its size is refused unread by what
    the system says is left, not read until a MemoryError; prev.pt is resumed."""
    import resource

    base, ref_sha, _ = dense
    out = _copy(base, tmp_path)
    _sparse_checkpoint(out / "checkpoints" / "last.pt", 4 * 2**30)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, 3 * 2**30))

    # the same thread count as the in-process reference run (float32 reductions)
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    p = subprocess.run([sys.executable, "-m", "fedloom.cli", "run",
                        str(out.with_name("tiny.yaml")), *DENSE, "--out", str(out), "--quiet",
                        "--resume"], capture_output=True, text=True, timeout=300, env=env,
                       preexec_fn=limit)
    assert p.returncode == 0, p.stderr[-3000:]
    warn = [x for x in p.stderr.splitlines() if "last.pt" in x]
    assert len(warn) == 1, p.stderr[-3000:]
    assert f"last.pt: {4 * 2**30} bytes: loading it takes about 8.7 GB of memory" in warn[0]
    _fell_back(out, ref_sha, warn[0])


# ------------------------------------------------------------- state snapshots
def _cohort_rows_flip(p: Path) -> None:
    """Flip an exponent bit in the residual row of a client trained in round 3,
    so the damage would change the model if it were loaded."""
    from fedloom.rng import Purpose, numpy_gen

    cohort = numpy_gen(TINY["seed"], 2, -1, Purpose.COHORT).choice(10, 4, replace=False)
    b = bytearray(p.read_bytes())
    row = len(b) // 10
    i = next(i for k in sorted(cohort.tolist()) for i in range(k * row, (k + 1) * row) if b[i])
    b[i] ^= 0x40
    p.write_bytes(bytes(b))


SNAP_DAMAGE = {
    "flipped_byte": _cohort_rows_flip,
    "garbage": lambda p: p.write_bytes(bytes((11 * i + 5) % 256 for i in range(p.stat().st_size))),
}


@pytest.mark.parametrize("kind", sorted(SNAP_DAMAGE))
def test_damaged_state_snapshots_exit_2(memmap, tmp_path, capsys, kind):
    base, _, _ = memmap
    out = _copy(base, tmp_path)
    for p in (out / "checkpoints").glob("state-*.bin"):  # those of last.pt and prev.pt
        SNAP_DAMAGE[kind](p)
    rc, err = _resume(out, MEMMAP, capsys)
    assert rc == 2 and len(err) == 1, err
    assert "state-fb.residual-r2.bin: state snapshot damaged" in err[0]
    assert "state-fb.residual-r1.bin: state snapshot damaged" in err[0]


@pytest.mark.parametrize("kind", ["flipped_byte", "truncated", "directory"])
def test_damaged_last_snapshot_falls_back_to_prev(memmap, tmp_path, capsys, caplog, kind):
    base, ref_sha, _ = memmap
    out = _copy(base, tmp_path)
    p = out / "checkpoints" / "state-fb.residual-r2.bin"
    {"flipped_byte": _cohort_rows_flip,
     "truncated": lambda p: p.write_bytes(p.read_bytes()[:100]),
     "directory": _to_dir}[kind](p)
    caplog.set_level(logging.WARNING, logger="fedloom")
    rc, err = _resume(out, MEMMAP, capsys)
    assert rc == 0, err
    assert _summary_sha(out) == ref_sha
    warn = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warn) == 1 and "state-fb.residual-r2.bin" in warn[0] and "prev.pt" in warn[0]


# --------------------------------------------------------- config and metrics
CONFIG_DAMAGE = {
    "latin1": lambda p: p.write_bytes(p.read_bytes() + "# caf\xe9\n".encode("latin-1")),
    "yaml_error": lambda p: p.write_text("rounds: [1,\n"),
    "directory": _to_dir,
}


@pytest.mark.parametrize("kind", sorted(CONFIG_DAMAGE))
def test_damaged_config_yaml_exit_2_naming_it(dense, tmp_path, capsys, kind):
    out = _copy(dense[0], tmp_path)
    CONFIG_DAMAGE[kind](out / "config.yaml")
    rc, err = _resume(out, DENSE, capsys)
    assert rc == 2 and len(err) == 1, err
    assert "config.yaml: " in err[0]


def _lines(p: Path) -> list[str]:
    return p.read_text().splitlines()


def _write(p: Path, lines: list[str]) -> None:
    p.write_text("".join(x + "\n" for x in lines))


def _shift_totals(p: Path) -> None:
    ms = [json.loads(x) for x in _lines(p)]
    for m in ms:
        m["uplink_bytes_total"] += 1
    _write(p, [json.dumps(m) for m in ms])


METRICS_DAMAGE = {
    # the checkpoint is at round 2: rounds 1-2 must be there
    "garbage_lines": (lambda p: _write(p, ["garbage{", "\x01junk", *_lines(p)[2:]]),
                      "rounds 1–2 before the checkpoint's round 2 are missing"),
    "round_missing": (lambda p: _write(p, _lines(p)[1:]), "rounds 1 before"),
    "round_twice": (lambda p: _write(p, [_lines(p)[0], *_lines(p)]), "round 1 appears twice"),
    "not_utf8": (lambda p: p.write_bytes(b"\xff\xfe" + p.read_bytes()), "rounds 1 before"),
    "other_run": (_shift_totals, "not this run's"),
    # lines json.loads cannot hold: nesting past the recursion limit, an integer past
    # the int-parsing limit (a ValueError, not a JSONDecodeError)
    "deep_json": (lambda p: _write(p, ["[" * 100_000 + "]" * 100_000, *_lines(p)[1:]]),
                  "rounds 1 before"),
    "huge_integer": (lambda p: _write(p, ['{"round": ' + "9" * 5000 + "}", *_lines(p)[1:]]),
                     "rounds 1 before"),
    "deleted": (lambda p: p.unlink(), "missing, but the checkpoint is at round 2"),
    "directory": (_to_dir, "is a directory"),
}


@pytest.mark.parametrize("kind", sorted(METRICS_DAMAGE))
def test_damaged_metrics_exit_2_naming_it(dense, tmp_path, capsys, kind):
    out = _copy(dense[0], tmp_path)
    damage, what = METRICS_DAMAGE[kind]
    damage(out / "metrics.jsonl")
    rc, err = _resume(out, DENSE, capsys)
    assert rc == 2 and len(err) == 1, err
    assert "metrics.jsonl: " in err[0] and what in err[0], err


def test_metrics_repaired_when_the_rounds_are_intact(dense, tmp_path, capsys, caplog):
    """A damaged line among intact rounds 1–2 and a torn last line (what a kill
    leaves) are dropped, with one warning naming them; nothing of rounds 1–3 is
    lost."""
    base, ref_sha, ref_metrics = dense
    out = _copy(base, tmp_path)
    p = out / "metrics.jsonl"
    _write(p, [_lines(p)[0], "not json", *_lines(p)[1:]])
    p.write_text(p.read_text() + '{"round": 3, "lr"')  # torn: line 4
    caplog.set_level(logging.WARNING, logger="fedloom")
    rc, err = _resume(out, DENSE, capsys)
    assert rc == 0, err
    got = [json.loads(x) for x in _lines(p)]
    assert _stable(got) == _stable(ref_metrics) and _summary_sha(out) == ref_sha
    warn = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warn) == 1 and "metrics.jsonl: dropped 2 damaged lines (2, 4)" in warn[0], warn


def test_checkpoints_folder_that_is_a_file_exit_2(dense, tmp_path, capsys):
    out = _copy(dense[0], tmp_path)
    shutil.rmtree(out / "checkpoints")
    (out / "checkpoints").write_text("x")
    rc, err = _resume(out, DENSE, capsys)
    assert rc == 2 and len(err) == 1 and "checkpoints: is not a directory" in err[0], err


# ---------------------------------------------------- kill, lock, leftovers
_HOLDER = r"""
import os, signal, sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from conftest import TINY
import fedloom
import fedloom.engine.runs.checkpoint as ck

real, seen = os.replace, []

def replace(src, dst, *a, **k):
    # The second checkpoint write: its temporary file is complete; stop here, as a
    # kill would, after telling the test (which then kills this process).
    if Path(src).name.startswith(".last.pt."):
        seen.append(src)
        if len(seen) == 2:
            Path({ready!r}).write_text(str(os.getpid()))
            time.sleep(3600)  # killed by the test: outlasts its checks on a loaded machine
    return real(src, dst, *a, **k)

ck.os.replace = replace
fedloom.run(TINY, {ov!r}, out={out!r})
"""


def test_kill_during_checkpoint_write_lock_and_leftovers(dense, tmp_path, capsys):
    """A run stopped in the middle of its second checkpoint write (its
    ``.last.pt.*.tmp`` complete, not renamed) holds the directory: a second run
    on it, new or ``--resume``, exits 2 naming its pid. Killed there (SIGKILL),
    it leaves the temporary file and its lock file; ``--resume`` then removes
    the former, is not blocked by the latter and ends with the uninterrupted
    run's model."""
    _, ref_sha, _ = dense
    out, ready = tmp_path / "run", tmp_path / "ready"
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    code = _HOLDER.format(tests=str(Path(__file__).parent), ready=str(ready), ov=DENSE,
                          out=str(out))
    # the holder computes rounds 1–2 and this process the rest: the same thread count,
    # or float32 reductions round differently from the in-process reference run
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        while not ready.exists():  # no timing assumed: wait for the holder to say so
            if proc.poll() is not None:
                pytest.fail(f"holder ended early: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        pid = proc.pid
        assert list((out / "checkpoints").glob(".last.pt.*.tmp"))
        for extra in ((), ("--resume",)):
            capsys.readouterr()
            rc = cli.main(["run", str(tmp_path / "tiny.yaml"), *DENSE, "--out", str(out),
                           "--quiet", *extra])
            err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
            assert rc == 2 and len(err) == 1, err
            assert f"in use by another fedloom run (pid {pid})" in err[0]
        assert out.is_dir() and (out / "checkpoints" / "last.pt").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    left = list((out / "checkpoints").glob(".last.pt.*.tmp"))
    assert left and (out / ".lock").read_text().strip() == str(pid)
    rc, err = _resume(out, DENSE, capsys)
    assert rc == 0, err
    assert not list(out.rglob("*.tmp"))
    assert _summary_sha(out) == ref_sha
    assert (out / ".lock").read_text().strip() == str(os.getpid())


def test_state_directory_replaced_by_a_file_is_one_line_exit_2(memmap, tmp_path, capsys):
    """RUN/state (the memory-mapped client state) turned into a regular file: one line
    naming it, exit 2, no traceback."""
    base, _, _ = memmap
    out = _copy(base, tmp_path)
    shutil.rmtree(out / "state")
    (out / "state").write_text("not a directory")
    rc, err = _resume(out, MEMMAP, capsys)
    assert rc == 2 and len(err) == 1, err
    assert "state" in err[0] and "not a directory" in err[0]


# ------------------------------------------------- a checkpoint that runs code
class _Payload:
    """A pickled object whose unpickling creates ``marker``: what an attacker puts
    into a checkpoint (``__reduce__`` names any function for the reader to call)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def _with_header(payload: bytes, version: int) -> bytes:
    import hashlib

    return (f"fedloom-checkpoint {version} sha256={hashlib.sha256(payload).hexdigest()} "
            f"bytes={len(payload)}\n").encode() + payload


def _pickled(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _evil_files(marker: Path) -> dict[str, bytes]:
    """The payload as a bare torch.save file and behind a correct digest in every
    format this fedloom reads."""
    raw = _pickled({"format": 1, "w": _Payload(marker)})
    return {"bare": raw, "format2": _with_header(raw, 2), "format3": _with_header(raw, 3)}


@pytest.mark.parametrize("kind", ["bare", "format2", "format3"])
def test_a_checkpoint_that_would_run_code_is_refused_unread(tmp_path, kind):
    from fedloom.engine.runs.checkpoint import CheckpointError

    marker = tmp_path / "pwned"
    p = tmp_path / "last.pt"
    p.write_bytes(_evil_files(marker)[kind])
    with pytest.raises(CheckpointError, match=r"last\.pt: names posix\.mkdir.*refused unread"):
        load_checkpoint(p)
    assert not marker.exists()


def test_resume_never_runs_a_checkpoints_code(dense, tmp_path, capsys):
    """Both checkpoints replaced by the payload (a correct digest on each): exit 2
    naming both files, and the payload never ran."""
    base, _, _ = dense
    out = _copy(base, tmp_path)
    marker = tmp_path / "pwned"
    files = _evil_files(marker)
    (out / "checkpoints" / "last.pt").write_bytes(files["format3"])
    (out / "checkpoints" / "prev.pt").write_bytes(files["format2"])
    rc, err = _resume(out, DENSE, capsys)
    assert rc == 2 and len(err) == 1, err
    assert "last.pt: names posix.mkdir" in err[0] and "prev.pt: names posix.mkdir" in err[0]
    assert not marker.exists()


def test_a_runs_own_checkpoint_with_one_extra_key_is_refused(dense, tmp_path, capsys, caplog):
    """The run's own last.pt with a payload under one extra key, re-saved with a
    correct digest: refused (resumed from prev.pt, with the uninterrupted result)."""
    base, ref_sha, _ = dense
    out = _copy(base, tmp_path)
    marker = tmp_path / "pwned"
    last = out / "checkpoints" / "last.pt"
    st = load_checkpoint(last)
    from fedloom.plain import encode

    plain = encode(st)
    plain["extra"] = _Payload(marker)
    last.write_bytes(_with_header(_pickled(plain), 3))
    caplog.set_level(logging.WARNING, logger="fedloom")
    rc, err = _resume(out, DENSE, capsys)
    assert rc == 0, err
    assert not marker.exists()
    assert _summary_sha(out) == ref_sha
    warn = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("last.pt: names posix.mkdir" in w for w in warn), warn


def test_a_sweep_never_runs_a_checkpoints_code(tmp_path, monkeypatch):
    """A sweep resumes every run folder without summary.json on its own: one with a
    payload in its checkpoints fails that run, and the payload never runs."""
    from conftest import cli_in_process
    from fedloom.sweep import run_suite

    monkeypatch.setattr("fedloom.sweep.running.RUNNER", "subprocess")
    monkeypatch.setattr("fedloom.sweep.running.subprocess.run", cli_in_process)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "rounds": 2}))
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({
        "name": "t", "out": str(tmp_path / "runs"), "seeds": [1],
        "settings": {"digits": {"config": str(cfg)}}, "methods": {"FedAvg": []}}))
    run_suite(suite, workers=1, log=lambda s: None)
    (run,) = [p.parent for p in (tmp_path / "runs").rglob("summary.json")]
    (run / "summary.json").unlink()  # as a run killed before its end leaves it
    marker = tmp_path / "pwned"
    for name, data in zip(("last.pt", "prev.pt"), _evil_files(marker).values(), strict=False):
        (run / "checkpoints" / name).write_bytes(data)
    from fedloom.sweep import SweepError

    with pytest.raises(SweepError, match=r"seed1/checkpoints/last\.pt: names posix\.mkdir"):
        run_suite(suite, workers=1, log=lambda s: None)
    assert not marker.exists()
    assert not (run / "summary.json").exists()


# ------------------------------------------------ format 2 (pickled NumPy arrays)
CRAFT_EF = [*DENSE, "aggregator.name=craft", "compression.name=topk",
            "compression.options.ratio=0.1", "compression.feedback=ef"]


@pytest.fixture(scope="module")
def craft_ef(tmp_path_factory):
    return _stopped_run(tmp_path_factory.mktemp("craft_ef"), CRAFT_EF)


def test_format_2_checkpoints_resume_to_the_uninterrupted_model(craft_ef, tmp_path, capsys):
    """A checkpoint as the previous format wrote it (NumPy arrays and CRAFT's state
    pickled as such, behind a format-2 header) is read by the restricted loader
    and resumes to the uninterrupted run's model; the next one is format 3."""
    import numpy as np

    from fedloom.aggregate.craft import CraftState

    base, ref_sha, ref_metrics = craft_ef
    out = _copy(base, tmp_path)
    for name in ("last.pt", "prev.pt"):
        p = out / "checkpoints" / name
        st = load_checkpoint(p)
        # the state this run holds: the kinds format 2 pickled directly
        assert isinstance(st["agg_state"], CraftState)
        assert any(isinstance(v, np.ndarray) for v in _leaves(st["store"]))
        p.write_bytes(_with_header(_pickled(st), 2))
    rc, err = _resume(out, CRAFT_EF, capsys)
    assert rc == 0, err
    assert _summary_sha(out) == ref_sha
    got = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert _stable(got) == _stable(ref_metrics)
    assert (out / "checkpoints" / "last.pt").read_bytes().startswith(b"fedloom-checkpoint 3 ")


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    else:
        yield obj


def test_a_state_that_cannot_be_checkpointed_writes_nothing(tmp_path):
    from fedloom.engine.runs.checkpoint import CheckpointError

    p = tmp_path / "last.pt"
    p.write_bytes(b"old")
    with pytest.raises(CheckpointError, match=r"last\.pt: not written: checkpoint\.agg_state: a "
                                              r".*_Payload cannot be checkpointed"):
        save_checkpoint(p, {"format": 1, "agg_state": _Payload(tmp_path / "x")})
    assert p.read_bytes() == b"old" and not list(tmp_path.glob(".*.tmp"))
