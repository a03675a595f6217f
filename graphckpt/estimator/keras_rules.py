"""The estimator's rules for Keras's own layers and ops, registered in
`graphckpt.estimator.rules` when this module is imported (the estimator imports it),
and the lookup that also loads keras_hub's rules when one of its layers is
first met.

Rules follow what TensorFlow's gradient functions read, and were checked
with per-layer probes against measured peaks (see `docs/estimator.md`).
"""

from __future__ import annotations

import dataclasses
import math

import keras

from graphckpt import keras_compat
from graphckpt.estimator.rules import (
    SAVES_INPUT,
    SAVES_OUTPUT,
    LayerRule,
    activation_name,
    activation_rule,
    all_indices,
    attention_rule,
    elems,
    free_rule,
    is_float,
    itemsize,
    layer_norm_rule,
    register_builtin_rule,
    registered_rule,
    unknown_rule,
)

# ------------------------------------------------------------ Keras layers


def _kernel_flops(layer, outs, ins):
    """2 x multiply-adds of a kernel layer: each output element needs
    (kernel size / output features) multiply-adds."""
    kernel = getattr(layer, "kernel", None)
    if kernel is None or not outs:
        return 2.0 * sum(elems(o) for o in outs)
    kshape = tuple(kernel.shape)
    out_elems = elems(outs[0])
    if isinstance(layer, keras.layers.EinsumDense):
        eq = layer.equation.replace(" ", "")
        lhs, out_sub = eq.split("->")
        k_sub = lhs.split(",")[1]
        shared = math.prod(d for c, d in zip(k_sub, kshape) if c in out_sub)
        per_out = math.prod(kshape) / max(shared, 1)
    elif type(layer).__name__.endswith("Transpose"):
        # Each input element scatters into kernel_size x out_channels outputs.
        return 2.0 * elems(ins[0]) * math.prod(kshape[:-1]) if ins else 0.0
    elif isinstance(layer, (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)):
        per_out = math.prod(kshape[:-2])
    else:
        per_out = math.prod(kshape[:-1])
    flops = 2.0 * out_elems * per_out
    pointwise = getattr(layer, "pointwise_kernel", None)
    if pointwise is not None:  # separable convolutions
        flops += 2.0 * out_elems * math.prod(tuple(pointwise.shape)[:-1])
    return flops


def _matmul(layer, ins, outs):
    out_bytes = sum(o.nbytes for o in outs)
    saved_out, internal, suffix = activation_rule(activation_name(layer), 0, out_bytes)
    return LayerRule(all_indices(ins), saved_out, internal, _kernel_flops(layer, outs, ins), True, "matmul" + suffix)


def _separable(layer, ins, outs):
    """A depthwise then a pointwise convolution: the input and the
    depthwise output (read by the pointwise kernel's gradient) are kept."""
    rule = _matmul(layer, ins, outs)
    if not ins or not outs:
        return rule
    positions = elems(outs[0]) / (outs[0].shape[-1] or 1)
    depthwise = positions * (ins[0].shape[-1] or 1) * (getattr(layer, "depth_multiplier", 1) or 1)
    return dataclasses.replace(rule, internal=rule.internal + depthwise * itemsize(outs[0]))


def _attention(layer, ins, outs):
    """MultiHeadAttention (and subclasses: keras_hub's cached attention),
    GroupQueryAttention (fewer key/value heads than query heads)."""
    if isinstance(layer, keras.layers.MultiHeadAttention):
        key_dim = layer.key_dim or 1
        return attention_rule(ins, outs, layer.num_heads or 1, key_dim, layer.value_dim or key_dim)
    head_dim = getattr(layer, "head_dim", None) or 1
    heads = getattr(layer, "num_query_heads", None) or 1
    return attention_rule(ins, outs, heads, head_dim, kv_heads=getattr(layer, "num_key_value_heads", None))


