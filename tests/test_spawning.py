"""A script that starts spawned workers without the ``__main__`` guard is refused
in one line before anything is spawned (fedloom.spawning); a guarded one runs."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from fedloom.spawning import check_main_guard, unguarded_main

GUARDED = ["if __name__ == '__main__':\n    run()\n", "if '__main__' == __name__:\n    run()\n",
           "def main():\n    if __name__ == \"__main__\":\n        run()\n"]
UNGUARDED = ["run()\n", "if __name__ == 'tests':\n    run()\n", "name = '__main__'\nrun()\n"]


def _main_from(monkeypatch: pytest.MonkeyPatch, path: Path | None) -> None:
    main = types.ModuleType("__main__")
    if path is not None:
        main.__file__ = str(path)
    monkeypatch.setitem(sys.modules, "__main__", main)


@pytest.mark.parametrize("src", GUARDED)
def test_a_script_with_the_guard_passes(monkeypatch, tmp_path, src):
    p = tmp_path / "s.py"
    p.write_text(src)
    _main_from(monkeypatch, p)
    assert unguarded_main() is None
    check_main_guard("backend process")


@pytest.mark.parametrize("src", UNGUARDED)
def test_a_script_without_it_is_named_with_the_fix(monkeypatch, tmp_path, src):
    p = tmp_path / "s.py"
    p.write_text(src)
    _main_from(monkeypatch, p)
    assert unguarded_main() == p
    with pytest.raises(RuntimeError) as e:
        check_main_guard("sweep")
    line = str(e.value)
    assert line.startswith(f"sweep: {p} has no `if __name__ == \"__main__\":`") and "\n" not in line


def test_no_script_or_one_that_cannot_be_read_claims_nothing(monkeypatch, tmp_path):
    _main_from(monkeypatch, None)  # an interactive session, a notebook, python -c
    assert unguarded_main() is None
    _main_from(monkeypatch, tmp_path / "gone.py")
    assert unguarded_main() is None
    bad = tmp_path / "bad.py"
    bad.write_bytes(b"def (:\n\xff\n")
    _main_from(monkeypatch, bad)
    assert unguarded_main() is None


def test_the_sweep_refuses_before_its_pool_starts(monkeypatch, tmp_path):
    from fedloom.sweep import running

    p = tmp_path / "s.py"
    p.write_text("run()\n")
    _main_from(monkeypatch, p)
    with pytest.raises(RuntimeError, match=r"^sweep: .*s\.py has no"):
        running._Launcher(1)


SCRIPT = """
import fedloom
cfg = {{"name": "g", "seed": 3, "rounds": 1,
       "data": {{"name": "digits", "num_clients": 4}},
       "model": {{"name": "mlp", "options": {{"hidden": [8]}}}},
       "cohort": {{"size": 2}}, "client": {{"lr": 0.1, "batch_size": 16, "epochs": 1}},
       "backend": {{"name": "process", "options": {{"workers": 1}}}}}}
{body}
"""


def test_process_backend_from_a_script(tmp_path):
    """End to end: the unguarded script fails with the one line (no worker died);
    the same script under the guard trains."""
    for name, body, ok in (
            ("bare.py", "print(fedloom.run(cfg).summary['rounds'])", False),
            ("guarded.py", "if __name__ == '__main__':\n"
                           "    print(fedloom.run(cfg).summary['rounds'])", True)):
        p = tmp_path / name
        p.write_text(SCRIPT.format(body=body))
        r = subprocess.run([sys.executable, str(p)], capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
        if ok:
            assert r.returncode == 0, r.stderr
            assert r.stdout.strip().splitlines()[-1] == "1"
        else:
            assert r.returncode != 0
            last = r.stderr.strip().splitlines()[-1]
            assert last == (f"RuntimeError: backend process: {p} has no `if __name__ == "
                            "\"__main__\":`, and each spawned worker imports it again (starting "
                            "the run again); put the code that starts the run under that line")
            assert "worker process died" not in r.stderr
