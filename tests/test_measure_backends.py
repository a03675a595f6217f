"""graphckpt.measure on JAX and PyTorch: runs in a fresh process, with
memory read from the process RSS on the CPU and the allocator on a GPU."""

import os

import pytest

from graphckpt.measure import measure, measure_backend
from tests import measure_builders as mb

CHAIN = {"depth": 8, "width": 256}
FAST = {"steps": 2, "warmup": 1, "timeout": 300}


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_cpu_run_reports_time_and_rss_memory(backend):
    kwargs = dict(backend=backend, batch_size=256, builder_kwargs=CHAIN, device="cpu", **FAST)
    base = measure(mb.chain, method="baseline", **kwargs)
    ck = measure(mb.chain, method="graphckpt", **kwargs)
    for m in (base, ck):
        assert m.ok, m.error
        assert m.device == f"{backend}:CPU:0" and m.info["backend"] == backend and m.info[backend]
        assert m.memory_method.startswith("process RSS") and len(m.step_peak_bytes) == 2
        assert m.step_time_s > 0 and len(m.step_times_s) == 2 and m.info["pid"] != os.getpid()
    assert ck.num_segments >= 2 and base.num_segments == 0
    # Backprop through the chain keeps its 8 layer outputs (256 x 64 floats each).
    assert base.peak_bytes >= 0.9 * CHAIN["depth"] * 256 * CHAIN["width"] * 4


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_the_batch_is_converted_before_the_measured_steps(backend):
    # As fit's data pipelines do: a step handed NumPy arrays would convert
    # them inside the measured step, and count the 64 MiB batch in its peak.
    m = measure(mb.wide_input, method="baseline", backend=backend, batch_size=256, device="cpu", **FAST)
    assert m.ok, m.error
    assert m.resident_bytes > 256 * 65536 * 4
    assert m.peak_bytes < 0.25 * 256 * 65536 * 4


def test_rss_on_a_gpu_is_refused():
    with pytest.raises(ValueError, match="counter='rss' counts host memory"):
        measure(mb.chain, backend="torch", batch_size=2, device="gpu", counter="rss")


def test_tensorflow_and_bad_devices_are_refused():
    with pytest.raises(ValueError, match="backend=.*tensorflow.*Tip: for TensorFlow, call `measure`"):
        measure_backend(mb.chain, backend="tensorflow", batch_size=2)
    with pytest.raises(ValueError, match="device="):
        measure_backend(mb.chain, backend="jax", batch_size=2, device="tpu")


def test_a_failed_child_is_reported():
    m = measure_backend(mb.broken, backend="torch", batch_size=2, check=False, builder_kwargs={"message": "kaput"}, **FAST)
    assert not m.ok and m.phase == "build" and "kaput" in m.error


def _torch_gpu():
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.skipif(not _torch_gpu(), reason="needs a CUDA GPU visible to PyTorch")
def test_gpu_counter_sees_graphckpt_lower_the_peak():
    kwargs = dict(backend="torch", batch_size=1024, builder_kwargs={"depth": 32, "width": 1024}, device="gpu", **FAST)
    base = measure_backend(mb.chain, method="baseline", **kwargs)
    ck = measure_backend(mb.chain, method="graphckpt", **kwargs)
    assert base.peak_bytes > 32 * 1024 * 1024 * 4  # at least the 32 kept activations
    assert ck.peak_bytes < base.peak_bytes
