"""Capabilities (fedloom.capabilities): every built-in declares its dataclass, with
the values its loose flags had before the dataclasses; a plug-in's loose flags
are translated with a deprecation message; the engine probes no flag by name."""

from __future__ import annotations

import ast
import logging
import typing
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fedloom.capabilities import (
    AggregatorCaps,
    BackendCaps,
    CompressorCaps,
    FeedbackCaps,
    LoopCaps,
    MethodCaps,
    aggregator_caps,
    backend_caps,
    compressor_caps,
    feedback_caps,
    method_caps,
)
from fedloom.params import Layout
from fedloom.registry import accepted_options, available, build, get, origin

SRC = Path(__file__).resolve().parents[1] / "src" / "fedloom"

# The loose flags each built-in had before the dataclasses (getattr on the built
# component with the engine's defaults, at the options named): (kind, name,
# options) → flags; a flag not listed had the default. Flags added since (``pure``) are
# listed where a built-in sets them.
BEFORE: dict[tuple[str, str, tuple[tuple[str, Any], ...]], dict[str, Any]] = {
    ("aggregator", "afl", ()): {"requires": {"start_losses"}, "full_participation": True},
    ("aggregator", "config", ()): {},
    ("aggregator", "coordmean", ()): {},
    ("aggregator", "craft", ()): {},
    ("aggregator", "craft", (("targets", "loss"),)): {"requires": {"start_losses"}},
    ("aggregator", "fedavg", ()): {"linear": True, "dp_mean": True, "weighted": True},
    ("aggregator", "fedavg", (("weighted", False),)): {"linear": True, "dp_mean": True},
    ("aggregator", "fedfv", ()): {"requires": {"start_losses"}},
    ("aggregator", "fedlf", ()): {"requires": {"start_losses"}},
    ("aggregator", "fednova", ()): {"requires": {"steps"}, "linear": True},
    ("aggregator", "krum", ()): {},
    ("aggregator", "median", ()): {},
    ("aggregator", "qfedavg", ()): {"requires": {"start_losses", "lr"}},
    ("aggregator", "trimmed_mean", ()): {},
    # added since: LoRA's rules read the global model the rows are relative to
    ("aggregator", "fedit", ()): {"requires": {"w"}, "linear": True, "dp_mean": True,
                                  "weighted": True},
    ("aggregator", "lora_exact", ()): {"requires": {"w"}, "weighted": True},
    ("aggregator", "hetlora", ()): {"requires": {"w"}, "weighted": True},
    ("compressor", "bf16", ()): {"linear": True, "pure": True},
    ("compressor", "fp16", ()): {"linear": True, "pure": True},
    ("compressor", "identity", ()): {"linear": True, "pure": True, "decode_into": True},
    ("compressor", "qsgd", ()): {"pure": True},
    ("compressor", "randk", ()): {"pure": True},
    ("compressor", "sign", ()): {"pure": True},
    ("compressor", "topk", ()): {"pure": True},
    ("feedback", "cser", ()): {"row_only": False},
    ("feedback", "ec_prox", ()): {"row_only": True},
    ("feedback", "ef", ()): {"row_only": True},
    ("feedback", "ef21", ()): {"row_only": False},
    ("feedback", "ef21", (("ef21_mean", "sampled"),)): {"row_only": True},
    ("feedback", "flare", ()): {"row_only": True},
    ("feedback", "none", ()): {"row_only": True},
    ("feedback", "saef", ()): {"row_only": True},
    ("feedback", "sapef", ()): {"row_only": True},
    ("feedback", "sapef", (("alpha_schedule", "theory"),)): {"schedule": "theory",
                                                              "row_only": True},
    ("feedback", "sapef", (("alpha_schedule", "residual"),)): {"schedule": "residual",
                                                                "row_only": True},
    ("feedback", "scafcom", ()): {"row_only": False},
    **{("method", m, ()): {} for m in ("apfl", "ditto", "fedper", "fedrep", "lg_fedavg",
                                       "moon", "sgd")},
    # local SGD with their terms in the job, then complete(): the lock-step trainer runs them
    **{("method", m, ()): {"batched": True} for m in ("feddyn", "scaffold")},
    ("method", "fedbn", ()): {"model_buffers": "local"},
    # a flag added since: its local work is plain SGD with a term in the job (the
    # lock-step trainer runs it)
    ("method", "fedbabu", ()): {"batched": True},
    ("method", "fedsa_lora", ()): {},
    ("method", "hetlora", ()): {},
    # auto: before its choice (then the chosen backend's, test_auto_reads_the_chosen_caps)
    ("backend", "auto", ()): {},
    # the batched trainers: what of the one step loop they run (the rest: sequential)
    ("backend", "lockstep", ()): {"loop": LoopCaps(methods=True)},
    ("backend", "vmap", ()): {"loop": LoopCaps()},
    ("backend", "sequential", ()): {"streams": True, "writes_rows": True, "shared_rows": False},
    ("backend", "process", ()): {"ships_indices": True, "streams": True, "writes_rows": True,
                                 "worker_threads": 1},
    ("backend", "ray", ()): {"ships_indices": True, "streams": True, "worker_threads": 1},
}

