"""The shape of the package, held by measurement (issue #53, item 6).

Thresholds, as the issue states them; a change that would cross one splits the
code, never the threshold:

- no module of ``src/fedloom`` over 600 lines;
- no function over 80 lines (``end_lineno - lineno + 1`` of the ``def``, as
  :mod:`ast` reports it);
- no class outside ``config/`` with more than 15 fields or instance attributes
  (annotated names in the class body, and every ``self.X = …`` in it);
- no ``getattr``/``hasattr`` in ``engine/`` (a capability is a declared field
  of the component's capability dataclass, :mod:`fedloom.capabilities`).

Import layers and cycles are import-linter's (``make test`` runs it, the
contracts are in ``pyproject.toml``).

``PENDING`` lists what the core rewrite has not reached yet, each with the size
it has today: the test fails when a listed piece grows, when a new piece crosses
a threshold, and when a listed piece is brought under it (then its line goes).
The list only shrinks; when it is empty it goes, and with it this paragraph.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "fedloom"

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_CLASS_ATTRIBUTES = 15

# (kind, "path relative to src/fedloom:name") -> its size when listed.
PENDING: dict[tuple[str, str], int] = {
}


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _rel(p: Path) -> str:
    return p.relative_to(SRC).as_posix()


def _class_attributes(node: ast.ClassDef) -> set[str]:
    names = {s.target.id for s in node.body
             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    names |= {s.attr for s in ast.walk(node)
              if isinstance(s, ast.Attribute) and isinstance(s.ctx, ast.Store)
              and isinstance(s.value, ast.Name) and s.value.id == "self"}
    return names


def _measure() -> dict[tuple[str, str], int]:
    """Every piece over its threshold, with its size."""
    over: dict[tuple[str, str], int] = {}
    for p in _modules():
        text = p.read_text()
        if (n := len(text.splitlines())) > MAX_MODULE_LINES:
            over[("module", _rel(p))] = n
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES:
                    over[("function", f"{_rel(p)}:{node.name}")] = size
            elif isinstance(node, ast.ClassDef) and "config" not in p.relative_to(SRC).parts:
                if (k := len(_class_attributes(node))) > MAX_CLASS_ATTRIBUTES:
                    over[("class", f"{_rel(p)}:{node.name}")] = k
    return over


def test_nothing_new_crosses_a_threshold() -> None:
    new = {k: v for k, v in _measure().items() if k not in PENDING}
    assert not new, ("over the thresholds (split the code, not the threshold): "
                     + ", ".join(f"{kind} {name} ({size})" for (kind, name), size in new.items()))


def test_the_pending_pieces_only_shrink() -> None:
    over = _measure()
    grown = {k: (over[k], v) for k, v in PENDING.items() if k in over and over[k] > v}
    assert not grown, "grown past their size when listed: " + ", ".join(
        f"{kind} {name} ({now} > {then})" for (kind, name), (now, then) in grown.items())
    done = [k for k in PENDING if k not in over]
    assert not done, ("under the threshold now: take them out of PENDING: "
                      + ", ".join(f"{kind} {name}" for kind, name in done))


MAX_JOB_FIELDS = 10


def test_a_client_job_holds_only_what_the_loop_reads() -> None:
    """Issue #53, item 3: a client's job is at most 10 fields; a method's or a
    feedback policy's terms of the local step travel in ``job.transforms``."""
    tree = ast.parse((SRC / "job.py").read_text())
    job = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ClientJob")
    k = len(_class_attributes(job))
    assert k <= MAX_JOB_FIELDS, f"ClientJob has {k} fields (at most {MAX_JOB_FIELDS}, #53)"


# The one local-training step loop (#53, item 3): a `for` statement whose body
# both takes a gradient (calls a function whose name has "grad" in it, or
# `backward`, or builds a `StepContext`, a chain's step) and steps parameters (an
# in-place `sub_`/`addcmul_` with `alpha=`/`value=`, or `w - lr * g` with a name
# holding "lr"). Only the loop's module may hold one.
STEP_LOOP_MODULE = "client/loop.py"


