"""Measured peak training-step memory and step time, in a fresh process.

Contract:
- Every measurement runs in a **fresh Python subprocess**. The parent never
  builds the model: the child imports TensorFlow with the memory statistics
  it needs switched on, rebuilds the model from a *recipe*, trains it for a
  few steps, and reports. Nothing from an earlier measurement (allocator
  pools, traced functions, Keras name counters) leaks into the next.
- A recipe (`builder`) is one of:
    * `"package.module:function"`: an importable function that returns a
      built Keras model, called as `function(**builder_kwargs)`;
    * `"path/to/file.py:function"`: the same, loaded from a file;
    * a module-level function object (turned into one of the above);
    * `"path/to/model.keras"`: a saved model, loaded with
      `keras.saving.load_model`.
- Memory is the **peak training-step memory above the resident state**: the
  allocator's peak during one training step minus the bytes in use just
  before it (weights, optimizer slots, the batch). On CPU the child sets
  `TF_CPU_ALLOCATOR_USE_BFC=true` before TensorFlow is imported, so that
  `tf.config.experimental.get_memory_info("CPU:0")` reports real numbers;
  on a GPU it reads `"GPU:0"`. The figure reported is the largest over the
  measured steps; each step's figure is kept too.
- Time is the **median wall time of a training step** after `warmup` steps
  (the first of which traces and compiles), each step ending in a host sync.
- Results are plain data (`Measurement`, `Comparison`, both with
  `to_dict()`). Printing is left to the caller (the CLI, the benchmarks).

A training step is `model.train_on_batch(x, y)` after
`model.compile(optimizer, loss, jit_compile=...)`: what `fit` runs. The
batch is random, shaped from `model.inputs` and `model.outputs` (integer
inputs get values in [0, 2); unknown dimensions size 1, unless `input_shape`
gives them), unless a `data` recipe is given.

Methods (what is measured):
- `"baseline"`: the model as built.
- `"graphckpt"`: `graphckpt.checkpoint_model(model, **checkpoint_kwargs)`,
  so any keyword `checkpoint_model` accepts (`segments=`, `budget=`, ...)
  can be measured.
- any other recipe `"module:function"` / `"file.py:function"` / function:
  called as `transform(build, **method_kwargs)`, where `build()` builds the
  original model; it returns the model to train. Calling `build` itself
  lets a method wrap construction, as `keras.RematScope` requires.

Timings on a shared machine are noisy: compare ratios from one run, take
medians of repeats (`compare` alternates the two models for that reason).
"""

import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

from graphckpt.errors import GraphckptError

__all__ = ["Measurement", "Comparison", "MeasurementError", "measure", "compare", "format_bytes", "measure_backend"]

_BUILTIN_METHODS = ("baseline", "graphckpt")
_DEVICES = ("auto", "cpu", "gpu")