CAPS = {"aggregator": AggregatorCaps, "compressor": CompressorCaps, "feedback": FeedbackCaps,
        "method": MethodCaps, "backend": BackendCaps}
READ = {"aggregator": aggregator_caps, "compressor": compressor_caps,
        "feedback": feedback_caps, "method": method_caps, "backend": backend_caps}


def _layout() -> Layout:
    # a body and a head (LG-FedAvg, FedPer, FedRep, FedBABU, MOON name them)
    return Layout.from_module(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(),
                                                  torch.nn.Linear(3, 2)))


def _lora_layout() -> Layout:
    return Layout([("q.lora_A.default.weight", (2, 4)), ("q.lora_B.default.weight", (3, 2))],
                  [["q.lora_A.default.weight", "q.lora_B.default.weight"]])


def _built(kind: str, name: str, options: dict[str, Any]) -> Any:
    """The component as the engine holds it (a backend: its class, whose factory
    needs a trainer, or where its capabilities read its settings, an instance of it
    with those settings only: one thread a worker, nothing chosen yet)."""
    factory = get(kind, name)
    if kind == "backend":
        cls = typing.get_type_hints(factory)["return"]
        if not isinstance(vars(cls).get("capabilities"), property):
            return cls
        obj = cls.__new__(cls)  # no workers, pool or Ray cluster started
        vars(obj).update({"chosen": None} if name == "auto" else {"worker_threads": 1})
        return obj
    # FedSA-LoRA and HetLoRA split a LoRA adapter's A and B: a layout that has them
    layout = _lora_layout() if name in ("fedsa_lora", "hetlora") else _layout()
    extra = accepted_options(factory, {"layout": layout})
    return build(kind, name, {**extra, **options}, f"{kind}.options")


def test_every_built_in_declares_its_capabilities():
    """Every built-in holds its kind's capability dataclass. ``BEFORE`` is the record
    of the flags the built-ins had when the loose flags were declared (each listed one
    must still equal them); a built-in added since is checked here and in its own test
    file, so adding one does not touch this table."""
    for kind in CAPS:
        for name in available(kind):
            if origin(kind, name) != "fedloom":
                continue
            obj = _built(kind, name, {})
            assert isinstance(obj.capabilities, CAPS[kind]), f"{kind} {name!r}: not declared"
            assert isinstance(READ[kind](obj), CAPS[kind])


@pytest.mark.parametrize("key", sorted(BEFORE, key=str), ids=lambda k: "-".join(
    [k[0], k[1], *(f"{o}={v}" for o, v in k[2])]))
def test_each_built_in_declares_the_flags_it_had(key):
    """Declared (``capabilities`` is the dataclass, read without a translation or a
    warning), equal to the loose flags it had, with the defaults elsewhere."""
    kind, name, options = key
    obj = _built(kind, name, dict(options))
    flags = BEFORE[key]
    expected = CAPS[kind](**flags)
    assert isinstance(obj.capabilities, CAPS[kind]), f"{kind} {name}: not declared"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        got = READ[kind](obj)
        if kind == "method":  # read from the factory too, before the run is built
            assert READ[kind](get(kind, name)) == expected
    assert got == expected
    # what is declared is what the flags decided: none left at a default by accident
    for flag, value in flags.items():
        assert getattr(got, flag) == (frozenset(value) if flag == "requires" else value)