def chunked_attention(layer, ins, outs, chunks):
    """A `MultiHeadAttention` call whose core runs in `chunks` chunks
    (`graphckpt.runtime.attention`; the graph marks it `attention_chunks`)."""
    key_dim = layer.key_dim or 1
    return attention_rule(
        ins, outs, layer.num_heads or 1, key_dim, layer.value_dim or key_dim, chunks=chunks, dropout=layer.dropout > 0,
        drawn_per_piece=keras.backend.backend() in ("tensorflow", "jax"),  # graphckpt.runtime.attention._DrawnPerPiece
    )


def _dot_attention(layer, ins, outs):
    """Attention (dot-product scores) and AdditiveAttention, whose scores
    come from tanh(query + key) over every (t, s) pair and feature: that
    T x S x dim tensor is kept (measured: `benchmarks/rule_probes.py`)."""
    q = elems(ins[0])
    t, s = ins[0].shape[1] or 1, ins[1].shape[1] if len(ins) > 1 and ins[1].shape[1] else 1
    scores = t * s
    internal = 2 * scores * itemsize(ins[0])
    if isinstance(layer, keras.layers.AdditiveAttention):
        internal += scores * (ins[0].shape[-1] or 1) * itemsize(ins[0])
    return LayerRule(all_indices(ins), frozenset(), internal, 4.0 * scores * (q / t), True, "attention")


# Step-sized buffers kept per time step: each step's gates and states, as
# TensorFlow's while loop keeps them for the backward pass (measured on
# TensorFlow 2.21 with `benchmarks/rule_probes.py`: LSTM 9-11, GRU 10-11,
# SimpleRNN 3-4, ConvLSTM 9-10 per step).
_RNN_BUFFERS = {"LSTM": 10, "GRU": 10, "SimpleRNN": 4, "ConvLSTM1D": 10, "ConvLSTM2D": 10, "ConvLSTM3D": 10}


def _rnn(layer, ins, outs):
    """A recurrent layer over `steps` time steps; a step's buffers have the
    size of one step of its output (units, or filters x the spatial
    positions of a ConvLSTM)."""
    kind = next((k.__name__ for k in type(layer).__mro__ if k.__name__ in _RNN_BUFFERS), "SimpleRNN")
    steps = ins[0].shape[1] or 1
    out = outs[0].shape if outs else ins[0].shape
    sequences = getattr(layer, "return_sequences", False) and len(out) > 2
    cell = getattr(layer, "cell", None)
    sizes = (getattr(obj, name, None) for obj in (layer, cell) for name in ("units", "filters"))
    units = next((size for size in sizes if size), out[-1] or 1)
    # Not the output's last dimension: a Bidirectional passes its merged output.
    spatial = math.prod(d or 1 for d in (out[2:-1] if sequences else out[1:-1]))
    step_elems = units * spatial
    per_step = _RNN_BUFFERS[kind] * step_elems * itemsize(ins[0])
    gates = {"LSTM": 4, "GRU": 3}.get(kind, 4 if kind.startswith("ConvLSTM") else 1)
    kernel = getattr(layer, "kernel_size", None) or getattr(cell, "kernel_size", None)
    taps = math.prod(kernel) if kernel else 1
    # Each output element of each gate: `taps` x (input channels + units) multiply-adds.
    flops = 2.0 * steps * gates * step_elems * taps * ((ins[0].shape[-1] or 1) + units)
    return LayerRule(frozenset({0}), frozenset(), steps * per_step, flops, True, "rnn")


def _bidirectional(layer, ins, outs):
    inner = rule_of_layer(layer.forward_layer, ins, outs)
    return dataclasses.replace(inner, internal=2 * inner.internal, flops=2 * inner.flops, name="rnn")


def _time_distributed(layer, ins, outs):
    return dataclasses.replace(rule_of_layer(layer.layer, ins, outs), name="time distributed")


def _dropout(layer, ins, outs):
    """A one-byte keep mask (of the noise shape for spatial dropout)."""
    out_bytes, out_elems = sum(o.nbytes for o in outs), sum(elems(o) for o in outs)
    if not getattr(layer, "rate", 0):
        return LayerRule(name="dropout off")
    if isinstance(layer, keras.layers.AlphaDropout):
        # x * mask + offset: TensorFlow's Mul gradient reads both operands.
        return LayerRule(all_indices(ins), internal=out_bytes, flops=3.0 * out_elems, name="alpha dropout")
    mask = out_elems
    spatial = (keras.layers.SpatialDropout1D, keras.layers.SpatialDropout2D, keras.layers.SpatialDropout3D)
    if isinstance(layer, spatial) and outs and len(outs[0].shape) > 2:
        mask = outs[0].shape[-1] or 1
    return LayerRule(internal=mask, flops=2.0 * out_elems, name="dropout")