class MeasurementError(GraphckptError, RuntimeError):
    """A measurement failed; `.measurement` holds the failed record."""

    def __init__(self, message, measurement=None):
        super().__init__(message)
        self.measurement = measurement


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measured run of one model, built by one recipe, in one process.

    Attributes:
        label: a name for this run (defaults to `method`).
        method: `"baseline"`, `"graphckpt"`, or the transform's recipe.
        builder: the model recipe, as a string.
        ok: whether the run completed.
        error: `"ExceptionType: message"` when it did not, else None.
        phase: where it failed: `"build"`, `"transform"`, `"data"`,
            `"compile"`, `"train"`, `"subprocess"` or `"timeout"`.
        device: `"CPU:0"` or `"GPU:0"`.
        memory_method: how the memory figures were read.
        batch_size, steps, warmup, jit_compile: the run's settings.
        peak_bytes: peak training-step memory above the resident state
            (the largest over the measured steps).
        step_peak_bytes: that figure for each measured step.
        resident_bytes: bytes in use before the measured steps.
        step_time_s: median wall time of one training step.
        step_times_s: each measured step's wall time.
        step_cpu_s: median CPU time (all threads of the process) of one
            step; less sensitive than wall time to other load on the machine.
        first_step_s: the first warm-up step (tracing and compiling).
        model_name: the trained model's name.
        num_layers: `len(model.layers)` of the trained model.
        num_segments: how many graphckpt `Segment` layers it has.
        num_params: its parameter count.
        info: versions, pid, python, and the kwargs the run used.
    """

    label: str
    method: str
    builder: str
    ok: bool
    error: str | None = None
    phase: str | None = None
    device: str | None = None
    memory_method: str | None = None
    batch_size: int | None = None
    steps: int | None = None
    warmup: int | None = None
    jit_compile: bool | None = None
    peak_bytes: int | None = None
    step_peak_bytes: tuple = ()
    resident_bytes: int | None = None
    step_time_s: float | None = None
    step_times_s: tuple = ()
    first_step_s: float | None = None
    step_cpu_s: float | None = None
    model_name: str | None = None
    num_layers: int | None = None
    num_segments: int | None = None
    num_params: int | None = None
    info: dict = dataclasses.field(default_factory=dict, hash=False, compare=False)

    def to_dict(self):
        """Plain, JSON-friendly data."""
        d = dataclasses.asdict(self)
        d["step_peak_bytes"] = list(self.step_peak_bytes)
        d["step_times_s"] = list(self.step_times_s)
        return d

    @classmethod
    def from_dict(cls, data):
        names = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in names}
        data["step_peak_bytes"] = tuple(data.get("step_peak_bytes", ()))
        data["step_times_s"] = tuple(data.get("step_times_s", ()))
        return cls(**data)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A method against the baseline, measured alternately `repeats` times.

    Attributes:
        baseline: the baseline `Measurement`s, in run order.
        candidate: the method's `Measurement`s, in run order.
        peak_ratio: median over repeats of candidate peak / baseline peak
            (runs paired in order), or None if either side failed.
        time_ratio: the same for the median step time.
    """

    baseline: tuple
    candidate: tuple

    @property
    def ok(self):
        return all(m.ok for m in self.baseline + self.candidate)

    def _ratios(self, attr):
        pairs = [
            (getattr(c, attr), getattr(b, attr))
            for b, c in zip(self.baseline, self.candidate)
            if b.ok and c.ok and getattr(b, attr)
        ]
        return [c / b for c, b in pairs]

    @property
    def peak_ratio(self):
        r = self._ratios("peak_bytes")
        return statistics.median(r) if r else None

    @property
    def time_ratio(self):
        r = self._ratios("step_time_s")
        return statistics.median(r) if r else None

    def to_dict(self):
        return {
            "baseline": [m.to_dict() for m in self.baseline],
            "candidate": [m.to_dict() for m in self.candidate],
            "peak_ratio": self.peak_ratio,
            "time_ratio": self.time_ratio,
        }


