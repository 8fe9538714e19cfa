"""Links, FIFOs and second names at the paths fedloom writes.

A file fedloom writes in place (a run's ``.lock``, a sweep's
``.fedloom-sweep.lock``, the rows appended to ``metrics.csv``, the Flower relay's
lock and log) is opened without following a link and is never truncated: a link,
a FIFO, a file with a second name (hard link) or a lock file holding anything but
a pid there is refused in one line (exit 2) and what it points to is left as it
was. Every other file (outputs, figures, pages, CSVs, a sweep's state, client
state snapshots) is written to a new temporary file and renamed over the path, so
a link there is replaced and its target never opened.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import fedloom
from conftest import TINY
from fedloom import cli
from fedloom.engine.runs.checkpoint import LOCK_FILE, MARKER_FILE

PRECIOUS = "precious, not fedloom's\n"
# the figures have their own test below; matplotlib is most of a short run's time
QUICK = {**TINY, "rounds": 1, "logging": {"plots": False}}


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(QUICK))
    return cfg


def _one_line(capsys, *tokens: str) -> str:
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and err[0].startswith("fedloom: error: "), err
    for t in tokens:
        assert t in err[0], err[0]
    return err[0]


def _plant(path: Path, kind: str, target: Path) -> None:
    """At ``path``: a link to ``target``, a second name of it, a FIFO, or a file of
    text that is not a pid (``target`` then unused)."""
    if kind == "symlink":
        path.symlink_to(target)
    elif kind == "hardlink":
        os.link(target, path)
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        path.write_text(PRECIOUS)


# ------------------------------------------------------------------ lock files
@pytest.mark.parametrize("kind", ["symlink", "hardlink", "fifo", "text"])
def test_a_run_lock_file_fedloom_did_not_write_is_refused_and_left_as_it_was(
        tmp_path, capsys, kind):
    """``RUN/.lock`` a link to a file (or a second name of it, a FIFO, a file of
    text): one line naming it, exit 2; the file it points to keeps its content and
    nothing is written into the folder (no marker)."""
    target = tmp_path / "v"
    target.write_text(PRECIOUS)
    out = tmp_path / "d"
    out.mkdir()
    _plant(out / LOCK_FILE, kind, target)
    before = sorted(p.name for p in out.iterdir())
    rc = cli.main(["run", str(_config(tmp_path)), "--out", str(out), "--quiet"])
    assert rc == 2
    _one_line(capsys, str(out / LOCK_FILE))
    assert target.read_text() == PRECIOUS
    assert sorted(p.name for p in out.iterdir()) == before and not (out / MARKER_FILE).exists()
    if kind == "text":
        assert (out / LOCK_FILE).read_text() == PRECIOUS


def test_a_lock_file_of_a_longer_pid_is_overwritten_not_truncated(tmp_path, capsys):
    """An earlier holder's pid, longer than this one's: covered by the new pid line
    (padded), not cut: the file holds this process's pid and nothing else."""
    out = tmp_path / "d"
    out.mkdir()
    old = "9" * 20 + "\n"
    (out / LOCK_FILE).write_text(old)
    assert cli.main(["run", str(_config(tmp_path)), "--out", str(out), "--quiet"]) == 0
    text = (out / LOCK_FILE).read_text()
    assert text.split() == [str(os.getpid())] and len(text) == len(old)


def test_a_sweep_lock_file_that_is_a_link_is_refused_and_left_as_it_was(tmp_path, capsys):
    target = tmp_path / "v"
    target.write_text(PRECIOUS)
    out = tmp_path / "out"
    out.mkdir()
    (out / ".fedloom-sweep.lock").symlink_to(target)
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({
        "name": "t", "out": str(out), "seeds": [1], "methods": {"FedAvg": []},
        "settings": {"digits": {"config": str(_config(tmp_path))}}}))
    assert cli.main(["sweep", str(suite), "--workers", "1"]) == 2
    _one_line(capsys, "out: ", str(out / ".fedloom-sweep.lock"), "link")
    assert target.read_text() == PRECIOUS
    assert sorted(p.name for p in out.iterdir()) == [".fedloom-sweep.lock"]


def test_a_marker_that_is_a_link_does_not_make_a_run_directory(tmp_path, capsys):
    """A folder of other files with ``.fedloom-run`` a link to a regular file is not
    a run directory: refused, nothing written into it."""
    (tmp_path / "elsewhere").write_text("fedloom run directory\n")
    out = tmp_path / "d"
    out.mkdir()
    (out / "notes.txt").write_text(PRECIOUS)
    (out / MARKER_FILE).symlink_to(tmp_path / "elsewhere")
    before = sorted(p.name for p in out.iterdir())
    rc = cli.main(["run", str(_config(tmp_path)), "--out", str(out), "--quiet"])
    assert rc == 2
    _one_line(capsys, "not a fedloom run directory")
    assert sorted(p.name for p in out.iterdir()) == before


