"""Native peers of graphckpt on PyTorch and JAX, measured like `graphckpt.measure`.

The network is the Dense chain of `benchmarks/families.py:dense_chain`
without Keras: `depth` x Linear(width, width) + tanh, then Linear(width,
outputs), trained with SGD (learning rate 0.01, Keras's default) on MSE.

- **torch**: an `nn.Sequential` of `Linear, Tanh, ..., Linear` and
  `torch.optim.SGD`, a step in the order of Keras's torch trainer (forward,
  `zero_grad`, backward, `opt.step()`); `checkpoint=True` runs it through
  `torch.utils.checkpoint.checkpoint_sequential(model, segments, x,
  use_reentrant=False)`.
- **jax**: a pure-JAX MLP; the training step (loss, `jax.grad`, the SGD
  update) is one `jax.jit`, with the parameters donated as Keras's JAX
  trainer donates its state; `checkpoint=True` wraps each of `segments`
  groups of consecutive hidden layers in `jax.checkpoint`.

`segments` defaults to round(sqrt(depth)).

Each measurement runs in a fresh child process started with the
environment `graphckpt.measure` gives its own children
(`graphckpt.measure.counters.child_environment(backend, "rss")`, CPU only)
and reads memory with the same counter (`rss_counter`: VmHWM after the
step minus VmRSS before it, the high-water mark reset through
/proc/self/clear_refs) in the same sequence as graphckpt/measure/child.py:
warm-up steps, a wait for the device, then per measured step
`counter.start()`, the step, a wait for the device, `counter.peak()`. The
cyclic GC is not forced.

    python benchmarks/native_peers.py torch --depth 32 [--checkpoint]
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def default_segments(depth):
    return max(1, round(math.sqrt(depth)))


def _torch_step(spec):
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint_sequential

    torch.manual_seed(spec["seed"])
    depth, width = spec["depth"], spec["width"]
    mods = []
    for _ in range(depth):
        mods += [nn.Linear(width, width), nn.Tanh()]
    model = nn.Sequential(*mods, nn.Linear(width, spec["outputs"]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.MSELoss()
    g = torch.Generator().manual_seed(spec["seed"])
    x = torch.randn(spec["batch_size"], width, generator=g)
    y = torch.randn(spec["batch_size"], spec["outputs"], generator=g)
    segments = spec["segments"]

    def step():
        # The order of Keras's torch trainer (keras/src/backend/torch/trainer.py
        # `train_step`): forward, then `zero_grad()` frees the previous step's
        # gradients, then backward. Zeroing first would free the gradients
        # (the size of the weights) before the forward pass, and hide the
        # activations below the step's starting RSS.
        if spec["checkpoint"]:
            out = checkpoint_sequential(model, segments, x, use_reentrant=False)
        else:
            out = model(x)
        opt.zero_grad()  # set_to_none=True, as nn.Module.zero_grad in Keras's trainer
        loss = loss_fn(out, y)
        loss.backward()
        opt.step()
        return float(loss)

    info = {"torch": torch.__version__, "num_threads": torch.get_num_threads(), "modules": len(model)}
    return step, (lambda: None), info


def _jax_step(spec):
    import jax
    import jax.numpy as jnp
    import numpy as np

    depth, width, outputs = spec["depth"], spec["width"], spec["outputs"]
    rng = np.random.default_rng(spec["seed"])

    def glorot(n_in, n_out):
        lim = math.sqrt(6.0 / (n_in + n_out))
        return jnp.asarray(rng.uniform(-lim, lim, size=(n_in, n_out)).astype("float32"))

    hidden = [(glorot(width, width), jnp.zeros((width,), "float32")) for _ in range(depth)]
    head = (glorot(width, outputs), jnp.zeros((outputs,), "float32"))
    params = {"hidden": hidden, "head": head}
    x = jnp.asarray(rng.standard_normal((spec["batch_size"], width)).astype("float32"))
    y = jnp.asarray(rng.standard_normal((spec["batch_size"], outputs)).astype("float32"))

    def layers(ps, h):
        for w, b in ps:
            h = jnp.tanh(h @ w + b)
        return h

    segments = spec["segments"]
    # Equal groups of consecutive layers (the first ones take the remainder).
    bounds = [round(i * depth / segments) for i in range(segments + 1)]

    def forward(p, h):
        if spec["checkpoint"]:
            for lo, hi in zip(bounds, bounds[1:]):
                h = jax.checkpoint(layers)(p["hidden"][lo:hi], h)
        else:
            h = layers(p["hidden"], h)
        w, b = p["head"]
        return h @ w + b

    def loss(p, x, y):
        return jnp.mean((forward(p, x) - y) ** 2)

    def train_step(p, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        return value, jax.tree_util.tree_map(lambda v, g: v - 0.01 * g, p, grads)

    jitted = jax.jit(train_step, donate_argnums=0)
    state = {"params": params}

    def step():
        value, state["params"] = jitted(state["params"], x, y)
        return value

    def finish():
        jax.block_until_ready(state["params"])

    info = {"jax": jax.__version__, "jaxlib_backend": jax.default_backend(), "groups": bounds}

    def analyse():
        # After the measured steps: the optimized HLO's matmuls (the forward
        # has depth + 1; each recompute kept by XLA adds to the count).
        avals = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (params, x, y))
        text = jitted.lower(*avals).compile().as_text()
        info["optimized_hlo_dots"] = sum(1 for ln in text.splitlines() if " dot(" in ln)

    info["analyse"] = analyse
    return step, finish, info


def run(spec):
    """Measures one native run in this process (started with the right
    environment); returns a JSON-friendly record like a `Measurement`'s."""
    import numpy as np

    from graphckpt.measure.counters import rss_counter

    counter = rss_counter()
    make = _torch_step if spec["backend"] == "torch" else _jax_step
    step, finish, info = make(spec)
    t0 = time.perf_counter()
    step()
    finish()
    first = time.perf_counter() - t0
    for _ in range(spec["warmup"] - 1):
        step()
    finish()
    peaks, times, cpu = [], [], []
    for _ in range(spec["steps"]):
        resident = counter.start()
        c0, t0 = time.process_time(), time.perf_counter()
        loss = step()
        finish()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        peaks.append(int(counter.peak() - resident))
    analyse = info.pop("analyse", None)
    if analyse is not None:
        analyse()
    if not np.isfinite(float(loss)):
        raise FloatingPointError(f"non-finite loss {loss}")
    return {
        "ok": True,
        "peak_bytes": max(peaks),
        "step_peak_bytes": peaks,
        "resident_bytes": int(resident),
        "step_time_s": statistics.median(times),
        "step_times_s": times,
        "step_cpu_s": statistics.median(cpu),
        "step_cpu_times_s": cpu,
        "first_step_s": first,
        "memory_method": counter.method,
        "info": dict(info, pid=os.getpid(), env={k: os.environ.get(k) for k in _ENV_KEYS}),
    }


