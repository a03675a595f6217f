"""The parent side of a measurement: checks the arguments, starts a fresh
child process with the environment its memory counter needs, and reads back
its `Measurement` (graphckpt/measure/__init__.py states the contract)."""

import json
import os
import subprocess
import sys
import tempfile

from graphckpt.measure.counters import COUNTERS, child_environment
from graphckpt.measure.recipes import recipe_of
from graphckpt.measure.records import Comparison, Measurement, MeasurementError, failed

__all__ = ["measure", "compare", "measure_backend"]

_BUILTIN_METHODS = ("baseline", "graphckpt")
_DEVICES = ("auto", "cpu", "gpu")
_BACKENDS = ("tensorflow", "jax", "torch")


def _current_backend():
    return os.environ.get("KERAS_BACKEND") or "tensorflow"


def _child_env(spec):
    """This process's environment, with the child's backend, device and the
    variables its memory counter needs before the backend is imported."""
    backend, device = spec["backend"], spec["device"]
    env = dict(os.environ)
    for name in ("TF_CPU_ALLOCATOR_USE_BFC", "MALLOC_MMAP_THRESHOLD_", "TF_ENABLE_ONEDNN_OPTS"):
        env.pop(name, None)  # only what this counter asks for
    env.update(child_environment(backend, spec["counter"]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["KERAS_BACKEND"] = backend
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
        env["JAX_PLATFORMS"] = "cpu"
    # The child must import the same graphckpt and recipes as the parent.
    paths = [p for p in sys.path if p]
    if os.getcwd() not in paths:
        paths.insert(0, os.getcwd())
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def measure(
    builder,
    *,
    batch_size,
    method="baseline",
    builder_kwargs=None,
    checkpoint_kwargs=None,
    method_kwargs=None,
    label=None,
    steps=5,
    warmup=2,
    jit_compile=False,
    optimizer="sgd",
    loss="mse",
    data=None,
    input_shape=None,
    device="auto",
    backend=None,
    counter="auto",
    crosscheck=False,
    seed=0,
    threads=None,
    timeout=600,
    check=True,
):
    """Measures peak training-step memory and step time in a fresh process.

    Args:
        builder: the model recipe: `"module:function"`,
            `"path/file.py:function"`, a module-level function, or a
            `".keras"` path. The function returns a built Keras model.
        batch_size: examples per training step.
        method: `"baseline"`, `"graphckpt"`, or a transform recipe called as
            `transform(build, **method_kwargs)` that returns the model to
            train (`build()` builds the original).
        builder_kwargs: JSON-serializable keywords for the builder.
        checkpoint_kwargs: keywords for `graphckpt.checkpoint_model`
            (`segments=`, `budget=`, ...); `method="graphckpt"` only.
        method_kwargs: JSON-serializable keywords for a transform.
        label: a name for the record (default: `method`).
        steps: measured training steps (at least 1).
        warmup: unmeasured steps first (at least 1; the first traces).
        jit_compile: passed to `model.compile`.
        optimizer, loss: passed to `model.compile`.
        data: optional recipe `data(model, batch_size) -> (x, y)`; by
            default random arrays shaped like the model's inputs/outputs.
        input_shape: the shapes of the random batch's inputs, batch
            dimension included, as `graphckpt.plan` takes them (JSON-friendly:
            lists are fine); needed where the model's inputs have unknown
            dimensions, which otherwise get size 1. The outputs' shapes
            follow. Pass it in `checkpoint_kwargs` too, so the plan is made
            for the same shapes.
        device: `"auto"` (the backend's GPU if it sees one, else the CPU),
            `"cpu"` or `"gpu"`.
        backend: `"tensorflow"`, `"jax"` or `"torch"`: the Keras backend of
            the child (default: this process's).
        counter: how memory is read (graphckpt/measure/counters.py):
            `"auto"` (the device allocator's statistics on a GPU; on the CPU
            TensorFlow's BFC statistics, and the process RSS for JAX and
            PyTorch), `"rss"` (CPU only) or `"allocator"`.
        crosscheck: also read an independent counter after the measured
            steps (torch.profiler, XLA's memory analysis) into
            `info["crosscheck"]`; for tests.
        seed: seeds Keras, NumPy and TensorFlow in the child.
        threads: TensorFlow intra-op threads in the child (None: default).
        timeout: seconds before the child is killed.
        check: raise `MeasurementError` on failure (True), or return the
            failed `Measurement` with `ok=False` and its `error` (False).

    Returns:
        A `Measurement`.

    Raises:
        MeasurementError: the child failed, timed out, or crashed, and
            `check` is true. Its `.measurement` has the details.
        ValueError, TypeError: a bad argument (before any process starts).

    Example:
        >>> m = measure("benchmarks/families.py:dense_chain", batch_size=256,
        ...             method="graphckpt", builder_kwargs={"depth": 64})
        >>> m.peak_bytes, m.step_time_s
    """
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int. Received: batch_size={batch_size!r}")
    for name, value in (("steps", steps), ("warmup", warmup)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be an int >= 1. Received: {name}={value!r}")
    if device not in _DEVICES:
        raise ValueError(f"`device` must be one of {_DEVICES}. Received: device={device!r}")
    backend = backend or _current_backend()
    if backend not in _BACKENDS:
        raise ValueError(f"`backend` must be one of {_BACKENDS}. Received: backend={backend!r}")
    if counter not in COUNTERS:
        raise ValueError(f"`counter` must be one of {COUNTERS}. Received: counter={counter!r}")
    if counter == "rss" and device == "gpu":
        raise ValueError("counter='rss' counts host memory. Tip: on a GPU use counter='allocator' (or 'auto').")
    if checkpoint_kwargs and method != "graphckpt":
        raise ValueError(
            f"`checkpoint_kwargs` applies to method='graphckpt' only. Received: "
            f"method={method!r}, checkpoint_kwargs={checkpoint_kwargs!r}"
        )
    method_recipe = method if method in _BUILTIN_METHODS else recipe_of(method, "method")
    spec = {
        "backend": backend,
        "counter": counter,
        "crosscheck": bool(crosscheck),
        "builder": recipe_of(builder, "builder"),
        "builder_kwargs": dict(builder_kwargs or {}),
        "method": method_recipe,
        "method_kwargs": dict(method_kwargs or {}),
        "checkpoint_kwargs": dict(checkpoint_kwargs or {}),
        "label": label or (method if isinstance(method, str) else method_recipe),
        "batch_size": batch_size,
        "steps": steps,
        "warmup": warmup,
        # The JAX trainer always compiles here, as `fit` does by default.
        "jit_compile": bool(jit_compile) or backend == "jax",
        "optimizer": optimizer,
        "loss": loss,
        "data": recipe_of(data, "data") if data is not None else None,
        "input_shape": input_shape,
        "device": device,
        "seed": seed,
        "threads": threads,
    }
    json.dumps(spec)  # fail here, not in the child, on unserializable kwargs
    result = _run_child(spec, timeout)
    if check and not result.ok:
        raise MeasurementError(
            f"Measuring {result.label!r} of builder {result.builder!r} failed in "
            f"phase {result.phase!r}: {result.error}",
            result,
        )
    return result



def _run_child(spec, timeout):
    with tempfile.TemporaryDirectory(prefix="graphckpt-measure-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        out_path = os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        code = "import sys; from graphckpt.measure.child import main; main(sys.argv[1], sys.argv[2])"
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code, spec_path, out_path],
                env=_child_env(spec),
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return failed(spec, "timeout", f"TimeoutError: no result after {timeout} s")
        if os.path.exists(out_path):
            with open(out_path) as f:
                return Measurement.from_dict(json.load(f))
        tail = (proc.stderr or "").strip().splitlines()[-15:]
        return failed(
            spec,
            "subprocess",
            f"ChildProcessError: exit status {proc.returncode} and no result "
            f"(killed for memory?). stderr tail: {' | '.join(tail)}",
        )


def compare(
    builder,
    *,
    batch_size,
    method="graphckpt",
    repeats=3,
    checkpoint_kwargs=None,
    method_kwargs=None,
    check=True,
    **measure_kwargs,
):
    """Measures `method` against the baseline, alternating, `repeats` times.

    Runs baseline, method, baseline, method, ... each in a fresh process, so
    slow drift on a shared machine hits both sides alike. Ratios are medians
    of the paired per-repeat ratios.

    Args:
        builder: the model recipe (see `measure`).
        batch_size: examples per training step.
        method: the method to compare (see `measure`); default `"graphckpt"`.
        repeats: pairs of runs (at least 1).
        checkpoint_kwargs, method_kwargs: as for `measure`.
        check: raise `MeasurementError` when a run fails (True), or keep the
            failed `Measurement` in the result (False).
        **measure_kwargs: any other `measure` keyword (steps, warmup,
            jit_compile, builder_kwargs, device, timeout, ...).

    Returns:
        A `Comparison` with `peak_ratio` and `time_ratio`.

    Example:
        >>> c = compare("benchmarks/families.py:dense_chain", batch_size=256,
        ...             builder_kwargs={"depth": 64})
        >>> round(c.peak_ratio, 2), round(c.time_ratio, 2)
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"`repeats` must be an int >= 1. Received: repeats={repeats!r}")
    base, cand = [], []
    for _ in range(repeats):
        base.append(measure(builder, batch_size=batch_size, method="baseline", check=check, **measure_kwargs))
        cand.append(
            measure(
                builder,
                batch_size=batch_size,
                method=method,
                checkpoint_kwargs=checkpoint_kwargs,
                method_kwargs=method_kwargs,
                check=check,
                **measure_kwargs,
            )
        )
    return Comparison(baseline=tuple(base), candidate=tuple(cand))


def measure_backend(builder, *, backend, **kwargs):
    """`measure(builder, backend=backend, ...)`, kept for callers written
    before `measure` took `backend`.

    Raises:
        ValueError: `backend` is not `"jax"` or `"torch"` (for TensorFlow,
            call `measure`).
    """
    if backend not in ("jax", "torch"):
        raise ValueError(
            f"`backend` must be one of ('jax', 'torch'). Received: backend={backend!r}. "
            "Tip: for TensorFlow, call `measure`."
        )
    return measure(builder, backend=backend, **kwargs)