# --------------------------------------------------------------- in-place logs
def test_metrics_csv_swapped_for_a_link_mid_run_is_refused(tmp_path):
    """``metrics.csv`` gets one line a round, appended: replaced by a link after
    round 1, round 2's line is refused (one line naming it) and the link's target
    keeps its content."""
    target = tmp_path / "v"
    target.write_text(PRECIOUS)
    out = tmp_path / "run"

    def swap(st, m):
        if m["round"] == 1:
            (out / "metrics.csv").unlink()
            (out / "metrics.csv").symlink_to(target)

    with pytest.raises(ValueError, match=r"metrics\.csv: is a link to"):
        fedloom.run({**QUICK, "rounds": 2}, out=out, callbacks=[swap])
    assert target.read_text() == PRECIOUS


# ------------------------------------------------------ files replaced whole
OUTPUTS = ["summary.json", "client_acc.json", "model.pt", "metrics.csv", "curves.png",
           "partition.png"]


def test_outputs_replace_a_link_and_never_write_through_it(tmp_path):
    """A stopped run whose output names are links to files elsewhere: resumed to its
    end, every output (the figures included) is a new regular file and every link's
    target keeps its content."""
    pytest.importorskip("matplotlib")
    cfg = {**TINY, "rounds": 2, "logging": {"plots": True}}
    out = tmp_path / "run"

    def stop(st, m):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fedloom.run(cfg, out=out, callbacks=[stop])
    for name in OUTPUTS:
        (tmp_path / f"v-{name}").write_text(PRECIOUS)
        (out / name).unlink(missing_ok=True)
        (out / name).symlink_to(tmp_path / f"v-{name}")
    fedloom.run(cfg, out=out, resume=True)
    for name in OUTPUTS:
        assert (tmp_path / f"v-{name}").read_text() == PRECIOUS, name
        assert (out / name).is_file() and not (out / name).is_symlink(), name


def test_compare_csv_and_markdown_replace_a_link(tmp_path, capsys):
    out = tmp_path / "run"
    fedloom.run(QUICK, out=out)
    for name in ("t.csv", "t.md"):
        (tmp_path / f"v-{name}").write_text(PRECIOUS)
        (tmp_path / name).symlink_to(tmp_path / f"v-{name}")
    assert cli.main(["compare", str(out), "--csv", str(tmp_path / "t.csv"),
                     "--markdown", str(tmp_path / "t.md")]) == 0
    for name in ("t.csv", "t.md"):
        assert (tmp_path / f"v-{name}").read_text() == PRECIOUS
        assert not (tmp_path / name).is_symlink() and "test_acc" in (tmp_path / name).read_text()


def test_client_state_files_and_snapshots_never_write_through_a_link(tmp_path):
    """A memory-mapped client state file, and the temporary name its snapshot was
    written under, each a link to a file elsewhere: both files keep their content."""
    from fedloom.state import ClientStateStore, FieldSpec

    for name in ("v-state", "v-snap"):
        (tmp_path / name).write_text(PRECIOUS)
    state, snaps = tmp_path / "state", tmp_path / "ckpt"
    state.mkdir()
    snaps.mkdir()
    (state / "state-h.bin").symlink_to(tmp_path / "v-state")
    (snaps / ".state-h-r1.bin.tmp").symlink_to(tmp_path / "v-snap")
    store = ClientStateStore(4, {"h": FieldSpec(3)}, storage="memmap", directory=state)
    store.scatter("h", [1], torch.ones(1, 3))
    saved = store.state_dict(snaps, tag="r1")
    assert (tmp_path / "v-state").read_text() == PRECIOUS
    assert (tmp_path / "v-snap").read_text() == PRECIOUS
    assert not (state / "state-h.bin").is_symlink()
    store.load_state_dict(saved, snaps)
    assert np.array_equal(store.gather("h", [0, 1]).numpy(), [[0, 0, 0], [1, 1, 1]])


def test_kill_once_marker_is_never_created_through_a_link(tmp_path):
    """``FEDLOOM_KILL_ONCE``'s marker path a dangling link: the marker is made new
    (``O_EXCL``), so nothing appears where the link points and no worker dies."""
    marker, target = tmp_path / "marker", tmp_path / "made-through-the-link"
    marker.symlink_to(target)
    code = ("from types import SimpleNamespace as S\n"
            "from fedloom.engine.trainers.backends import maybe_die\n"
            f"maybe_die({f'3:{marker}'!r}, [S(client=3)])\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert not target.exists()


def test_warm_relay_lock_and_log_are_never_opened_through_a_link(tmp_path):
    from fedloom.integrations.warm import _no_follow

    target = tmp_path / "v"
    target.write_text(PRECIOUS)
    (tmp_path / "w.log").symlink_to(target)
    with pytest.raises(OSError), open(tmp_path / "w.log", "ab", opener=_no_follow) as f:
        f.write(b"worker output\n")
    assert target.read_text() == PRECIOUS