def _gaussian_dropout(layer, ins, outs):
    out_bytes = sum(o.nbytes for o in outs)
    rate = getattr(layer, "rate", 0)
    if not rate:
        return LayerRule(name="dropout off")
    # x * noise: TensorFlow's Mul gradient reads both operands.
    return LayerRule(all_indices(ins), internal=out_bytes, flops=2.0 * sum(elems(o) for o in outs), name="dropout")


def _average(layer, ins, outs):
    """The sum of the inputs over their count: the division's gradient
    reads the sum (TensorFlow)."""
    return LayerRule(internal=sum(o.nbytes for o in outs), flops=len(ins) * sum(elems(o) for o in outs), name="average")


def _batch_norm(layer, ins, outs):
    """The input; the batch statistics, which the backward reads from the
    forward op (so its recompute is never pruned), are negligible."""
    return LayerRule(
        all_indices(ins), frozenset(), 0.0, 5.0 * sum(elems(o) for o in outs), name="batch norm", prunable=False
    )


def _norm_statistics(layer, ins, outs):
    """Group and unit normalization: the input and its statistics, at most
    one value per position (TensorFlow's gradient recomputes the rest);
    where Keras centers before scaling, group normalization keeps the
    centered input too."""
    out_elems = sum(elems(o) for o in outs)
    stats = out_elems / (outs[0].shape[-1] or 1) * itemsize(outs[0]) if outs else 0
    if isinstance(layer, keras.layers.GroupNormalization) and keras_compat.norms_keep_centered_input():
        stats += sum(o.nbytes for o in outs)
    return LayerRule(all_indices(ins), frozenset(), stats, 6.0 * out_elems, name="norm statistics")


def _layer_norm(layer, ins, outs):
    """`layer_norm_rule`, plus the centered input where Keras computes
    `(x - mean) * inv` (see `keras_compat.norms_keep_centered_input`)."""
    rule = layer_norm_rule(layer, ins, outs)
    if not keras_compat.norms_keep_centered_input():
        return rule
    return dataclasses.replace(rule, internal=rule.internal + sum(o.nbytes for o in outs))


def _saves_output(layer, ins, outs):
    return LayerRule(frozenset(), all_indices(outs), 0.0, sum(elems(o) for o in outs), name=type(layer).__name__.lower())


def _activation_layer(layer, ins, outs):
    out_bytes = sum(o.nbytes for o in outs)
    name = activation_name(layer)
    saved_out, internal, suffix = activation_rule(name, 0, out_bytes)
    saved_in = all_indices(ins) if name in SAVES_INPUT else frozenset()
    internal = max(0.0, internal - out_bytes) if name in SAVES_INPUT else internal
    return LayerRule(saved_in, saved_out, internal, 4.0 * sum(elems(o) for o in outs), name="activation" + suffix)


def _reversible_embedding(layer, ins, outs):
    """Token ids -> vectors (free), or, called with `reverse=True` on
    vectors, a matmul with the embedding matrix (logits)."""
    if ins and is_float(ins[0]):
        dim = ins[0].shape[-1] or 1
        return LayerRule(frozenset({0}), flops=2.0 * sum(elems(o) for o in outs) * dim, expensive=True, name="matmul")
    return free_rule(layer, ins, outs)


def _saves_inputs(layer, ins, outs):
    return LayerRule(all_indices(ins), frozenset(), 0.0, sum(elems(o) for o in outs), name="saves inputs")


def _max_min(layer, ins, outs):
    """Maximum/Minimum of two or more inputs: what TensorFlow's gradient
    reads, one input and a one-byte selection mask per further input."""
    out_elems = sum(elems(o) for o in outs)
    masks = max(len(ins) - 1, 1) * out_elems
    return LayerRule(frozenset({0}) if ins else frozenset(), frozenset(), masks, out_elems, name="max/min")


