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

BATCHES = (32, 96)
COPIES = (2, 6)

# Input shapes (without the batch) by kind.
SHAPES = {
    "flat": (64, 128),  # elementwise layers: rank 3 keeps the carrier small
    "vec": (512,),
    "seq": (32, 64),
    "img": (16, 16, 32),
    "vol": (8, 8, 8, 16),
    "seq_img1": (8, 16, 16),  # ConvLSTM1D: time, length, channels
    "seq_img2": (6, 8, 8, 8),
    "seq_img3": (4, 6, 6, 6, 4),
    "ids": (32,),
}


def probes():
    """name -> (input kind, layer factory, how the layer is called: "one"
    on the carrier's output, "two" on two carriers' outputs, "pair" as
    `layer(a, b)`)."""
    import keras
    from keras import layers as L

    p = {
        "Dense": ("flat", lambda: L.Dense(128)),
        "EinsumDense": ("seq", lambda: L.EinsumDense("btd,de->bte", output_shape=(32, 64))),
        "Conv1D": ("seq", lambda: L.Conv1D(64, 3, padding="same")),
        "Conv2D": ("img", lambda: L.Conv2D(32, 3, padding="same")),
        "Conv3D": ("vol", lambda: L.Conv3D(16, 3, padding="same")),
        "Conv1DTranspose": ("seq", lambda: L.Conv1DTranspose(64, 3, padding="same")),
        "Conv2DTranspose": ("img", lambda: L.Conv2DTranspose(32, 3, padding="same")),
        "Conv3DTranspose": ("vol", lambda: L.Conv3DTranspose(16, 3, padding="same")),
        "DepthwiseConv1D": ("seq", lambda: L.DepthwiseConv1D(3, padding="same")),
        "DepthwiseConv2D": ("img", lambda: L.DepthwiseConv2D(3, padding="same")),
        "SeparableConv1D": ("seq", lambda: L.SeparableConv1D(64, 3, padding="same")),
        "SeparableConv2D": ("img", lambda: L.SeparableConv2D(32, 3, padding="same")),
        "MultiHeadAttention": ("seq", lambda: L.MultiHeadAttention(4, 16), "pair"),
        "GroupQueryAttention": ("seq", lambda: L.GroupQueryAttention(16, 4, 2), "pair"),
        "Attention": ("seq", lambda: L.Attention(), "two"),
        "AdditiveAttention": ("seq", lambda: L.AdditiveAttention(), "two"),
        "LSTM": ("seq", lambda: L.LSTM(64, return_sequences=True)),
        "GRU": ("seq", lambda: L.GRU(64, return_sequences=True)),
        "SimpleRNN": ("seq", lambda: L.SimpleRNN(64, return_sequences=True)),
        "ConvLSTM1D": ("seq_img1", lambda: L.ConvLSTM1D(16, 3, padding="same", return_sequences=True)),
        "ConvLSTM2D": ("seq_img2", lambda: L.ConvLSTM2D(8, 3, padding="same", return_sequences=True)),
        "ConvLSTM3D": ("seq_img3", lambda: L.ConvLSTM3D(4, 3, padding="same", return_sequences=True)),
        "Bidirectional": ("seq", lambda: L.Bidirectional(L.LSTM(32, return_sequences=True))),
        "TimeDistributed": ("seq", lambda: L.TimeDistributed(L.Dense(64))),
        "Dropout": ("flat", lambda: L.Dropout(0.5)),
        "SpatialDropout1D": ("seq", lambda: L.SpatialDropout1D(0.5)),
        "SpatialDropout2D": ("img", lambda: L.SpatialDropout2D(0.5)),
        "SpatialDropout3D": ("vol", lambda: L.SpatialDropout3D(0.5)),
        "AlphaDropout": ("flat", lambda: L.AlphaDropout(0.5)),
        "GaussianDropout": ("flat", lambda: L.GaussianDropout(0.5)),
        "BatchNormalization": ("img", lambda: L.BatchNormalization()),
        "LayerNormalization": ("seq", lambda: L.LayerNormalization()),
        "GroupNormalization": ("img", lambda: L.GroupNormalization(4)),
        "UnitNormalization": ("seq", lambda: L.UnitNormalization()),
        "RMSNormalization": ("seq", lambda: L.RMSNormalization()),
        "ReLU": ("flat", lambda: L.ReLU()),
        "ELU": ("flat", lambda: L.ELU()),
        "Softmax": ("seq", lambda: L.Softmax()),
        "Activation": ("flat", lambda: L.Activation("gelu")),
        "Add": ("flat", lambda: L.Add(), "two"),
        "Subtract": ("flat", lambda: L.Subtract(), "two"),
        "Average": ("flat", lambda: L.Average(), "two"),
        "Concatenate": ("flat", lambda: L.Concatenate(), "two"),
        "Multiply": ("flat", lambda: L.Multiply(), "two"),
        "Maximum": ("flat", lambda: L.Maximum(), "two"),
        "Minimum": ("flat", lambda: L.Minimum(), "two"),
        "Dot": ("seq", lambda: L.Dot(axes=(2, 2)), "two"),
        "Reshape": ("seq", lambda: L.Reshape((64, 32))),
        "Flatten": ("seq", lambda: L.Flatten()),
        "Permute": ("seq", lambda: L.Permute((2, 1))),
        "RepeatVector": ("vec", lambda: L.RepeatVector(3)),
        "Identity": ("flat", lambda: L.Identity()),
        "ZeroPadding1D": ("seq", lambda: L.ZeroPadding1D(2)),
        "ZeroPadding2D": ("img", lambda: L.ZeroPadding2D(2)),
        "ZeroPadding3D": ("vol", lambda: L.ZeroPadding3D(1)),
        "Cropping1D": ("seq", lambda: L.Cropping1D(2)),
        "Cropping2D": ("img", lambda: L.Cropping2D(2)),
        "Cropping3D": ("vol", lambda: L.Cropping3D(1)),
        "UpSampling1D": ("seq", lambda: L.UpSampling1D(2)),
        "UpSampling2D": ("img", lambda: L.UpSampling2D(2)),
        "UpSampling3D": ("vol", lambda: L.UpSampling3D(2)),
        "AveragePooling1D": ("seq", lambda: L.AveragePooling1D(2)),
        "AveragePooling2D": ("img", lambda: L.AveragePooling2D(2)),
        "AveragePooling3D": ("vol", lambda: L.AveragePooling3D(2)),
        "GlobalAveragePooling1D": ("seq", lambda: L.GlobalAveragePooling1D()),
        "GlobalAveragePooling2D": ("img", lambda: L.GlobalAveragePooling2D()),
        "GlobalAveragePooling3D": ("vol", lambda: L.GlobalAveragePooling3D()),
        "MaxPooling1D": ("seq", lambda: L.MaxPooling1D(2)),
        "MaxPooling2D": ("img", lambda: L.MaxPooling2D(2)),
        "MaxPooling3D": ("vol", lambda: L.MaxPooling3D(2)),
        "GlobalMaxPooling1D": ("seq", lambda: L.GlobalMaxPooling1D()),
        "GlobalMaxPooling2D": ("img", lambda: L.GlobalMaxPooling2D()),
        "GlobalMaxPooling3D": ("vol", lambda: L.GlobalMaxPooling3D()),
        "GaussianNoise": ("flat", lambda: L.GaussianNoise(0.5)),
        "Rescaling": ("img", lambda: L.Rescaling(0.5)),
        "Resizing": ("img", lambda: L.Resizing(12, 12)),
        "CenterCrop": ("img", lambda: L.CenterCrop(12, 12)),
        "Embedding": ("ids", lambda: L.Embedding(100, 64)),
        "Masking": ("flat", lambda: L.Masking()),
        "ActivityRegularization": ("flat", lambda: L.ActivityRegularization(l1=0.01)),
        "PReLU": ("flat", lambda: L.PReLU()),
        "LeakyReLU": ("flat", lambda: L.LeakyReLU()),
        "Normalization": ("flat", lambda: L.Normalization(mean=0.0, variance=1.0)),
    }
    if hasattr(L, "ReversibleEmbedding"):
        p["ReversibleEmbedding"] = ("ids", lambda: L.ReversibleEmbedding(100, 64))
    try:
        import keras_hub  # noqa: F401
        from keras_hub.src.layers.modeling import (
            position_embedding,
            rms_normalization,
            rotary_embedding,
        )
        from keras_hub.src.layers.modeling import token_and_position_embedding as tpe
        from keras_hub.src.models.llama.llama_attention import LlamaAttention
    except ImportError:
        return p
    p["keras_hub.RMSNormalization"] = ("seq", lambda: rms_normalization.RMSNormalization(64))
    p["keras_hub.PositionEmbedding"] = ("seq", lambda: position_embedding.PositionEmbedding(32), "add")
    p["keras_hub.RotaryEmbedding"] = ("seq", lambda: rotary_embedding.RotaryEmbedding())
    p["keras_hub.TokenAndPositionEmbedding"] = ("ids", lambda: tpe.TokenAndPositionEmbedding(100, 32, 64))
    p["keras_hub.LlamaAttention"] = ("seq", lambda: LlamaAttention(4, 2, rope_max_wavelength=10000))
    del keras
    return p


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
        if names and name not in names:
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