def _fresh(name: str, bases: tuple[type, ...] = (), **attrs: Any) -> type:
    # a class of its own per test: the message is given once per plug-in and process
    return type(f"{name}_{id(attrs)}", bases, {"__module__": "my_plugin", **attrs})


def test_loose_flags_of_a_plug_in_are_translated_with_one_message(caplog):
    old = _fresh("OldRule", requires={"start_losses"}, linear=1, dp_mean=False)()
    with caplog.at_level(logging.WARNING, logger="fedloom"), \
            pytest.warns(DeprecationWarning, match=r"^aggregator my_plugin\.OldRule_\d+ "
                                                   r"declares the loose flags requires, "
                                                   r"linear, dp_mean; declare capabilities"):
        caps = aggregator_caps(old)
    assert caps == AggregatorCaps(requires=frozenset({"start_losses"}), linear=True)
    (record,) = caplog.records  # and logged, in one line
    assert "\n" not in record.getMessage() and "my_plugin.OldRule_" in record.getMessage()
    with warnings.catch_warnings():  # once: the next read says nothing
        warnings.simplefilter("error", DeprecationWarning)
        assert aggregator_caps(old) == caps
    # every kind, and a method's factory function
    for read, obj, want in [
        (compressor_caps, _fresh("Comp", linear=True)(), CompressorCaps(linear=True)),
        (feedback_caps, _fresh("Fb", schedule="theory", row_only=True)(),
         FeedbackCaps(schedule="theory", row_only=True)),
        (backend_caps, _fresh("Back", ships_indices=True)(), BackendCaps(ships_indices=True)),
    ]:
        with pytest.warns(DeprecationWarning, match="declares the loose flags"):
            assert read(obj) == want

    def factory() -> None: ...
    factory.model_buffers = "local"  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match=r"^method .*factory declares"):
        assert method_caps(factory) == MethodCaps(model_buffers="local")


def test_a_plug_in_without_flags_has_the_defaults_silently():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert aggregator_caps(_fresh("Plain")()) == AggregatorCaps()
        assert backend_caps(object()) == BackendCaps()


def test_a_loose_flag_below_a_declaration_overrides_it():
    """A plug-in's subclass of a built-in that still sets a flag keeps its meaning
    (privacy then refuses it as before); the built-in's own option of the same name
    (SA-PEF's ``schedule``, FedAvg's ``weighted``) agrees and says nothing."""
    from fedloom.compress.feedback import ErrorFeedback, NoFeedback

    sub = _fresh("ResettingEF", (ErrorFeedback,), row_only=False)()
    with pytest.warns(DeprecationWarning, match=r"row_only; declare"):
        assert feedback_caps(sub) == FeedbackCaps(row_only=False)
    probing = _fresh("Probing", (NoFeedback,), schedule="theory")()
    with pytest.warns(DeprecationWarning, match="schedule"):
        assert probing.probes_smoothness  # as with the loose flag before
    declared = _fresh("New", (NoFeedback,), capabilities=FeedbackCaps(row_only=False))()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert feedback_caps(declared) == FeedbackCaps(row_only=False)


def test_capabilities_of_another_type_are_refused():
    bad = _fresh("Bad", capabilities=CompressorCaps())()
    with pytest.raises(TypeError, match=r"^aggregator my_plugin\.Bad_\d+: capabilities must "
                                        r"be a AggregatorCaps, got CompressorCaps"):
        aggregator_caps(bad)


def test_the_rules_declare_requires_in_their_capabilities_only():
    """What a rule reads is its capabilities' ``requires`` (the Flower strategy reads
    it through aggregator_caps too); no loose ``requires`` attribute is left."""
    from fedloom import make_aggregator

    for name, opts, want in (("craft", {"targets": "loss"}, {"start_losses"}),
                             ("craft", {}, set()), ("qfedavg", {}, {"start_losses", "lr"}),
                             ("afl", {}, {"start_losses"}), ("fedfv", {}, {"start_losses"}),
                             ("fedlf", {}, {"start_losses"}), ("fednova", {}, {"steps"})):
        agg = make_aggregator(name, **opts)
        assert aggregator_caps(agg).requires == want
        assert not hasattr(agg, "requires")


