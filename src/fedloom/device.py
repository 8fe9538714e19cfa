"""Where a run computes (``device``) and with how many threads (``backend.threads``).

``device: cpu | cuda | cuda:N | auto`` (top-level config key, default ``cpu``;
``auto`` is ``cuda`` when ``torch.cuda.is_available()``). :func:`resolve` turns
it into a ``torch.device``; asking for CUDA on a machine without it, or for
``cuda:N`` beyond the visible count, is a :class:`~fedloom.config.ConfigError`
naming ``device`` (the CLI exits 2).

On the device: the data, the model, ``w``, training, aggregation and compression;
in host memory: the per-client state store, the payload bytes and checkpoints.
:func:`configure` makes CUDA deterministic (a fixed cuBLAS workspace,
deterministic algorithms warn-only, cuDNN deterministic, TF32 off) and returns a
function that puts the flags back; :func:`apply_threads` sets
``backend.threads`` for the run (0 leaves the process's count). CPU against GPU:
not measured yet (``benchmarks/gpu_check.py``). Each setting and why:
docs/howto/gpu.md (Devices and threads in detail).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import resource
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CUBLAS_WORKSPACE", "apply_threads", "configure", "describe", "full_float32",
           "keep_freed_heap", "peak_memory_mb", "peak_rss_mb",
           "reset_peak", "resolve", "storage_use_count", "to_device", "to_host",
           "worker_threads"]

CUBLAS_WORKSPACE = ":4096:8"


def resolve(spec: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` → a ``torch.device``; raises
    :class:`~fedloom.config.ConfigError` naming ``device`` when it cannot be had."""
    from fedloom.config import ConfigError

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    name, _, index = spec.partition(":")
    if name != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"device: must be cpu, cuda, cuda:N or auto, got {spec!r}")
    if not torch.cuda.is_available():
        raise ConfigError(f"device: {spec!r} asked for, but CUDA is not available here "
                          f"(torch {torch.__version__}, built for CUDA "
                          f"{torch.version.cuda or 'none'}); use device=cpu or auto")
    n = torch.cuda.device_count()
    i = int(index) if index else torch.cuda.current_device()
    if i >= n:
        raise ConfigError(f"device: {spec!r} asked for, but {n} CUDA device"
                          f"{'s are' if n != 1 else ' is'} visible (cuda:0 … cuda:{n - 1})")
    _set_cublas_workspace()
    return torch.device("cuda", i)


def _set_cublas_workspace() -> None:
    # Read by cuBLAS when its handle is created, at the first CUDA matmul: set here,
    # before the run builds anything on the device. A deterministic value the user
    # set (:16:8 uses less memory) is kept.
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE


