"""The measuring child process: rebuilds the model from its recipe, trains
it for a few steps under one backend, and writes a `Measurement` as JSON.

Run as `python -c "from graphckpt.measure.child import main; main(spec, out)"`
by `graphckpt.measure.measure`, with the environment its memory counter
needs (graphckpt/measure/counters.py) set before any backend is imported.
"""

import json
import os
import re
import statistics
import subprocess
import time
import traceback

from graphckpt.measure.counters import counter_for
from graphckpt.measure.recipes import load
from graphckpt.measure.records import failed, from_spec


def _source_fingerprint(package_dir):
    """Which graphckpt code ran: a hash of its .py files, subpackages
    included, and, in a git checkout, the commit and whether the package
    had uncommitted changes (an editable install picks up whatever the tree
    holds right now)."""
    import hashlib

    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(package_dir):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")  # a fixed order
        for name in sorted(n for n in files if n.endswith(".py")):
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                digest.update(os.path.relpath(path, package_dir).encode() + b"\0" + f.read())
    out = {"sha256": digest.hexdigest()[:12]}
    try:
        git = ["git", "-C", package_dir]
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(git + ["status", "--porcelain", "."], capture_output=True, text=True, timeout=10)
            out["git_head"] = head.stdout.strip()
            out["uncommitted_changes"] = bool(dirty.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def _random_batch(model, batch_size, seed, input_shape=None):
    """Random inputs and targets for `model`: shaped by `input_shape` (the
    outputs' shapes follow from it), else like the model's inputs and
    outputs, with size 1 for unknown dimensions."""
    import keras
    import numpy as np

    from graphckpt.graph.build import functional_of

    rng = np.random.default_rng(seed)
    # A Sequential's own `input` exists only once it has been called; its
    # inner functional model has them as soon as it is built.
    inputs, outputs = functional_of(model).input, functional_of(model).output
    if input_shape is not None:
        from graphckpt.graph.build import build_graph
        from graphckpt.graph.shapes import parse_input_shape

        shapes, _ = parse_input_shape(build_graph(model), input_shape, batch_size)
        flat = [keras.KerasTensor(s, dtype=t.dtype) for s, t in zip(shapes, keras.tree.flatten(inputs))]
        inputs = keras.tree.pack_sequence_as(inputs, flat)
        outputs = model.compute_output_spec(inputs)

    def one(t):
        shape = (batch_size,) + tuple(d if d is not None else 1 for d in t.shape[1:])
        dtype = keras.backend.standardize_dtype(t.dtype)
        if "int" in dtype or dtype == "bool":
            return rng.integers(0, 2, size=shape).astype(dtype)
        return rng.standard_normal(size=shape).astype("float32")

    x = keras.tree.map_structure(one, inputs)
    y = keras.tree.map_structure(one, outputs)
    return x, y


def _build_model(spec):
    import keras

    recipe, kwargs = spec["builder"], spec["builder_kwargs"]
    if recipe.endswith(".keras"):
        import graphckpt

        graphckpt.load_api()  # registers graphckpt's classes: the file may hold them
        return lambda: keras.saving.load_model(recipe, compile=False, **kwargs)
    fn = load(recipe)
    return lambda: fn(**kwargs)


def _transform(spec, build):
    method = spec["method"]
    if method == "baseline":
        return build()
    if method == "graphckpt":
        import graphckpt

        return graphckpt.checkpoint_model(build(), **spec["checkpoint_kwargs"])
    return load(method)(build, **spec["method_kwargs"])



_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _describe(e):
    msg = " ".join(_ANSI.sub("", str(e)).split())
    if len(msg) > 600:
        msg = msg[:600] + " ..."
    where = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    loc = f" (at {os.path.basename(where[0].filename)}:{where[0].lineno})" if where else ""
    return f"{type(e).__name__}: {msg}{loc}"


class _Failed(Exception):
    def __init__(self, phase, error):
        super().__init__(error)
        self.phase, self.error = phase, error


class _Phase:
    """Names the phase any exception inside it came from."""

    name = "setup"

    def __call__(self, name):
        self.name = name
        return self

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and not isinstance(exc, _Failed):
            raise _Failed(self.name, _describe(exc)) from exc
        return False



def _versions(backend):
    import platform

    import keras
    import numpy as np

    import graphckpt

    module = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}[backend]
    return {
        "backend": backend,
        backend: __import__(module).__version__,
        "python": platform.python_version(),
        "keras": keras.__version__,
        "numpy": np.__version__,
        "graphckpt": graphckpt.__version__,
        "graphckpt_source": _source_fingerprint(os.path.dirname(graphckpt.__file__)),
        "platform": platform.platform(),
        "pid": os.getpid(),
    }


def _device(backend, wanted, threads):
    """`"cpu"` or `"gpu"`: the GPU if the backend sees one and `wanted`
    allows it."""
    if backend == "tensorflow":
        import tensorflow as tf

        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
        has_gpu = bool(tf.config.list_physical_devices("GPU"))
    elif backend == "torch":
        import torch

        has_gpu = torch.cuda.is_available()
    else:
        import jax

        has_gpu = jax.default_backend() == "gpu"
    if wanted == "gpu" and not has_gpu:
        raise RuntimeError(f"device='gpu' was asked for, but {backend} sees no GPU")
    return "gpu" if has_gpu and wanted != "cpu" else "cpu"


def _device_name(backend, device):
    name = "GPU:0" if device == "gpu" else "CPU:0"
    return name if backend == "tensorflow" else f"{backend}:{name}"