def _takes_gradient(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(
                f, ast.Attribute) else ""
            if "grad" in name or name in ("backward", "StepContext"):
                return True
    return False


def _has_lr(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Name) and "lr" in n.id)
               or (isinstance(n, ast.Attribute) and "lr" in n.attr) for n in ast.walk(node))


def _steps_parameters(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                and n.func.attr in ("sub_", "addcmul_")
                and any(k.arg in ("alpha", "value") for k in n.keywords)):
            return True
        if (isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub)
                and isinstance(n.right, ast.BinOp) and isinstance(n.right.op, ast.Mult)
                and _has_lr(n.right)):
            return True
    return False


def _step_loops(src: str) -> int:
    """How many `for` loops of ``src`` are local-training step loops."""
    return sum(1 for n in ast.walk(ast.parse(src))
               if isinstance(n, ast.For | ast.AsyncFor)
               and _takes_gradient(ast.Module(body=n.body, type_ignores=[]))
               and _steps_parameters(ast.Module(body=n.body, type_ignores=[])))


def test_one_step_loop() -> None:
    found = {_rel(p) for p in _modules() if _step_loops(p.read_text())}
    assert STEP_LOOP_MODULE in found, f"the step loop is not in {STEP_LOOP_MODULE}"
    others = found - {STEP_LOOP_MODULE}
    assert not others, ("a local-training step loop outside " + STEP_LOOP_MODULE
                        + " (give the loop a gradient function instead): " + ", ".join(others))


def test_the_step_loop_measure() -> None:
    """A loop that takes a gradient and steps is one; either alone is not (a
    per-parameter step after the gradient, a loop over clients' evaluations)."""
    assert _step_loops("for t in r:\n    g = grad(w)\n    w.sub_(g, alpha=lr)\n") == 1
    assert _step_loops("for t in r:\n    g = f.grads(t)\n    W.addcmul_(a, g, value=-1)\n") == 1
    assert _step_loops("for b in bs:\n    l, g = _grad(m, w, b)\n    w = w - lr * g\n") == 1
    assert _step_loops("for t in r:\n    ctx = StepContext(t, W, W0)\n"
                       "    W.sub_(D, alpha=eta)\n") == 1
    assert _step_loops("g = grad(w)\nfor p, q in zip(ps, g):\n    p.sub_(q, alpha=lr)\n") == 0
    assert _step_loops("for k in ks:\n    g = grad(w)\n    out.append(g)\n") == 0
    assert _step_loops("for k in ks:\n    w = w - 2 * g\n") == 0


PROBE = re.compile(r"\b(getattr|hasattr)\(")


def test_no_capability_probes_in_the_engine() -> None:
    found = [f"{_rel(p)}:{i}" for p in sorted((SRC / "engine").rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if PROBE.search(line) and "__getattr__" not in line]
    assert not found, ("getattr/hasattr in engine/ (declare the capability instead): "
                       + ", ".join(found))


def test_the_measure_sees_what_it_measures(tmp_path: Path) -> None:
    """The counting itself: a function of 81 lines and a class of 16 attributes
    are over, 80 and 15 are not (a measure that saw nothing would pass every
    test above)."""
    def over(src: str) -> list[int]:
        sizes = []
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.FunctionDef):
                sizes.append(node.end_lineno - node.lineno + 1)
            elif isinstance(node, ast.ClassDef):
                sizes.append(len(_class_attributes(node)))
        return sizes

    body = "\n".join(f"    x{i} = {i}" for i in range(79))
    assert over(f"def f():\n{body}\n    return 0\n") == [81]
    fields = "\n".join(f"    a{i}: int" for i in range(15))
    assert over(f"class C:\n{fields}\n    def g(self):\n        self.b = 1\n") == [16, 2]
    assert over(f"class C:\n{fields}\n") == [15]