# Flags that are capabilities (the dataclasses' fields) or fields of a type the
# engine holds (LocalSGD's amp and random_forward, Dataset's augment and classes),
# which it reads directly.
FLAGS = ({f for caps in CAPS.values() for f in caps.__dataclass_fields__}
         | {"amp", "random_forward", "augment", "classes"})


def _probes(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            found.append((node.lineno, node.args[1].value))
    return found


def test_the_engine_probes_no_capability_flag_by_name():
    """``getattr(obj, "linear", False)`` and the like: only the readers in
    fedloom.capabilities look a loose flag up."""
    files = [*sorted((SRC / "engine").rglob("*.py")), SRC / "privacy.py"]
    bad = [f"{p.relative_to(SRC)}:{line}: {name}" for p in files
           for line, name in _probes(p) if name in FLAGS]
    assert not bad, "capability flags probed by name:\n" + "\n".join(bad)


def test_the_engine_looks_nothing_up_by_name():
    """No ``getattr``/``hasattr`` in ``fedloom.engine`` at all: what it once probed on a
    component is a capability field, a protocol member, or read by one of the
    functions of fedloom.capabilities."""
    bad = [f"{p.relative_to(SRC)}:{node.lineno}" for p in sorted((SRC / "engine").rglob("*.py"))
           for node in ast.walk(ast.parse(p.read_text(), str(p)))
           if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
           and node.func.id in ("getattr", "hasattr")]
    assert not bad, "getattr/hasattr in the engine:\n" + "\n".join(bad)


class _PlainBackend:
    """A plug-in backend written as a plain class: no capabilities, name or close()."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def train_cohort(self, jobs):  # takes no on_result: it does not stream
        return self.inner.train_cohort(jobs)


class _PlainCompressor:
    """A plug-in compressor without capabilities (the identity's bytes)."""

    name = "plain"
    checksum = True

    def __init__(self) -> None:
        from fedloom.compress.identity import Identity

        self.inner = Identity()

    def encode(self, x, *, gen=None):
        return self.inner.encode(x, gen=gen)

    def decode(self, payload, d=None):
        return self.inner.decode(payload, d)


def test_a_plug_in_without_the_new_fields_has_their_defaults():
    """What the engine's probes answered for a plug-in that had none of it: no
    streaming, rows that would need shared memory, no worker threads, decode then
    copy; its own ``close()`` and ``name`` where it has them, else nothing to stop and
    the config's name. Silently."""
    from fedloom.capabilities import backend_close, backend_name, model_vmap

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert backend_caps(_PlainBackend(None)) == BackendCaps(
            ships_indices=False, streams=False, writes_rows=False, shared_rows=True,
            worker_threads=None)
        assert compressor_caps(_PlainCompressor()) == CompressorCaps(decode_into=False)
    assert backend_name(_PlainBackend(None), "mine") == "mine"
    assert backend_close(_PlainBackend(None))() is None
    closed: list[bool] = []

    class Closing(_PlainBackend):
        name = "closing"

        def close(self) -> None:
            closed.append(True)

    closing = Closing(None)
    backend_close(closing)()
    assert closed == [True] and backend_name(closing, "mine") == "closing"
    module = torch.nn.Linear(2, 2)
    assert model_vmap(module)
    module.fedloom_vmap = False  # a model that torch.func may not batch
    assert not model_vmap(module)


def test_the_probed_attributes_of_an_old_plug_in_are_translated():
    """A plug-in that set the attributes the engine probed before they were fields
    (``streams = True``, a ``decode_into`` method) keeps their meaning, with the one
    deprecation message."""
    old = _fresh("OldStreaming", streams=True, writes_rows=True, shared_rows=False,
                 worker_threads=2)()
    with pytest.warns(DeprecationWarning, match="streams, writes_rows, shared_rows, "
                                                "worker_threads; declare"):
        assert backend_caps(old) == BackendCaps(streams=True, writes_rows=True,
                                                shared_rows=False, worker_threads=2)
    into = _fresh("OldInto", (_PlainCompressor,), decode_into=lambda self, p, out: out)()
    with pytest.warns(DeprecationWarning, match=r"decode_into; declare .*decode_into=True"):
        assert compressor_caps(into) == CompressorCaps(decode_into=True)


def test_auto_reads_the_chosen_caps():
    """``backend: auto`` has the chosen backend's streaming, rows and worker threads,
    never ``ships_indices`` (its jobs carry their samples); none before the choice."""
    from fedloom.engine.trainers.auto import AutoBackend
    from fedloom.engine.trainers.backends import SequentialBackend
    from fedloom.engine.trainers.parallel import ProcessBackend

    auto = AutoBackend.__new__(AutoBackend)
    auto.chosen = None
    assert backend_caps(auto) == BackendCaps()
    auto.chosen = SequentialBackend.__new__(SequentialBackend)
    assert backend_caps(auto) == BackendCaps(streams=True, writes_rows=True, shared_rows=False)
    auto.chosen = ProcessBackend.__new__(ProcessBackend)
    auto.chosen.worker_threads = 3
    assert backend_caps(auto) == BackendCaps(streams=True, writes_rows=True, worker_threads=3)


def _rounds(exp: Any, n: int = 2) -> Any:
    st = exp.init()
    try:
        for _ in range(n):
            st, _ = exp.round(st)
    finally:
        exp.close()
    return st


def test_the_engine_honours_a_plug_in_backends_declared_fields(tiny):
    """A plain plug-in backend runs without streaming (its ``train_cohort`` takes no
    sink), is closed without a ``close()`` and named by the config; one that declares
    ``streams`` and ``writes_rows`` gets the early uplink's sink, with rows in this
    process's memory where it says ``shared_rows=False``. Both give the built-in's
    model, bit for bit."""
    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment
    from fedloom.engine.runs.loop import run_facts
    from fedloom.engine.runs.summary import summarize

    cfg = load_config(tiny, ["dtype=float64"])
    ref = _rounds(Experiment.from_config(cfg))
    plain = Experiment.from_config(cfg)
    plain.backend = _PlainBackend(plain.backend)
    st = _rounds(plain)
    assert torch.equal(st.w, ref.w)
    assert summarize(run_facts(plain), st, [])["backend"] == "sequential"  # the config's name
    assert "worker_threads" not in summarize(run_facts(plain), st, [])

    sinks: list[Any] = []

    class Streaming(_PlainBackend):
        capabilities = BackendCaps(streams=True, writes_rows=True, shared_rows=False)

        def train_cohort(self, jobs, on_result=None):
            sinks.append(on_result)
            return self.inner.train_cohort(jobs, on_result=on_result)

    streaming = Experiment.from_config(cfg)
    streaming.backend = Streaming(streaming.backend)
    assert torch.equal(_rounds(streaming).w, ref.w)
    assert len(sinks) == 2 and all(s is not None and not s.rows.is_shared() for s in sinks)


class _Counting(_PlainCompressor):
    """The identity's bytes, counting how the server decodes them."""

    def __init__(self, decode_into: bool) -> None:
        super().__init__()
        self.capabilities = CompressorCaps(pure=True, decode_into=decode_into)
        self.calls = {"decode": 0, "decode_into": 0}

    def decode(self, payload, d=None):
        self.calls["decode"] += 1
        return super().decode(payload, d)

    def decode_into(self, payload, out):
        self.calls["decode_into"] += 1
        return self.inner.decode_into(payload, out)


@pytest.mark.parametrize("backend", ["sequential", "lockstep"])
def test_the_engine_decodes_into_the_row_where_a_compressor_declares_it(tiny, backend):
    """``decode_into`` is used where the compressor declares it (the early uplink's
    decode with the streaming sequential backend, receive's with lock-step), and
    ``decode`` then a copy where it does not, though the method is there; the same
    model either way."""
    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment
    from fedloom.engine.objects import Components

    cfg = load_config(tiny, ["dtype=float64", f"backend={backend}"])
    ws = []
    for into in (True, False):
        comp = _Counting(into)
        ws.append(_rounds(Experiment.from_config(cfg, components=Components(compressor=comp))).w)
        used = "decode_into" if into else "decode"
        assert comp.calls[used] == 2 * tiny["cohort"]["size"], comp.calls
        assert comp.calls["decode" if into else "decode_into"] == 0, comp.calls
    assert torch.equal(ws[0], ws[1])