_ENV_KEYS = ("MALLOC_MMAP_THRESHOLD_", "XLA_PYTHON_CLIENT_PREALLOCATE", "JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")


def child_env(backend):
    """The environment `graphckpt.measure` gives a CPU child of `backend`
    with the RSS counter (graphckpt/measure/run.py `_child_env`)."""
    from graphckpt.measure.counters import child_environment

    env = dict(os.environ)
    for name in ("TF_CPU_ALLOCATOR_USE_BFC", "MALLOC_MMAP_THRESHOLD_", "TF_ENABLE_ONEDNN_OPTS"):
        env.pop(name, None)
    env.update(child_environment(backend, "rss"))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["JAX_PLATFORMS"] = "cpu"
    paths = [p for p in sys.path if p]
    if ROOT not in paths:
        paths.insert(0, ROOT)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def measure_native(backend, *, depth, width=1024, outputs=1, batch_size=256, checkpoint=False, segments=None,
                   steps=4, warmup=2, seed=0, timeout=1800):
    """One native run in a fresh process; the record `run` returns, with
    the spec, or `ok=False` and the error."""
    spec = dict(backend=backend, depth=depth, width=width, outputs=outputs, batch_size=batch_size,
                checkpoint=bool(checkpoint), segments=segments or default_segments(depth),
                steps=steps, warmup=warmup, seed=seed)
    with tempfile.TemporaryDirectory(prefix="graphckpt-native-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        code = f"import sys; sys.path.insert(0, {HERE!r}); import native_peers; native_peers.main(sys.argv[1], sys.argv[2])"
        try:
            proc = subprocess.run([sys.executable, "-c", code, spec_path, out_path], env=child_env(backend),
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return dict(spec=spec, ok=False, error=f"timeout after {timeout} s")
        if os.path.exists(out_path):
            with open(out_path) as f:
                return dict(json.load(f), spec=spec)
        tail = " | ".join((proc.stderr or "").strip().splitlines()[-10:])
        return dict(spec=spec, ok=False, error=f"exit status {proc.returncode}, no result: {tail}")


def main(spec_path, out_path):
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        result = run(spec)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("backend", choices=("torch", "jax"))
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--checkpoint", action="store_true")
    p.add_argument("--segments", type=int, default=None)
    a = p.parse_args()
    r = measure_native(a.backend, depth=a.depth, width=a.width, batch_size=a.batch, checkpoint=a.checkpoint,
                       segments=a.segments)
    print(json.dumps({k: v for k, v in r.items() if k != "info"}, indent=1))
