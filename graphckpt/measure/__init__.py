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
  most bytes in use during one training step minus the bytes in use just
  before it (weights, optimizer slots, the batch), on every backend. The
  counter (graphckpt/measure/counters.py): on the CPU the process's RSS
  high-water mark for JAX and PyTorch, TensorFlow's BFC allocator
  statistics for TensorFlow (RSS on request); on a GPU the device
  allocator's statistics. The child's environment is set for its counter
  before the backend is imported. The figure reported is the largest over
  the measured steps; each step's figure is kept too.
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

Layout: `run.py` (this parent side: `measure`, `compare`), `child.py` (the
child process), `counters.py` (memory counters), `crosscheck.py`
(independent counters for tests), `recipes.py`, `records.py`.

Timings on a shared machine are noisy: compare ratios from one run, take
medians of repeats (`compare` alternates the two models for that reason).
"""

from graphckpt.measure.records import Comparison, Measurement, MeasurementError, format_bytes
from graphckpt.measure.run import compare, measure, measure_backend

__all__ = ["Measurement", "Comparison", "MeasurementError", "measure", "compare", "format_bytes", "measure_backend"]
