"""Faults of the run directory itself: an ``--out`` that is not a run directory
(a link to ``/``), checkpoint, config and metrics files that are links to
special files, metrics copied from another run or cut in the middle of a line,
and a full disk.

A directory fedloom did not make a run directory of is never written to (no
lock file, no probe, its mtime unchanged); a file that is not a regular one is
never read; metrics rows are checked against the checkpoint they continue from;
a full disk ends the run with one line naming the file and exit 2, and
``--resume`` then continues it to the uninterrupted run's model.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import fedloom
from conftest import TINY
from fedloom import cli
from fedloom.engine.runs.checkpoint import MARKER_FILE

DENSE = ["rounds=3", "checkpoint.every=1"]


@pytest.fixture(autouse=True)
def _no_plots(monkeypatch):
    # curves.png is not what these tests check; matplotlib is most of a finished run's time.
    monkeypatch.setattr("fedloom.report.plots.write_run_plots", lambda *a, **k: None)


def _stop_at_2(st, m):
    if st.next_round == 2:
        raise KeyboardInterrupt


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped after round 2 of 3 (``last.pt`` round 2, ``prev.pt`` round 1),
    a finished run of another seed, and the uninterrupted run's sha and metrics."""
    root = tmp_path_factory.mktemp("stopped")
    (root / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    ref = fedloom.run(TINY, DENSE)
    with pytest.raises(KeyboardInterrupt):
        fedloom.run(TINY, DENSE, out=root / "run", callbacks=[_stop_at_2])
    fedloom.run(TINY, [*DENSE, "seed=4"], out=root / "other")
    return root, ref.summary["model_sha256"], ref.metrics


def _copy(stopped, tmp_path: Path) -> Path:
    root = stopped[0]
    shutil.copytree(root / "run", tmp_path / "run", symlinks=True)
    shutil.copy(root / "tiny.yaml", tmp_path / "tiny.yaml")
    return tmp_path / "run"


def _cli(cfg: Path, out: Path, capsys, *extra: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = cli.main(["run", str(cfg), *DENSE, "--out", str(out), "--quiet", *extra])
    return rc, [x for x in capsys.readouterr().err.splitlines() if x.strip()]


def _stable(ms: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.endswith("_s")} for m in ms]


def _sha(out: Path) -> str:
    return json.loads((out / "summary.json").read_text())["model_sha256"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _tree(root: Path, skip: tuple[str, ...] = ()) -> list[tuple[str, int, int]]:
    """Every entry under ``root`` with its size and mtime (links not followed),
    but those named in ``skip``."""
    out = [(".", 0, root.stat().st_mtime_ns)]
    for dirpath, dirs, files in os.walk(root):
        for name in sorted(dirs + files):
            p = Path(dirpath, name)
            if name in skip:
                continue
            st = p.lstat()
            out.append((str(p.relative_to(root)), st.st_size, st.st_mtime_ns))
    return sorted(out)


# ------------------------------------------------------- not a run directory
def _fake_root(tmp_path: Path) -> Path:
    """A temporary directory standing in for ``/``."""
    root = tmp_path / "fakeroot"
    for d in ("bin", "etc", "tmp"):
        (root / d).mkdir(parents=True)
    (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    (root / "vmlinuz").write_bytes(b"\x7fELF")
    return root


@pytest.mark.parametrize("resume", [False, True], ids=["new", "resume"])
@pytest.mark.parametrize("via", ["symlink", "direct"])
def test_out_that_is_not_a_run_directory_is_never_written(tmp_path, capsys, resume, via):
    """``--out`` a link to ``/`` (a stand-in here), or any non-empty directory
    that is not a run directory: exit 2, one line naming it, and nothing in it is
    created, changed or deleted (not even a lock file or a probe: its mtime stays)."""
    root = _fake_root(tmp_path)
    out = root
    if via == "symlink":
        out = tmp_path / "out"
        out.symlink_to(root, target_is_directory=True)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    before = _tree(root)
    rc, err = _cli(cfg, out, capsys, *(("--resume",) if resume else ()))
    assert rc == 2 and len(err) == 1, err
    assert f"{out}: " in err[0] and "not a fedloom run directory" in err[0], err
    assert _tree(root) == before
    assert not (root / ".lock").exists() and not (root / "config.yaml").exists()


def test_run_directory_of_an_earlier_version_resumes(stopped, tmp_path, capsys):
    """A run directory written before the marker existed (config.yaml with
    checkpoints/ and metrics.jsonl) is still one: a new run on it is refused as on
    any run directory (and leaves it unmarked); it resumes to the uninterrupted
    model and gets its marker."""
    out = _copy(stopped, tmp_path)
    (out / MARKER_FILE).unlink()
    rc, err = _cli(tmp_path / "tiny.yaml", out, capsys)  # a new run on it: refused, unmarked
    assert rc == 2 and len(err) == 1 and "not empty (use --resume" in err[0], err
    assert not (out / MARKER_FILE).exists()
    rc, err = _cli(tmp_path / "tiny.yaml", out, capsys, "--resume")
    assert rc == 0, err
    assert _sha(out) == stopped[1] and (out / MARKER_FILE).is_file()


def test_empty_directory_becomes_a_run_directory(stopped, tmp_path, capsys):
    """An empty directory (made by the user) is made a run directory, new or resumed."""
    for extra in ((), ("--resume",)):
        out = tmp_path / f"empty{len(extra)}"
        out.mkdir()
        rc, err = _cli(stopped[0] / "tiny.yaml", out, capsys, *extra)
        assert rc == 0, err
        assert (out / MARKER_FILE).is_file() and _sha(out) == stopped[1]


# ------------------------------------------------------------- special files
SPECIAL = ["/dev/zero", "/dev/urandom", "fifo"]


def _link_special(p: Path, target: str) -> None:
    p.unlink()
    if target == "fifo":
        os.mkfifo(p)
    else:
        p.symlink_to(target)


@pytest.mark.parametrize("target", SPECIAL)
def test_last_checkpoint_that_is_a_special_file_falls_back(stopped, tmp_path, capsys, caplog,
                                                            target):
    """``last.pt`` a link to /dev/zero or /dev/urandom, or a FIFO: never read
    (no MemoryError, no hang); the resume falls back to ``prev.pt``."""
    out = _copy(stopped, tmp_path)
    _link_special(out / "checkpoints" / "last.pt", target)
    caplog.set_level(logging.WARNING, logger="fedloom")
    rc, err = _cli(tmp_path / "tiny.yaml", out, capsys, "--resume")
    assert rc == 0, err
    assert _sha(out) == stopped[1]
    warn = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warn) == 1 and "not a regular file" in warn[0], warn
    assert "prev.pt (round 1)" in warn[0]


def test_checkpoint_longer_than_its_header_says_is_not_read(stopped, tmp_path, capsys, caplog):
    """A ``last.pt`` extended by a 1 TiB hole: refused from its size against the
    header, without reading it (reading it whole is a MemoryError); falls back."""
    out = _copy(stopped, tmp_path)
    last = out / "checkpoints" / "last.pt"
    try:
        os.truncate(last, 1 << 40)
    except OSError as e:  # a file system without sparse files that large
        pytest.skip(f"cannot make a 1 TiB sparse file here ({e.strerror})")
    caplog.set_level(logging.WARNING, logger="fedloom")
    rc, err = _cli(tmp_path / "tiny.yaml", out, capsys, "--resume")
    assert rc == 0, err
    assert _sha(out) == stopped[1]
    warn = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warn) == 1 and "truncated or extended" in warn[0], warn


@pytest.mark.parametrize("name", ["config.yaml", "metrics.jsonl"])
@pytest.mark.parametrize("target", SPECIAL)
def test_config_or_metrics_that_is_a_special_file_exit_2(stopped, tmp_path, capsys, name,
                                                         target):
    out = _copy(stopped, tmp_path)
    _link_special(out / name, target)
    rc, err = _cli(tmp_path / "tiny.yaml", out, capsys, "--resume")
    assert rc == 2 and len(err) == 1, err
    assert f"{name}: " in err[0] and "not a regular file" in err[0], err
    assert (out / name).is_symlink() or (out / name).is_fifo()


# -------------------------------------------------------------------- metrics
def test_metrics_of_another_run_are_refused(stopped, tmp_path, capsys):
    """``last.pt`` and ``metrics.jsonl`` copied from a run of another seed (same
    totals): ``last.pt`` is passed over, and ``prev.pt``'s round 1 is not in the
    metrics file (its digest differs), so exit 2 naming it; nothing is changed."""
    out = _copy(stopped, tmp_path)
    other = stopped[0] / "other"
    for name in ("checkpoints/last.pt", "metrics.jsonl"):
        shutil.copy(other / name, out / name)
    before = _tree(out, skip=(".lock",))  # the lock file holds the pid of its last holder
    rc, err = _cli(tmp_path / "tiny.yaml", out, capsys, "--resume")
    assert rc == 2 and len(err) == 1, err
    assert "metrics.jsonl: " in err[0] and "not this run's" in err[0], err
    assert _tree(out, skip=(".lock",)) == before


def test_metrics_of_another_run_alone_are_refused(stopped, tmp_path, capsys):
    """Only ``metrics.jsonl`` from the other run: refused; this run's own rows,
    reformatted (other spacing), are accepted (the digest is of each row's value)."""
    out = _copy(stopped, tmp_path)
    own = _rows(out)
    shutil.copy(stopped[0] / "other" / "metrics.jsonl", out / "metrics.jsonl")
    rc, err = _cli(tmp_path / "tiny.yaml", out, capsys, "--resume")
    assert rc == 2 and len(err) == 1, err
    assert "metrics.jsonl: " in err[0] and "not this run's" in err[0], err
    (out / "metrics.jsonl").write_text("".join(json.dumps(m, separators=(", ", " : ")) + "\n"
                                               for m in own))
    rc, err = _cli(tmp_path / "tiny.yaml", out, capsys, "--resume")
    assert rc == 0, err
    assert _sha(out) == stopped[1]


def test_metrics_cut_mid_line_falls_back_to_prev(stopped, tmp_path, capsys, caplog):
    """metrics.jsonl cut in the middle of round 2's line: ``last.pt`` (round 2)
    cannot be continued, ``prev.pt`` (round 1) can: resumed from it, saying so,
    to the uninterrupted model and metrics."""
    out = _copy(stopped, tmp_path)
    p = out / "metrics.jsonl"
    lines = p.read_bytes().split(b"\n")
    p.write_bytes(lines[0] + b"\n" + lines[1][: len(lines[1]) // 2])
    caplog.set_level(logging.WARNING, logger="fedloom")
    rc, err = _cli(tmp_path / "tiny.yaml", out, capsys, "--resume")
    assert rc == 0, err
    assert _sha(out) == stopped[1]
    assert _stable(_rows(out)) == _stable(stopped[2])
    warn = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warn) == 1 and "metrics.jsonl" in warn[0], warn
    assert "prev.pt (round 1)" in warn[0]


def _sparse_line(f, size: int, at: str = "") -> None:
    """Append a line of ``size`` bytes to the open file ``f``: ``at`` and then a hole
    (no disk, read as zero bytes) up to its newline."""
    f.write(at.encode())
    f.seek(size - len(at), os.SEEK_CUR)
    f.write(b"\n")


def test_a_metrics_line_over_the_bound_is_damage_never_held(tmp_path, caplog):
    """A line of 64 MiB (four times fedloom.bounded.MAX_JSONL_LINE) among intact rounds:
    a damaged line, dropped with one warning saying why, read past without being held
    (the peak of Python's allocations stays under three bounds' worth, the reader's
    chunk and its copy; the whole file was read before, then split: twice the line)."""
    import tracemalloc

    from fedloom.bounded import MAX_JSONL_LINE
    from fedloom.engine.runs.directory import read_metrics

    p = tmp_path / "metrics.jsonl"
    with open(p, "wb") as f:
        f.write(b'{"round": 1}\n')
        _sparse_line(f, 4 * MAX_JSONL_LINE, '{"round": 2, "x": "')
        f.write(b'{"round": 2}\n{"round": 3}\n')
    caplog.set_level(logging.WARNING, logger="fedloom")
    tracemalloc.start()
    try:
        rows = read_metrics(p, 2)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert rows == [{"round": 1}, {"round": 2}]
    assert peak < 3 * MAX_JSONL_LINE, peak
    warn = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warn == [f"{p}: dropped 1 damaged lines (2; line 2 over the {MAX_JSONL_LINE:,}-byte "
                    "bound on a metrics line); rounds 1–2 are intact"], warn


def test_metrics_line_over_the_bound_falls_back_to_prev(stopped, tmp_path, capsys, caplog,
                                                        monkeypatch):
    """Round 2's line longer than the bound (lowered here to 4 KiB, above the run's own
    rows, which the resume rewrites and keeps reading): ``last.pt`` (round 2) cannot be
    continued, ``prev.pt`` (round 1) can, as for a torn line: resumed from it to the
    uninterrupted model and metrics. Unlike a torn line, it is no news of a kill: the
    reading for prev.pt says it dropped it, then the fallback says why."""
    monkeypatch.setattr("fedloom.bounded.MAX_JSONL_LINE", 4096)
    out = _copy(stopped, tmp_path)
    p = out / "metrics.jsonl"
    lines = p.read_bytes().split(b"\n")
    assert max(map(len, lines)) < 4096
    with open(p, "wb") as f:
        f.write(lines[0] + b"\n")
        _sparse_line(f, 5000, lines[1][:-1].decode() + ', "x": "')
    caplog.set_level(logging.WARNING, logger="fedloom")
    rc, err = _cli(tmp_path / "tiny.yaml", out, capsys, "--resume")
    assert rc == 0, err
    assert _sha(out) == stopped[1]
    assert _stable(_rows(out)) == _stable(stopped[2])
    warn = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warn) == 2, warn
    assert all("line 2 over the 4,096-byte bound on a metrics line" in w for w in warn), warn
    assert "rounds 1–1 are intact" in warn[0] and "prev.pt (round 1)" in warn[1], warn


# ------------------------------------------------------------------ full disk
class _Disk:
    """A small file system under ``path``: a real 16 MiB tmpfs (``real``), or
    ENOSPC simulated where a full disk first shows for a new file (its creation).
    :meth:`fill` makes it full, :meth:`free` gives the space back."""

    def __init__(self, path: Path, monkeypatch, real: bool) -> None:
        path.mkdir()
        self.path, self.full, self.real = path, False, real
        if real:
            if os.geteuid() != 0 or shutil.which("mount") is None or subprocess.run(
                    ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)],
                    capture_output=True).returncode != 0:
                pytest.skip("cannot mount a tmpfs here (the simulated variant runs)")
        else:
            import tempfile

            real_mkstemp = tempfile.mkstemp

            def mkstemp(*a, **k):
                if self.full:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real_mkstemp(*a, **k)

            monkeypatch.setattr("fedloom.files.tempfile.mkstemp", mkstemp)

    def fill(self) -> None:
        self.full = True
        if self.real:
            fd = os.open(self.path / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                while True:
                    os.write(fd, b"\0" * (1 << 20))
            except OSError as e:
                assert e.errno == errno.ENOSPC
            finally:
                os.close(fd)

    def free(self) -> None:
        self.full = False
        (self.path / "filler").unlink(missing_ok=True)

    def close(self) -> None:
        if self.real:
            subprocess.run(["umount", str(self.path)], check=True)


@pytest.fixture(params=["tmpfs", "simulated"])
def disk(tmp_path, monkeypatch, request):
    d = _Disk(tmp_path / "disk", monkeypatch, request.param == "tmpfs")
    try:
        yield d
    finally:
        d.close()


@pytest.mark.parametrize("when", ["checkpoint", "outputs", "after_checkpoint"])
def test_full_disk_one_line_exit_2_and_resume_continues(stopped, disk, tmp_path, capsys,
                                                        monkeypatch, when):
    """The disk fills before round 2's checkpoint, before the final outputs, or
    right after round 1's checkpoint: one line naming the file that could not be
    written and saying that --resume continues, exit 2, no temporary file left.
    A resume while the disk is still full is refused the same way and changes
    nothing; once there is space it ends with the uninterrupted run's model."""
    import fedloom.engine.runs.loop as loop

    cfg, out = stopped[0] / "tiny.yaml", disk.path / "run"
    saves = []
    real_save, real_outputs = loop.save, loop.write_outputs

    def save(*a, **k):
        saves.append(1)
        if when == "checkpoint" and len(saves) == 2:
            disk.fill()
        got = real_save(*a, **k)
        if when == "after_checkpoint" and len(saves) == 1:
            disk.fill()
        return got

    def outputs(*a, **k):
        if when == "outputs":
            disk.fill()
        return real_outputs(*a, **k)

    monkeypatch.setattr(loop, "save", save)
    monkeypatch.setattr(loop, "write_outputs", outputs)
    rc, err = _cli(cfg, out, capsys)
    assert rc == 2 and len(err) == 1, err
    named = {"checkpoint": f"{out / 'checkpoints' / 'last.pt'}: ",
             "outputs": f"{out / 'model.pt'}: "}.get(when, f"{out}{os.sep}")
    assert err[0].startswith(f"fedloom: error: {named}"), err
    assert "cannot be written" in err[0] and "--resume" in err[0], err
    assert not list(out.rglob("*.tmp"))
    monkeypatch.setattr(loop, "save", real_save)
    monkeypatch.setattr(loop, "write_outputs", real_outputs)
    before = {p: p.read_bytes() for p in (out / "metrics.jsonl", out / "checkpoints/last.pt")}
    rc, err = _cli(cfg, out, capsys, "--resume")  # still full
    assert rc == 2 and len(err) == 1 and "cannot be written" in err[0], err
    assert {p: p.read_bytes() for p in before} == before
    assert not list(out.rglob("*.tmp"))
    disk.free()
    rc, err = _cli(cfg, out, capsys, "--resume")
    assert rc == 0, err
    assert _sha(out) == stopped[1]
    assert _stable(_rows(out)) == _stable(stopped[2])