def format_bytes(n):
    """`1536` -> `"1.5 KiB"`; None -> `"-"`."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


# --------------------------------------------------------------- recipes


def _recipe(obj, what):
    """A callable or recipe string -> a recipe string the child can load."""
    if isinstance(obj, (str, os.PathLike)):
        s = os.fspath(obj)
        if what == "builder" and s.endswith(".keras"):
            return os.path.abspath(s)
        if ":" not in s:
            raise ValueError(
                f"`{what}` must be 'module:function', 'file.py:function'"
                + (", a '.keras' path" if what == "builder" else "")
                + f" or a module-level function. Received: {what}={s!r}"
            )
        target, _, name = s.rpartition(":")
        if target.endswith(".py"):
            target = os.path.abspath(target)
        return f"{target}:{name}"
    if callable(obj):
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
        if module is None or "<" in qualname:
            raise ValueError(
                f"`{what}` must be importable by the child process: a "
                f"module-level function. Received: {what}={obj!r}. Tip: define "
                "it at the top level of a module, or pass 'module:function'."
            )
        if module == "__main__":
            path = getattr(sys.modules["__main__"], "__file__", None)
            if not path:
                raise ValueError(
                    f"`{what}`={obj!r} lives in an interactive `__main__` the "
                    "child cannot import. Tip: move it into a module file."
                )
            module = os.path.abspath(path)
        return f"{module}:{qualname}"
    raise TypeError(f"`{what}` must be a string recipe or a function. Received: {what}={obj!r}")


def _load(recipe):
    """Recipe string -> the callable it names (in the child)."""
    target, _, name = recipe.rpartition(":")
    if target.endswith(".py"):
        mod_name = "_graphckpt_recipe_" + os.path.splitext(os.path.basename(target))[0]
        spec = importlib.util.spec_from_file_location(mod_name, target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    obj = module
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


# --------------------------------------------------------------- parent side


def _child_env(device):
    env = dict(os.environ)
    env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["KERAS_BACKEND"] = "tensorflow"
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
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
        device: `"auto"` (GPU:0 if TensorFlow sees one, else CPU:0),
            `"cpu"` or `"gpu"`.
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
    if checkpoint_kwargs and method != "graphckpt":
        raise ValueError(
            f"`checkpoint_kwargs` applies to method='graphckpt' only. Received: "
            f"method={method!r}, checkpoint_kwargs={checkpoint_kwargs!r}"
        )
    method_recipe = method if method in _BUILTIN_METHODS else _recipe(method, "method")
    spec = {
        "builder": _recipe(builder, "builder"),
        "builder_kwargs": dict(builder_kwargs or {}),
        "method": method_recipe,
        "method_kwargs": dict(method_kwargs or {}),
        "checkpoint_kwargs": dict(checkpoint_kwargs or {}),
        "label": label or (method if isinstance(method, str) else method_recipe),
        "batch_size": batch_size,
        "steps": steps,
        "warmup": warmup,
        "jit_compile": bool(jit_compile),
        "optimizer": optimizer,
        "loss": loss,
        "data": _recipe(data, "data") if data is not None else None,
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


def _failed(spec, phase, error, info=None):
    return Measurement(
        label=spec["label"],
        method=spec["method"],
        builder=spec["builder"],
        ok=False,
        error=error,
        phase=phase,
        batch_size=spec["batch_size"],
        steps=spec["steps"],
        warmup=spec["warmup"],
        jit_compile=spec["jit_compile"],
        info=info or {},
    )


def _run_child(spec, timeout):
    with tempfile.TemporaryDirectory(prefix="graphckpt-measure-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        out_path = os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        cmd = [
            sys.executable,
            "-c",
            "import sys; from graphckpt.measure import _child_main; _child_main(sys.argv[1], sys.argv[2])",
            spec_path,
            out_path,
        ]
        try:
            proc = subprocess.run(
                cmd, env=_child_env(spec["device"]), capture_output=True, text=True, timeout=timeout
            )
        except subprocess.TimeoutExpired:
            return _failed(spec, "timeout", f"TimeoutError: no result after {timeout} s")
        if os.path.exists(out_path):
            with open(out_path) as f:
                return Measurement.from_dict(json.load(f))
        tail = (proc.stderr or "").strip().splitlines()[-15:]
        return _failed(
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


# --------------------------------------------------------------- child side


def _versions():
    import platform

    import keras
    import numpy as np
    import tensorflow as tf

    import graphckpt

    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "graphckpt": graphckpt.__version__,
        "graphckpt_source": _source_fingerprint(os.path.dirname(graphckpt.__file__)),
        "platform": platform.platform(),
        "pid": os.getpid(),
    }


def _source_fingerprint(package_dir):
    """Which graphckpt code ran: a hash of its .py files and, in a git
    checkout, the commit and whether the package had uncommitted changes
    (an editable install picks up whatever the tree holds right now)."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(os.listdir(package_dir)):
        if name.endswith(".py"):
            with open(os.path.join(package_dir, name), "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
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

    rng = np.random.default_rng(seed)
    inputs, outputs = model.input, model.output
    if input_shape is not None:
        from graphckpt.graph import build_graph
        from graphckpt.shapes import parse_input_shape

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
        return lambda: keras.saving.load_model(recipe, compile=False, **kwargs)
    fn = _load(recipe)
    return lambda: fn(**kwargs)


def _transform(spec, build):
    method = spec["method"]
    if method == "baseline":
        return build()
    if method == "graphckpt":
        import graphckpt

        return graphckpt.checkpoint_model(build(), **spec["checkpoint_kwargs"])
    return _load(method)(build, **spec["method_kwargs"])


def _child_main(spec_path, out_path):
    """Runs one measurement; writes a `Measurement` as JSON to `out_path`."""
    with open(spec_path) as f:
        spec = json.load(f)
    info = {
        "builder_kwargs": spec["builder_kwargs"],
        "checkpoint_kwargs": spec["checkpoint_kwargs"],
        "method_kwargs": spec["method_kwargs"],
        "optimizer": spec["optimizer"],
        "loss": spec["loss"],
    }
    phase = "setup"
    try:
        result = _child_run(spec, info, _Phase())
    except _Failed as e:
        result = _failed(spec, e.phase, e.error, info)
    except BaseException as e:  # noqa: BLE001 - everything is reported
        result = _failed(spec, phase, _describe(e), info)
    with open(out_path, "w") as f:
        json.dump(result.to_dict(), f)


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


def _child_run(spec, info, phase):
    if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC") != "true":
        raise RuntimeError("TF_CPU_ALLOCATOR_USE_BFC must be set before TensorFlow is imported")
    with phase("setup"):
        import keras
        import numpy as np
        import tensorflow as tf

        info.update(_versions())
        if spec["threads"]:
            tf.config.threading.set_intra_op_parallelism_threads(spec["threads"])
        gpus = tf.config.list_physical_devices("GPU")
        if spec["device"] == "gpu" and not gpus:
            raise RuntimeError("device='gpu' was asked for, but TensorFlow sees no GPU")
        device = "GPU:0" if gpus and spec["device"] != "cpu" else "CPU:0"
        keras.utils.set_random_seed(spec["seed"])
    with phase("build"):
        build = _build_model(spec)
        if spec["method"] == "baseline":
            model = build()
    with phase("transform"):
        if spec["method"] != "baseline":
            model = _transform(spec, build)
        if not isinstance(model, keras.Model):
            raise TypeError(f"the method returned {type(model).__name__}, not a keras.Model")
    with phase("data"):
        if spec["data"]:
            x, y = _load(spec["data"])(model, spec["batch_size"])
        else:
            x, y = _random_batch(model, spec["batch_size"], spec["seed"], spec.get("input_shape"))
        with tf.device(device):
            x = keras.tree.map_structure(tf.convert_to_tensor, x)
            y = keras.tree.map_structure(tf.convert_to_tensor, y)
    with phase("compile"):
        model.compile(optimizer=spec["optimizer"], loss=spec["loss"], jit_compile=spec["jit_compile"])
    with phase("train"):
        t0 = time.perf_counter()
        model.train_on_batch(x, y)
        first = time.perf_counter() - t0
        for _ in range(spec["warmup"] - 1):
            model.train_on_batch(x, y)
        peaks, times, cpu = [], [], []
        for _ in range(spec["steps"]):
            tf.config.experimental.reset_memory_stats(device)
            resident = tf.config.experimental.get_memory_info(device)["current"]
            c0, t0 = time.process_time(), time.perf_counter()
            logs = model.train_on_batch(x, y, return_dict=True)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            peak = tf.config.experimental.get_memory_info(device)["peak"]
            peaks.append(int(peak - resident))
        if not all(np.isfinite(v) for v in logs.values()):
            raise FloatingPointError(f"non-finite training logs: {logs}")
        if resident == 0 and max(peaks) == 0:
            raise RuntimeError(
                f"the allocator of {device} reports no statistics (is TF_CPU_ALLOCATOR_USE_BFC honoured?)"
            )
    memory_method = (
        f"tf.config.experimental.get_memory_info({device!r})['peak'] - ['current'] after "
        f"reset_memory_stats, per train_on_batch step"
        + (", TF_CPU_ALLOCATOR_USE_BFC=true" if device == "CPU:0" else "")
    )
    return _measurement(spec, model, info, device, memory_method, peaks, resident, times, cpu, first)


def _measurement(spec, model, info, device, memory_method, peaks, resident, times, cpu, first):
    """The `Measurement` of a successful run (`peaks` may be empty: no
    reliable memory counter)."""
    from graphckpt.segment import Segment

    return Measurement(
        label=spec["label"],
        method=spec["method"],
        builder=spec["builder"],
        ok=True,
        device=device,
        memory_method=memory_method,
        batch_size=spec["batch_size"],
        steps=spec["steps"],
        warmup=spec["warmup"],
        jit_compile=spec["jit_compile"],
        peak_bytes=max(peaks) if peaks else None,
        step_peak_bytes=tuple(peaks),
        resident_bytes=int(resident) if resident is not None else None,
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


# --------------------------------------------------------------- JAX and PyTorch
#
# Kept apart from the TensorFlow path above. Memory figures come only from
# counters that are reliable: the GPU allocators' own statistics. On the CPU,
# neither JAX nor PyTorch has an allocator counter that cross-checked (JAX's
# CPU client keeps no statistics; `compiled.memory_analysis()` gave
# implausible sizes; PyTorch's CPU allocator has none, its profiler's memory
# timeline did not balance, and process RSS was not reproducible step to
# step), so there `peak_bytes` is None and `memory_method` says why; the step
# time is still measured.

_OTHER_BACKENDS = ("jax", "torch")


def measure_backend(
    builder,
    *,
    backend,
    batch_size,
    method="baseline",
    builder_kwargs=None,
    checkpoint_kwargs=None,
    method_kwargs=None,
    label=None,
    steps=5,
    warmup=2,
    optimizer="sgd",
    loss="mse",
    device="auto",
    seed=0,
    timeout=600,
    check=True,
):
    """`measure` under the JAX or PyTorch backend, in a fresh process.

    Args:
        backend: `"jax"` or `"torch"` (`"tensorflow"`: use `measure`).
        device: `"auto"` (the backend's GPU if it sees one, else the CPU),
            `"cpu"` or `"gpu"`.
        The other arguments are `measure`'s.

    Returns:
        A `Measurement`. On a GPU, `peak_bytes` is the allocator's peak
        during a training step minus the bytes in use before it: PyTorch's
        `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`;
        JAX's `device.memory_stats()["peak_bytes_in_use"]`, which cannot be
        reset, so it is the process peak (the warm-up steps are the same
        step) minus `bytes_in_use`. On the CPU `peak_bytes` is None.

    Raises:
        MeasurementError: the child failed and `check` is true.
        ValueError: a bad `backend` or `device`.
    """
    if backend not in _OTHER_BACKENDS:
        raise ValueError(
            f"`backend` must be one of {_OTHER_BACKENDS}. Received: backend={backend!r}. "
            "Tip: for TensorFlow, call `measure`."
        )
    if device not in _DEVICES:
        raise ValueError(f"`device` must be one of {_DEVICES}. Received: device={device!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"`batch_size` must be a positive int. Received: batch_size={batch_size!r}")
    method_recipe = method if method in _BUILTIN_METHODS else _recipe(method, "method")
    spec = {
        "backend": backend,
        "builder": _recipe(builder, "builder"),
        "builder_kwargs": dict(builder_kwargs or {}),
        "method": method_recipe,
        "method_kwargs": dict(method_kwargs or {}),
        "checkpoint_kwargs": dict(checkpoint_kwargs or {}),
        "label": label or method_recipe,
        "batch_size": batch_size,
        "steps": steps,
        "warmup": warmup,
        "jit_compile": backend == "jax",
        "optimizer": optimizer,
        "loss": loss,
        "device": device,
        "seed": seed,
    }
    with tempfile.TemporaryDirectory(prefix="graphckpt-measure-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        env = _child_env(device)
        env["KERAS_BACKEND"] = backend
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # JAX: allocate as needed
        if device == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
        code = "import sys; from graphckpt.measure import _backend_child_main as m; m(*sys.argv[1:])"
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code, spec_path, out_path],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
            if os.path.exists(out_path):
                with open(out_path) as f:
                    result = Measurement.from_dict(json.load(f))
            else:
                tail = " | ".join((proc.stderr or "").strip().splitlines()[-15:])
                result = _failed(spec, "subprocess", f"ChildProcessError: exit status {proc.returncode}: {tail}")
        except subprocess.TimeoutExpired:
            result = _failed(spec, "timeout", f"TimeoutError: no result after {timeout} s")
    if check and not result.ok:
        raise MeasurementError(
            f"Measuring {result.label!r} on {backend} failed in phase {result.phase!r}: {result.error}", result
        )
    return result


def _backend_memory(backend, device):
    """(reset, read_resident, read_peak, description) for the GPU counters;
    None on the CPU, where no counter is reliable."""
    if device == "cpu":
        return None
    if backend == "torch":
        import torch

        def sync():
            torch.cuda.synchronize()

        return (
            lambda: (sync(), torch.cuda.reset_peak_memory_stats()),
            lambda: (sync(), torch.cuda.memory_allocated())[1],
            lambda: (sync(), torch.cuda.max_memory_allocated())[1],
            "torch.cuda.max_memory_allocated() - memory_allocated() after reset_peak_memory_stats()",
        )
    import jax

    gpu = jax.devices()[0]
    return (
        lambda: None,
        lambda: gpu.memory_stats()["bytes_in_use"],
        lambda: gpu.memory_stats()["peak_bytes_in_use"],
        "jax device.memory_stats(): peak_bytes_in_use (process peak) - bytes_in_use before the step",
    )


def _backend_child_main(spec_path, out_path):
    """The child of `measure_backend`: writes a `Measurement` as JSON."""
    with open(spec_path) as f:
        spec = json.load(f)
    info = {k: spec[k] for k in ("backend", "builder_kwargs", "checkpoint_kwargs", "method_kwargs")}
    phase = _Phase()
    try:
        with phase("setup"):
            import platform

            import keras
            import numpy as np

            import graphckpt

            backend = keras.backend.backend()
            if backend != spec["backend"]:
                raise RuntimeError(f"KERAS_BACKEND is {backend}, expected {spec['backend']}")
            if backend == "torch":
                import torch

                has_gpu, version = torch.cuda.is_available(), torch.__version__
            else:
                import jax

                has_gpu, version = jax.default_backend() == "gpu", jax.__version__
            if spec["device"] == "gpu" and not has_gpu:
                raise RuntimeError(f"device='gpu' was asked for, but {backend} sees no GPU")
            device = "gpu" if has_gpu and spec["device"] != "cpu" else "cpu"
            info.update(
                {
                    backend: version,
                    "keras": keras.__version__,
                    "graphckpt": graphckpt.__version__,
                    "python": platform.python_version(),
                    "pid": os.getpid(),
                }
            )
            counters = _backend_memory(backend, device)
            keras.utils.set_random_seed(spec["seed"])
        with phase("build"):
            build = _build_model(spec)
            model = build() if spec["method"] == "baseline" else None
        with phase("transform"):
            if model is None:
                model = _transform(spec, build)
        with phase("data"):
            x, y = _random_batch(model, spec["batch_size"], spec["seed"], spec.get("input_shape"))
        with phase("compile"):
            model.compile(optimizer=spec["optimizer"], loss=spec["loss"], jit_compile=spec["jit_compile"])
        with phase("train"):
            t0 = time.perf_counter()
            model.train_on_batch(x, y)
            first = time.perf_counter() - t0
            for _ in range(spec["warmup"] - 1):
                model.train_on_batch(x, y)
            peaks, times, cpu, resident = [], [], [], None
            for _ in range(spec["steps"]):
                if counters:
                    counters[0]()
                    resident = counters[1]()
                c0, t0 = time.process_time(), time.perf_counter()
                logs = model.train_on_batch(x, y, return_dict=True)  # returns host floats: a sync
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                if counters:
                    peaks.append(int(counters[2]() - resident))
            if not all(np.isfinite(float(v)) for v in logs.values()):
                raise FloatingPointError(f"non-finite training logs: {logs}")
        memory_method = counters[3] if counters else f"none: {backend} has no reliable allocator counter on the CPU"
        result = _measurement(
            spec, model, info, f"{backend}:{device.upper()}:0", memory_method, peaks, resident, times, cpu, first
        )
    except _Failed as e:
        result = _failed(spec, e.phase, e.error, info)
    except BaseException as e:  # noqa: BLE001 - everything is reported
        result = _failed(spec, phase.name, _describe(e), info)
    with open(out_path, "w") as f:
        json.dump(result.to_dict(), f)
