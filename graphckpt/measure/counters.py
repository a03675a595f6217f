"""Memory counters: the peak bytes of one training step, per backend and device.

Each counter is a `Counter`: `start()` just before the step returns the bytes
in use, `peak()` just after returns the most bytes in use during it. The
figure a measurement reports is `peak() - start()`.

- **CPU, any backend: the process's resident set** (`"rss"`). The kernel's
  high-water mark is reset by writing `5` to `/proc/self/clear_refs`, and
  read as `VmHWM` from `/proc/self/status` after the step; the start is
  `VmRSS`, once it has stopped changing (JAX frees a step's temporaries
  on another thread after its outputs are ready). RSS follows tensor lifetimes only when the allocator returns
  freed blocks to the kernel, so the measuring child runs with
  `MALLOC_MMAP_THRESHOLD_=65536` (glibc mmaps, and unmaps on free, every
  block above 64 KiB) and, for TensorFlow, `TF_ENABLE_ONEDNN_OPTS=0`
  (oneDNN's allocator keeps freed blocks). Cross-checked against
  torch.profiler, XLA's `memory_analysis()` and TensorFlow's BFC
  statistics (tests/test_measure_counters.py).
- **TensorFlow on the CPU, by default: the BFC allocator's statistics**
  (`"allocator"`), with `TF_CPU_ALLOCATOR_USE_BFC=true`: they count tensors
  only, not the Python heap or thread stacks.
- **GPU: the device allocator's statistics** (`"allocator"`):
  `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`;
  JAX's `memory_stats()["peak_bytes_in_use"]`, which cannot be reset, so it
  is the process's peak (the warm-up steps ran the same step);
  `tf.config.experimental.get_memory_info("GPU:0")` after
  `reset_memory_stats`.

The cyclic garbage collector is never forced between steps: reference
cycles that keep tensors alive are what users pay for, so they must show.
"""

import dataclasses
from collections.abc import Callable

__all__ = ["Counter", "COUNTERS", "counter_for", "child_environment"]

COUNTERS = ("auto", "rss", "allocator")


@dataclasses.dataclass(frozen=True)
class Counter:
    """How one measurement reads memory.

    Attributes:
        start: called just before a step; returns the bytes in use.
        peak: called just after it; returns the most bytes in use during it.
        method: a description, stored in `Measurement.memory_method`.
    """

    start: Callable[[], int]
    peak: Callable[[], int]
    method: str


def child_environment(backend, counter):
    """The environment variables the measuring child needs *before* it
    imports `backend`, for `counter` (one of `COUNTERS`, as asked for: on a
    GPU the variables for the CPU counters are harmless)."""
    env = {}
    rss = counter == "rss" or (counter == "auto" and backend != "tensorflow")
    if rss:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        if backend == "tensorflow":
            env["TF_ENABLE_ONEDNN_OPTS"] = "0"
    elif backend == "tensorflow":
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    if backend == "jax":
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # allocate as needed
    return env


def resolve(backend, device, counter):
    """`"auto"` -> the counter used by default: the allocator's on a GPU and
    for TensorFlow (BFC) on the CPU, RSS for JAX and PyTorch on the CPU."""
    if counter != "auto":
        return counter
    return "allocator" if device == "gpu" or backend == "tensorflow" else "rss"


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}: RSS counting needs Linux")


def _settle_rss(quiet_s=0.05, timeout_s=2.0, poll_s=0.002):
    """Waits until VmRSS has not changed for `quiet_s` (at most `timeout_s`).

    JAX's CPU runtime frees an execution's temporary buffers on another
    thread, just *after* the outputs are ready: `block_until_ready` returns
    while the step's activations are still mapped. A step whose start read
    them would report only the few MiB above them (docs/benchmarks.md, "JAX
    and PyTorch, side by side with their native peers")."""
    import time

    last, since = _status_kib("VmRSS"), time.monotonic()
    deadline = since + timeout_s
    while True:
        time.sleep(poll_s)
        now, rss = time.monotonic(), _status_kib("VmRSS")
        if rss != last:
            last, since = rss, now
        elif now - since >= quiet_s or now >= deadline:
            return


def rss_counter():
    """The resident-set counter (CPU, Linux); see the module docstring.
    `start()` first waits until the RSS has settled (`_settle_rss`)."""

    def start():
        _settle_rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return _status_kib("VmRSS")

    return Counter(
        start=start,
        peak=lambda: _status_kib("VmHWM"),
        method="process RSS: VmHWM after the step - VmRSS before it, high-water mark reset through "
        "/proc/self/clear_refs, MALLOC_MMAP_THRESHOLD_=65536",
    )


def _tf_counter(device):
    import tensorflow as tf

    def start():
        tf.config.experimental.reset_memory_stats(device)
        return tf.config.experimental.get_memory_info(device)["current"]

    return Counter(
        start=start,
        peak=lambda: tf.config.experimental.get_memory_info(device)["peak"],
        method=f"tf.config.experimental.get_memory_info({device!r})['peak'] - ['current'] after "
        "reset_memory_stats, per train_on_batch step" + (", TF_CPU_ALLOCATOR_USE_BFC=true" if device == "CPU:0" else ""),
    )


def _torch_gpu_counter():
    import torch

    def start():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak():
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    return Counter(start, peak, "torch.cuda.max_memory_allocated() - memory_allocated() after reset_peak_memory_stats()")


def _jax_gpu_counter():
    import jax

    gpu = jax.devices()[0]
    return Counter(
        start=lambda: gpu.memory_stats()["bytes_in_use"],
        peak=lambda: gpu.memory_stats()["peak_bytes_in_use"],
        method="jax device.memory_stats(): peak_bytes_in_use (process peak) - bytes_in_use before the step",
    )


def counter_for(backend, device, counter="auto"):
    """The `Counter` for `backend` on `device` (`"cpu"` or `"gpu"`).

    Args:
        backend: `"tensorflow"`, `"jax"` or `"torch"`.
        device: `"cpu"` or `"gpu"`.
        counter: one of `COUNTERS`.

    Returns:
        A `Counter`.

    Raises:
        ValueError: `"rss"` asked for on a GPU (host RSS does not see device memory).
    """
    counter = resolve(backend, device, counter)
    if counter == "rss":
        if device == "gpu":
            raise ValueError("counter='rss' counts host memory; on a GPU use 'allocator' or 'auto'")
        return rss_counter()
    if backend == "tensorflow":
        return _tf_counter("GPU:0" if device == "gpu" else "CPU:0")
    if device == "cpu":
        raise ValueError(f"{backend} keeps no allocator statistics on the CPU; use counter='rss' or 'auto'")
    return _torch_gpu_counter() if backend == "torch" else _jax_gpu_counter()
