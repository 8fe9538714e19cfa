"""Spawned workers and the script that starts them.

A process started with ``spawn`` (the process backend's workers, the sweep's)
imports the parent's main script again, as ``__mp_main__``, before it runs its
target (Python's multiprocessing guide, "Safe importing of main module"). A
script that starts a run at its top level, with no ``if __name__ ==
"__main__":``, so starts the run again inside every worker, which Python stops
("an attempt has been made to start a new process before the current process
has finished its bootstrapping phase"): the worker exits with code 1 and the
parent sees only a dead worker. :func:`check_main_guard` refuses such a run in
the parent, before anything is spawned, in one line naming the script and the
fix. A script with the guard anywhere passes (a run started above the guard as
well is still caught by Python in the worker); an interactive session, a
notebook and ``python -c`` have no script to import again and pass.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

__all__ = ["check_main_guard", "unguarded_main"]


def _tests_main(node: ast.AST) -> bool:
    """``__name__ == "__main__"`` (either side)."""
    if not (isinstance(node, ast.Compare) and len(node.comparators) == 1):
        return False
    sides = (node.left, node.comparators[0])
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def unguarded_main() -> Path | None:
    """The main script's path when it is a readable Python file with no
    ``__name__ == "__main__"`` test, else ``None`` (no script, or one that cannot be
    read or parsed: nothing is claimed about it)."""
    main = sys.modules.get("__main__")
    path = main.__dict__.get("__file__") if main is not None else None
    if not isinstance(path, str):
        return None
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None
    if any(_tests_main(node) for node in ast.walk(tree)):
        return None
    return Path(path)


def check_main_guard(who: str) -> None:
    """Raise ``RuntimeError`` (one line, naming ``who``, the script and the fix)
    when the main script would start the run again in each spawned worker."""
    path = unguarded_main()
    if path is not None:
        raise RuntimeError(
            f"{who}: {path} has no `if __name__ == \"__main__\":`, and each spawned worker "
            "imports it again (starting the run again); put the code that starts the run "
            "under that line")