def configure(device: torch.device) -> Callable[[], None]:
    """Set the determinism and precision flags for ``device`` (see the module
    docstring); return a function restoring the previous ones. A no-op on CPU:
    CPU kernels are deterministic at a fixed thread count, and TF32 is a GPU format."""
    if device.type != "cuda":
        return lambda: None
    _set_cublas_workspace()
    old = (torch.are_deterministic_algorithms_enabled(),
           torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    undo_tf32 = full_float32()
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.cuda.set_device(device)

    def restore() -> None:
        torch.use_deterministic_algorithms(old[0], warn_only=old[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old[2:]
        undo_tf32()

    return restore


# The per-backend float32 precision switches of torch ≥ 2.9 ("ieee" = full float32);
# torch refuses to report the legacy global setting once the two APIs disagree, so
# the new one is used where it exists.
_FP32_SWITCHES = (("cuda", "matmul"), ("cudnn", "conv"), ("cudnn", "rnn"), ("mkldnn", "matmul"),
                  ("mkldnn", "conv"), ("mkldnn", "rnn"))


def full_float32() -> Callable[[], None]:
    """Turn off TF32 (and oneDNN's reduced float32) for matmuls and convolutions;
    return a function restoring the previous settings."""
    switches = []
    for backend, op in _FP32_SWITCHES:
        obj = getattr(getattr(torch.backends, backend, None), op, None)
        if obj is not None and hasattr(obj, "fp32_precision"):
            switches.append((obj, obj.fp32_precision))
    if switches:
        for obj, _ in switches:
            obj.fp32_precision = "ieee"

        def restore_new() -> None:
            for obj, value in switches:
                obj.fp32_precision = value

        return restore_new
    old = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
           torch.backends.cudnn.allow_tf32)  # pragma: no cover (torch < 2.9)
    torch.set_float32_matmul_precision("highest")  # pragma: no cover
    torch.backends.cuda.matmul.allow_tf32 = False  # pragma: no cover
    torch.backends.cudnn.allow_tf32 = False  # pragma: no cover

    def restore_old() -> None:  # pragma: no cover
        torch.set_float32_matmul_precision(old[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old[1:]

    return restore_old


def apply_threads(threads: int) -> tuple[int, Callable[[], None]]:
    """Set torch's intra-op threads to ``threads`` (0: leave the process's count);
    return the count used and a function restoring the previous count.

    Inter-op threads are left alone here: torch refuses to change them once
    any parallel work has run in the process, which a notebook may have done;
    fresh worker processes set them (:func:`worker_threads`)."""
    old = torch.get_num_threads()
    n = threads or old
    if n != old:
        torch.set_num_threads(n)
    return n, (lambda: torch.set_num_threads(old) if torch.get_num_threads() != old else None)


# glibc's mallopt parameters (<malloc.h>) and the largest mmap threshold it accepts
# on 64-bit (HEAP_MAX_SIZE / 2)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_MAX = 32 << 20
_KEPT: list[bool] = []


def keep_freed_heap() -> bool:
    """Keep the heap memory that training frees for the next step instead of
    handing it back to the kernel (glibc only; elsewhere nothing happens and this
    returns False). Returns whether the process's allocator now keeps it.

    A CPU training step frees its activations and gradients, and glibc hands the
    top of its heap back to the kernel once more than its trim threshold is free
    there, and serves blocks above its (moving) mmap threshold with fresh
    mappings; the next step then faults every page in again, zero-filled by the
    kernel. On the CIFAR-10 shape of the bench (50 clients, batch 10) that was
    about 340,000 minor faults a round over two worker processes and about 0.6 s
    of kernel time, and the two processes' faults and zero-fills compete for
    the memory bus: two plain-PyTorch processes took 1.60-1.84 s a round against
    one core's 3.0 s, and 1.47 s once their heap was kept. Here blocks up to
    32 MiB (glibc's largest threshold) come from the heap and the heap keeps up
    to 1 GiB free at its top; the cost is that a process's resident memory stays
    near its peak. Larger blocks are still mapped and unmapped each time."""
    if _KEPT:
        return _KEPT[0]
    ok = False
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
        import ctypes

        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            # mallopt returns 1 on success; setting either also turns off glibc's
            # dynamic threshold, which would move them again
            ok = (libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX) == 1
                  and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1)
        except (OSError, AttributeError):
            ok = False
    _KEPT.append(ok)
    return ok


def worker_threads(threads: int) -> int:
    """In a fresh worker process: ``threads`` (0: 1) intra-op threads and one
    inter-op thread (a worker runs one client at a time)."""
    n = threads or 1
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # parallel work already ran in this process: keep its pool
        pass
    return n


def describe(device: torch.device) -> dict[str, Any]:
    """``device``, ``device_name`` and ``device_memory_gb`` (total) for the summary."""
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"device": str(device), "device_name": p.name,
                "device_memory_gb": round(p.total_memory / 2**30, 2)}
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # pragma: no cover (non-POSIX)
        total = float("nan")
    return {"device": "cpu", "device_name": name, "device_memory_gb": round(total, 2)}


def reset_peak(device: torch.device) -> None:
    """Start counting the peak device memory of a run (CUDA; the CPU's peak RSS
    cannot be reset: it is the process's since it started)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mb(device: torch.device) -> tuple[float, str]:
    """Peak memory and what it measures: on CUDA ``torch.cuda.max_memory_allocated``
    since :func:`reset_peak` (tensors only, not the caching allocator's reserve);
    on the CPU the process's peak resident set size (``getrusage``, since the
    process started: it includes whatever ran before the run in the same process)."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) / 2**20,
                "torch.cuda.max_memory_allocated")
    return peak_rss_mb(), "peak RSS of the process (resource.getrusage)"


def peak_rss_mb() -> float:
    """The process's peak resident set size in MiB (``getrusage``'s ``ru_maxrss``:
    since the process started, whatever ran in it before)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def storage_use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage (every view of it holds one), from torch's
    private ``torch._C._storage_Use_Count`` (torch 2.x): probed here, with the other
    torch-version helpers, not where the count is used. Where a torch version lacks
    it, every buffer counts as still in use (a new one each time: as safe as a copy)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:  # pragma: no cover (present in torch 2.x)
        return 1 << 30
    return int(count(t.untyped_storage()._cdata))


def to_device(obj: Any, device: torch.device, *, pin: bool = False) -> Any:
    """``obj`` with every tensor in it (nested dicts, lists, tuples, dataclass
    fields) on ``device``; tensors already there are not copied. From the CPU to
    CUDA with ``pin``, host tensors are pinned first and copied asynchronously
    (the stream orders the copy before any kernel that reads it)."""
    if isinstance(obj, torch.Tensor):
        if obj.device == device:
            return obj
        if pin and device.type == "cuda" and obj.device.type == "cpu":
            return obj.pin_memory().to(device, non_blocking=True)
        return obj.to(device)
    # Containers and dataclasses are rebuilt only when something in them moved:
    # on the run's own device this returns ``obj`` itself.
    if isinstance(obj, dict):
        new = {k: to_device(v, device, pin=pin) for k, v in obj.items()}
        return obj if all(new[k] is obj[k] for k in obj) else new
    if isinstance(obj, list | tuple) and not hasattr(obj, "_fields"):
        items = [to_device(v, device, pin=pin) for v in obj]
        if all(a is b for a, b in zip(items, obj, strict=True)):
            return obj
        return items if isinstance(obj, list) else tuple(items)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: to_device(getattr(obj, f.name), device, pin=pin)
                   for f in dataclasses.fields(obj) if f.init}
        if all(changes[k] is getattr(obj, k) for k in changes):
            return obj
        return dataclasses.replace(obj, **changes)
    return obj


def to_host(obj: Any) -> Any:
    """``obj`` with every tensor in it on the CPU (for pickling, checkpoints)."""
    return to_device(obj, torch.device("cpu"))
