"""Independent peak counters, to cross-check the RSS counter (tests, and
benchmarks/jax_estimate.py for XLA's figure).

- PyTorch: `torch.profiler` with `profile_memory=True` over two training
  steps; the peak of the second, from its allocation and free events (the
  first misses the frees of blocks allocated before profiling started).
- JAX: XLA's own plan for the jitted train step,
  `jit(train_step).lower(state, data).compile().memory_analysis()`:
  its `temp_size_in_bytes`.
- TensorFlow: none here; its BFC statistics are the other counter
  (`counter="allocator"`, a run of its own: BFC pools freed memory, so RSS
  cannot be read in the same process).
"""

from graphckpt import keras_compat

__all__ = ["independent_peak"]


def _torch_profiler_peak(model, x, y):
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model.train_on_batch(x, y)
        with record_function("graphckpt_measured_step"):
            model.train_on_batch(x, y)
    step = next(e for e in prof.events() if e.name == "graphckpt_measured_step")
    results = prof.profiler.kineto_results
    origin = results.trace_start_ns()  # function events are in us from here
    start = origin + int(step.time_range.start * 1000)
    end = origin + int(step.time_range.end * 1000)
    deltas = sorted(
        (e.start_ns(), e.nbytes())
        for e in results.events()
        if e.name() == "[memory]" and start <= e.start_ns() <= end
    )
    level = peak = 0
    for _, delta in deltas:
        level += delta
        peak = max(peak, level)
    return {"bytes": int(peak), "method": "torch.profiler memory events, second of two profiled steps"}


def _jax_compiled_temp(model, x, y):
    import jax

    state = keras_compat.jax_state(model)
    # Donated state, as the Keras trainer compiles it: otherwise XLA may place
    # temporaries in the buffers of the new weights, and temp sizes shrink.
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, (x, y, None)).compile()
    return {
        "bytes": int(compiled.memory_analysis().temp_size_in_bytes),
        "method": "jit(train_step, donate_argnums=0).lower(...).compile().memory_analysis().temp_size_in_bytes",
    }


def independent_peak(model, x, y):
    """A second figure for one training step's peak, or None on TensorFlow.

    Returns:
        `{"bytes": int, "method": str}`, or None.
    """
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        return _torch_profiler_peak(model, x, y)
    if backend == "jax":
        return _jax_compiled_temp(model, x, y)
    return None