def _batch(spec, model, backend, device):
    if spec["data"]:
        x, y = load(spec["data"])(model, spec["batch_size"])
    else:
        x, y = _random_batch(model, spec["batch_size"], spec["seed"], spec.get("input_shape"))
    return _on_device(backend, device, x), _on_device(backend, device, y)


def _on_device(backend, device, data):
    """`data` as the backend's tensors, converted before any measured step,
    as `fit`'s data pipelines hand them to the train step on every backend:
    a step handed NumPy arrays would convert them inside the measured step
    (on PyTorch and JAX, one more batch in its peak). On TensorFlow on
    `device`; on PyTorch and JAX on the backend's default device, where
    the model runs too."""
    import keras

    if backend == "tensorflow":
        import tensorflow as tf

        with tf.device(_device_name(backend, device)):
            return keras.tree.map_structure(tf.convert_to_tensor, data)
    return keras.tree.map_structure(keras.ops.convert_to_tensor, data)


def _finish(backend, model):
    """Waits until the last step has really finished. JAX dispatches
    asynchronously: the logs' host floats wait for the loss only, while the
    step's weight and optimizer updates may still run (and the previous
    step's buffers still be freed) when the next step's counter starts."""
    if backend == "jax":
        import jax

        optimizer = getattr(model, "optimizer", None)
        state = list(model.variables) + list(getattr(optimizer, "variables", []))
        jax.block_until_ready([v.value for v in state])


def _train(spec, model, x, y, counter):
    """Warm-up steps, then measured ones: (first step's time, peaks, the last
    resident bytes, wall times, CPU times)."""
    import numpy as np

    t0 = time.perf_counter()
    model.train_on_batch(x, y)
    first = time.perf_counter() - t0
    for _ in range(spec["warmup"] - 1):
        model.train_on_batch(x, y)
    peaks, times, cpu = [], [], []
    _finish(spec["backend"], model)  # each measured step ends with one too
    for _ in range(spec["steps"]):
        resident = counter.start()
        c0, t0 = time.process_time(), time.perf_counter()
        logs = model.train_on_batch(x, y, return_dict=True)
        _finish(spec["backend"], model)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        peaks.append(int(counter.peak() - resident))
    if not all(np.isfinite(float(v)) for v in logs.values()):
        raise FloatingPointError(f"non-finite training logs: {logs}")
    if resident == 0 and max(peaks) == 0:
        raise RuntimeError(f"the memory counter reports nothing ({counter.method})")
    return first, peaks, resident, times, cpu


def _run(spec, info, phase):
    backend = spec["backend"]
    with phase("setup"):
        import keras

        if keras.backend.backend() != backend:
            raise RuntimeError(f"KERAS_BACKEND is {keras.backend.backend()}, expected {backend}")
        if backend == "tensorflow" and spec["counter"] != "rss" and os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") != "true":
            raise RuntimeError("TF_CPU_ALLOCATOR_USE_BFC must be set before TensorFlow is imported")
        info.update(_versions(backend))
        device = _device(backend, spec["device"], spec["threads"])
        counter = counter_for(backend, device, spec["counter"])
        keras.utils.set_random_seed(spec["seed"])
    with phase("build"):
        build = _build_model(spec)
        model = build() if spec["method"] == "baseline" else None
    with phase("transform"):
        if model is None:
            model = _transform(spec, build)
        if not isinstance(model, keras.Model):
            raise TypeError(f"the method returned {type(model).__name__}, not a keras.Model")
    with phase("data"):
        x, y = _batch(spec, model, backend, device)
    with phase("compile"):
        model.compile(optimizer=spec["optimizer"], loss=spec["loss"], jit_compile=spec["jit_compile"])
    with phase("train"):
        first, peaks, resident, times, cpu = _train(spec, model, x, y, counter)
    if spec.get("crosscheck"):
        with phase("crosscheck"):
            from graphckpt.measure.crosscheck import independent_peak

            info["crosscheck"] = independent_peak(model, x, y)
    return _measurement(spec, model, info, _device_name(backend, device), counter.method, peaks, resident, times, cpu, first)


def _measurement(spec, model, info, device, memory_method, peaks, resident, times, cpu, first):
    """The `Measurement` of a successful run."""
    from graphckpt.runtime.segment import Segment

    return from_spec(
        spec,
        ok=True,
        device=device,
        memory_method=memory_method,
        peak_bytes=max(peaks),
        step_peak_bytes=tuple(peaks),
        resident_bytes=int(resident),
        step_time_s=statistics.median(times),
        step_times_s=tuple(times),
        first_step_s=first,
        step_cpu_s=statistics.median(cpu),
        model_name=model.name,
        num_layers=len(model.layers),
        num_segments=sum(isinstance(layer, Segment) for layer in model.layers),
        num_params=int(model.count_params()),
        info=info,
    )


def main(spec_path, out_path):
    """Runs one measurement; writes a `Measurement` as JSON to `out_path`."""
    with open(spec_path) as f:
        spec = json.load(f)
    info = {k: spec[k] for k in ("builder_kwargs", "checkpoint_kwargs", "method_kwargs", "optimizer", "loss")}
    phase = _Phase()
    try:
        result = _run(spec, info, phase)
    except _Failed as e:
        result = failed(spec, e.phase, e.error, info)
    except BaseException as e:  # noqa: BLE001 - everything is reported
        result = failed(spec, phase.name, _describe(e), info)
    with open(out_path, "w") as f:
        json.dump(result.to_dict(), f)