def _prelu(layer, ins, outs):
    """relu(x) - alpha * relu(-x): both relu outputs are kept."""
    out_bytes = sum(o.nbytes for o in outs)
    return LayerRule(internal=2 * out_bytes, flops=4.0 * sum(elems(o) for o in outs), name="prelu")


def _resizing(layer, ins, outs):
    """Bilinear and the other smooth interpolations read the input image in
    their gradient; nearest-neighbour needs only its shape."""
    if getattr(layer, "interpolation", "bilinear") == "nearest":
        return free_rule(layer, ins, outs)
    return _saves_inputs(layer, ins, outs)


def _activity_regularization(layer, ins, outs):
    """The l1 penalty's gradient reads sign(x), the l2 penalty's x."""
    if getattr(layer, "l1", 0) or getattr(layer, "l2", 0):
        return _saves_inputs(layer, ins, outs)
    return free_rule(layer, ins, outs)


def _max_pooling(layer, ins, outs):
    return LayerRule(all_indices(ins), all_indices(outs), 0.0, sum(elems(i) for i in ins), name="max pooling")


_KERAS_RULES = {
    _matmul: (
        ("Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose")
        + ("Conv3DTranspose", "DepthwiseConv1D", "DepthwiseConv2D"),
        True,
    ),
    _separable: (("SeparableConv1D", "SeparableConv2D"), True),
    _attention: (("MultiHeadAttention", "GroupQueryAttention"), True),
    _dot_attention: (("Attention", "AdditiveAttention"), True),
    _rnn: (tuple(_RNN_BUFFERS), True),
    _bidirectional: (("Bidirectional",), False),
    _time_distributed: (("TimeDistributed",), False),
    _dropout: (("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "AlphaDropout"), False),
    _gaussian_dropout: (("GaussianDropout",), False),
    _average: (("Average",), False),
    _batch_norm: (("BatchNormalization",), False),
    _layer_norm: (("LayerNormalization",), False),
    layer_norm_rule: (("RMSNormalization",), False),
    _norm_statistics: (("GroupNormalization", "UnitNormalization"), False),
    _saves_output: (("ReLU", "ELU", "Softmax"), False),
    _activation_layer: (("Activation",), False),
    free_rule: (
        ("InputLayer", "Add", "Subtract", "Concatenate", "Reshape", "Flatten", "Permute")
        + ("RepeatVector", "Identity", "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D")
        + ("Cropping2D", "Cropping3D", "UpSampling1D", "UpSampling2D", "UpSampling3D", "AveragePooling1D")
        + ("AveragePooling2D", "AveragePooling3D", "GlobalAveragePooling1D", "GlobalAveragePooling2D")
        + ("GlobalAveragePooling3D", "GaussianNoise", "Rescaling", "CenterCrop", "Embedding")
        + ("Masking",),
        False,
    ),
    _saves_inputs: (("Multiply", "Dot", "LeakyReLU", "Normalization"), False),
    _max_min: (("Maximum", "Minimum"), False),
    _prelu: (("PReLU",), False),
    _resizing: (("Resizing",), False),
    _activity_regularization: (("ActivityRegularization",), False),
    _max_pooling: (
        ("MaxPooling1D", "MaxPooling2D", "MaxPooling3D", "GlobalMaxPooling1D", "GlobalMaxPooling2D")
        + ("GlobalMaxPooling3D",),
        False,
    ),
}
if hasattr(keras.layers, "ReversibleEmbedding"):  # Keras 3.12 and later
    _KERAS_RULES[_reversible_embedding] = (("ReversibleEmbedding",), True)
for _fn, (_names, _expensive) in _KERAS_RULES.items():
    for _name in _names:
        register_builtin_rule(getattr(keras.layers, _name), _fn, expensive=_expensive)


def find_rule(layer_class):
    """The `(rule, expensive)` for `layer_class` through its MRO, or None.
    Rules for layers of optional packages register when such a layer is
    first met, so that the estimator never imports those packages itself."""
    if layer_class.__module__.startswith("keras_hub."):
        from graphckpt.estimator import hub_rules

        hub_rules.register(layer_class.__module__)
    return registered_rule(layer_class)


def rule_of_layer(layer, ins, outs):
    """The registered rule's result for a layer, or None when no class in
    its MRO has a rule."""
    found = find_rule(type(layer))
    if found is None:
        return None
    rule, expensive = found
    result = rule(layer, ins, outs)
    return dataclasses.replace(result, expensive=True) if expensive and not result.expensive else result


# ------------------------------------------------------------ Keras ops

_OP_MATMUL = {"Matmul", "Einsum", "Tensordot", "Dot"}
_OP_FREE = {
    "Add",
    "Subtract",
    "Reshape",
    "Transpose",
    "ExpandDims",
    "Squeeze",
    "Concatenate",
    "Cast",
    "NotEqual",
    "Equal",
    "Greater",
    "Less",
    "Any",
    "All",
    "Mean",
    "Sum",
    "Negative",
    "GetItem",
    "Slice",
    "StopGradient",
    "ZerosLike",
    "OnesLike",
}


_OP_OPERANDS = {"Multiply", "Minimum", "Maximum"}


def rule_of_op(op, ins, outs):
    """The rule of a Keras op called in a functional graph (`keras.ops.add`
    and the like), by its operation class within Keras; the unknown rule
    for any other operation."""
    name = type(op).__name__
    if not type(op).__module__.startswith("keras."):
        return unknown_rule(op, ins, outs)
    out_bytes, out_elems = sum(o.nbytes for o in outs), sum(elems(o) for o in outs)
    if name in _OP_MATMUL:
        return LayerRule(all_indices(ins), flops=2.0 * out_elems * (ins[0].shape[-1] or 1), expensive=True, name="op matmul")
    if name in _OP_FREE:
        return LayerRule(flops=out_elems, name="op free")
    if name in _OP_OPERANDS:
        # The gradient of x * y (or min/max) reads the other operand (or
        # both, for the mask): nothing batch-sized when one is a constant.
        return LayerRule(all_indices(ins) if len(ins) > 1 else frozenset(), flops=out_elems, name="op operands")
    act = name.lower()
    if act in SAVES_OUTPUT or act in SAVES_INPUT:
        saved_out, internal, _ = activation_rule(act, 0, out_bytes)
        saved_in = all_indices(ins) if act in SAVES_INPUT else frozenset()
        return LayerRule(saved_in, saved_out, max(0.0, internal - out_bytes), out_elems, name=f"op {act}")
    return unknown_rule(op, ins, outs)


def forward_temporaries(layer, outs):
    """Transient bytes of `layer`'s forward step besides its outputs and
    kept buffers, on a backend that runs each op eagerly (PyTorch): a
    kernel layer (Dense, EinsumDense, convolutions) adds its bias and
    applies its activation as ops of their own, so one more output-sized
    tensor lives beside the one being made (measured: docs/estimator.md,
    "The memory model")."""
    if getattr(layer, "kernel", None) is None:
        return 0.0
    separate = getattr(layer, "bias", None) is not None or activation_name(layer) not in (None, "linear")
    return float(sum(o.nbytes for o in outs)) if separate else 0.0


def op_is_expensive(op):
    return type(op).__module__.startswith("keras.") and type(op).__name__ in _OP_MATMUL


def is_expensive(layer):
    """True for matmul-like layers: Dense, EinsumDense, convolutions,
    attention, recurrent layers, classes registered with `expensive=True`
    (and nested models or wrappers holding any)."""
    if isinstance(layer, keras.Model):
        return any(is_expensive(inner) for inner in layer.layers)
    if isinstance(layer, (keras.layers.Bidirectional, keras.layers.TimeDistributed)):
        inner = getattr(layer, "forward_layer", None) or getattr(layer, "layer", None)
        return is_expensive(inner)
    if not isinstance(layer, keras.layers.Layer):
        return op_is_expensive(layer)
    found = find_rule(type(layer))
    return bool(found and found[1])
