"""Measured against estimated memory, for the layer classes with a
registered estimator rule.

A probe is a small model of parallel branches, each a Dense "carrier" (so
that gradients flow into the probed layer's input) and the layer, their
outputs added, trained a step at two batch sizes and two branch counts
with TensorFlow's BFC allocator statistics. The peak's difference over
both (per example, per branch) is what one more call of the layer costs
at the peak: weights, their gradients and the optimizer's state do not
grow with the batch, and the loss does not grow with the branches, so
they cancel. The estimate is `graphckpt.estimate(model)` per example,
differenced the same way.

A branch's per-example bytes are small beside the allocator's noise for
the flat layers (activations, elementwise merges, dropout on 512
features): their figures move by +/-0.5 of their in+out bytes from run to
run, so this is a benchmark, read over repeated runs, not a test.

Usage (a fresh process: the allocator is set before TensorFlow is
imported; about 4 minutes for all):
    python benchmarks/rule_probes.py OUT.json [NAME...]
    python benchmarks/rule_probes.py --show OUT.json
"""

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.layer_probes import SHAPES, probes  # noqa: E402  (the probe table the tests use)

BATCHES = (32, 96)
COPIES = (2, 6)

def build(name, spec, copies):
    """The probe model for one spec: `copies` parallel branches, each a
    Dense carrier (two for a two-input layer) and the layer, their outputs
    added. Everything a branch keeps for backward is alive at once."""
    import keras
    from keras import layers as L

    kind, factory, call = (*spec, "one")[:3]
    shape = SHAPES[kind]
    inp = keras.Input(shape, dtype="int32" if kind == "ids" else "float32")
    outs = []
    for _ in range(copies):
        layer = factory()
        if kind == "ids":
            outs.append(layer(inp))
            continue
        a = L.Dense(shape[-1])(inp)
        if call == "two":
            outs.append(layer([a, L.Dense(shape[-1])(inp)]))
        elif call == "pair":
            outs.append(layer(a, L.Dense(shape[-1])(inp)))
        elif call == "add":  # added to its input, as position embeddings are
            outs.append(L.Add()([a, layer(a)]))
        else:
            outs.append(layer(a))
    return keras.Model(inp, L.Add()(outs), name=name.replace(".", "_"))


def measure_one(model, batch, rng):
    """Peak bytes of a training step above what was allocated before it
    (BFC statistics; the smaller of two steps, after two warm-up steps)."""
    import tensorflow as tf

    shape = tuple(model.inputs[0].shape[1:])
    if model.inputs[0].dtype.startswith("int"):
        x = rng.integers(0, 100, size=(batch,) + shape).astype("int32")
    else:
        x = rng.normal(size=(batch,) + shape).astype("float32")
    y = rng.normal(size=(batch,) + tuple(model.outputs[0].shape[1:])).astype("float32")
    x, y = tf.constant(x), tf.constant(y)
    for _ in range(2):
        model.train_on_batch(x, y)
    peaks = []
    for _ in range(2):
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        model.train_on_batch(x, y)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    return min(peaks)


def main(out_path, names=None):
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import numpy as np
    import tensorflow as tf

    import graphckpt

    # One op at a time: what a backward pass keeps, not how the executor
    # happens to overlap ops (which moves small peaks from run to run).
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rng = np.random.default_rng(0)
    results = {}
    for name, spec in probes().items():
        if (names and name not in names) or name.startswith("op."):  # ops: tests/test_rule_saved_bytes.py
            continue
        try:
            measured, estimated = [], []
            for copies in COPIES:
                model = build(name, spec, copies)
                model.compile(optimizer="sgd", loss="mse")
                small, large = (measure_one(model, b, rng) for b in BATCHES)
                measured.append((large - small) / (BATCHES[1] - BATCHES[0]))
                estimated.append(graphckpt.estimate(model).baseline_peak_bytes)
            probed = type(spec[1]())
            layer = next(l for l in model.layers if type(l) is probed)
            extra = COPIES[1] - COPIES[0]
            results[name] = {
                "class": f"{type(layer).__module__}.{type(layer).__qualname__}",
                "measured": (measured[1] - measured[0]) / extra,
                "estimated": (estimated[1] - estimated[0]) / extra,
                # Per example: the layer's float inputs and its outputs.
                "io_bytes": sum(
                    4 * math.prod(t.shape[1:]) for t in layer._inbound_nodes[0].input_tensors + [layer.output]
                    if "float" in t.dtype
                ),
                "rule": next(c.rule for c in graphckpt.estimate(model).calls if c.node[0] == layer.name),
            }
        except Exception as e:  # noqa: BLE001 - reported per probe
            results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


def show(path):
    """One line per probe: measured and estimated bytes per example and per
    branch, and their difference in units of the layer's in+out bytes."""
    with open(path) as f:
        results = json.load(f)
    for name, r in results.items():
        if "error" in r:
            print(f"{name:36s} error: {r['error'][:120]}")
            continue
        diff = (r["measured"] - r["estimated"]) / r["io_bytes"]
        print(f"{name:36s} measured {r['measured']:9.0f}  estimated {r['estimated']:9.0f}  {diff:+6.2f} x in+out  {r['rule']}")


if __name__ == "__main__":
    if sys.argv[1] == "--show":
        show(sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2:] or None)
