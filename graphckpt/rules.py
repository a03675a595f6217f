"""What one layer call's backward pass keeps: the estimator's layer rules.

A rule is a function `rule(layer, inputs, outputs) -> LayerRule`, where
`inputs` and `outputs` are the call's `graphckpt.graph.TensorInfo`s with
*per-example* byte counts (the batch dimension is the first of `shape`).
Rules are registered by layer class and found through the class's MRO, so
a subclass of `Dense` is estimated as a Dense, and a user class that only
shares a name with a Keras layer is not. Register a rule for a custom
layer with `register_layer_rule`.

Keras ops in a functional graph (`keras.ops.*`, not layers) are matched by
operation class name within Keras's own modules.

Rules follow what TensorFlow's gradient functions read, and were checked
with per-layer probes against measured peaks (see `docs/estimator.md`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import keras

__all__ = ["LayerRule", "register_layer_rule", "registered_rule"]


@dataclasses.dataclass(frozen=True)
class LayerRule:
    """Per-example facts about one layer call (bytes are per example).

    Attributes:
        saved_inputs: indices of the call's inputs its backward reads.
        saved_outputs: indices of its outputs its backward reads.
        internal: bytes kept besides those tensors: pre-activations,
            dropout masks, attention scores...
        flops: forward floating-point operations (multiply-adds count 2).
        expensive: matmul-like (what `save_expensive` never recomputes).
        name: a short name for tables (`CallEstimate.rule`).
        workspace: transient bytes of its backward step; None for the
            default formula (its input and output gradients, temporaries
            the size of `internal`, parameter gradients in flight).
        param_bytes: parameters whose gradients are in flight; None for the
            layer's own trainable weights.
    """

    saved_inputs: frozenset = frozenset()
    saved_outputs: frozenset = frozenset()
    internal: float = 0.0
    flops: float = 0.0
    expensive: bool = False
    name: str = "free"
    workspace: float | None = None
    param_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class _Entry:
    rule: object
    expensive: bool


_REGISTRY = {}


def register_layer_rule(
    layer_class: type[keras.layers.Layer],
    rule: Callable[..., LayerRule] | None = None,
    *,
    expensive: bool = False,
) -> Callable:
    """Registers how the estimator counts calls of `layer_class` and of its
    subclasses (unless one of them has a rule of its own).

    Usable as a decorator: `@register_layer_rule(MyBlock, expensive=True)`.

    Args:
        layer_class: a subclass of `keras.layers.Layer`.
        rule: `rule(layer, inputs, outputs) -> LayerRule`, inputs and
            outputs as per-example `graphckpt.graph.TensorInfo`s.
        expensive: whether the layer is matmul-like, for policies that look
            at the class only (`graphckpt.policies.save_expensive`).

    Returns:
        `rule` (or, as a decorator, a function that registers its argument).

    Raises:
        TypeError: `layer_class` is not a Layer subclass or `rule` is not
            callable.
    """
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(
            "`layer_class` must be a subclass of keras.layers.Layer. "
            f"Received: layer_class={layer_class!r}"
        )
    if rule is None:
        return lambda fn: register_layer_rule(layer_class, fn, expensive=expensive)
    if not callable(rule):
        raise TypeError(
            "`rule` must be a function (layer, inputs, outputs) -> LayerRule. "
            f"Received: rule={rule!r}"
        )
    _REGISTRY[layer_class] = _Entry(rule, bool(expensive))
    return rule


def registered_rule(layer_class):
    """The `(rule, expensive)` registered for `layer_class` or its nearest
    base class in the MRO, or None."""
    _load_optional_rules(layer_class)
    for klass in layer_class.__mro__:
        entry = _REGISTRY.get(klass)
        if entry is not None:
            return entry.rule, entry.expensive
    return None


def _load_optional_rules(layer_class):
    """Rules for layers of optional packages register when such a layer is
    first met, so that the estimator never imports those packages itself."""
    if layer_class.__module__.startswith("keras_hub."):
        from graphckpt import hub_rules

        hub_rules.register(layer_class.__module__)


# ------------------------------------------------------------ helpers


def elems(info):
    """Elements per example of a TensorInfo (unknown dimensions count 1)."""
    return math.prod(d if d is not None else 1 for d in info.shape[1:])


def itemsize(info):
    n = elems(info)
    return info.nbytes / n if n else 4


def is_float(info):
    return "float" in info.dtype


def _all(items):
    return frozenset(range(len(items)))


# Activations whose TensorFlow gradient reads the activation's output.
_SAVES_OUTPUT = {"relu", "relu6", "tanh", "sigmoid", "softmax", "log_softmax", "elu", "selu", "exponential"}
# Activations whose gradient reads the input, with the number of
# input-sized buffers kept (gelu's erf form keeps two temporaries besides
# its input; probed: Dense(gelu) keeps 3 tensors of its output's size).
_SAVES_INPUT = {
    "softplus": 1,
    "softsign": 1,
    "leaky_relu": 1,
    "silu": 1,
    "swish": 1,
    "hard_silu": 1,
    "hard_swish": 1,
    "hard_sigmoid": 1,
    "log_sigmoid": 1,
    "celu": 2,
    "mish": 3,
    "gelu": 3,
}
_NO_SAVE_ACTIVATIONS = {"linear", None}


def _activation_name(layer):
    act = getattr(layer, "activation", None)
    if act is None:
        return None
    name = getattr(act, "__name__", None) or type(act).__name__
    return name.lower()


def _activation_rule(name, out_index=0, out_bytes=0):
    """(saved outputs, internal bytes, rule suffix) for a fused activation."""
    if name in _NO_SAVE_ACTIVATIONS:
        return frozenset(), 0.0, ""
    if name in _SAVES_OUTPUT:
        return frozenset({out_index}), 0.0, f"+{name}"
    if name in _SAVES_INPUT:
        return frozenset(), _SAVES_INPUT[name] * out_bytes, f"+{name}"
    return frozenset({out_index}), out_bytes, f"+{name}?"


def unknown_rule(layer, ins, outs):
    """The conservative guess: inputs and outputs kept, plus one
    output-sized buffer."""
    out_bytes = sum(o.nbytes for o in outs)
    return LayerRule(_all(ins), _all(outs), out_bytes, sum(elems(o) for o in outs), name="unknown")


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
    saved_out, internal, suffix = _activation_rule(_activation_name(layer), 0, out_bytes)
    return LayerRule(_all(ins), saved_out, internal, _kernel_flops(layer, outs, ins), True, "matmul" + suffix)


# Score-sized buffers kept per MultiHeadAttention call (probed; see
# docs/estimator.md).
MHA_SCORE_BUFFERS = 2.2


def attention_rule(ins, outs, heads, key_dim, value_dim=None, kv_heads=None, self_attention=False):
    """Multi-head attention over `ins` (query, then value unless
    `self_attention`): the q/k/v projections keep their inputs; inside,
    about three projection-sized buffers (q, k, v) and `MHA_SCORE_BUFFERS`
    score-sized buffers (heads x T x S: the softmax output and its
    neighbours) are kept. Fitted on probes over T, E and dropout
    (docs/estimator.md); dropout made no measurable difference."""
    query = ins[0]
    value = ins[1] if len(ins) > 1 and not self_attention else ins[0]
    item = itemsize(query)
    kv_heads = kv_heads or heads
    value_dim = value_dim or key_dim
    t = math.prod(d or 1 for d in query.shape[1:-1])
    s = math.prod(d or 1 for d in value.shape[1:-1])
    e_q, e_v = query.shape[-1] or 1, value.shape[-1] or 1
    e_out = outs[0].shape[-1] or 1 if outs else e_q
    q, k, v, a = t * heads * key_dim, s * kv_heads * key_dim, s * kv_heads * value_dim, t * heads * value_dim
    scores = heads * t * s
    internal = (q + k + v) * item + MHA_SCORE_BUFFERS * scores * item
    flops = 2.0 * (q * e_q + k * e_v + v * e_v + a * e_out) + 2.0 * scores * (key_dim + value_dim)
    saved = frozenset({0}) if self_attention else frozenset(range(min(len(ins), 3)))
    return LayerRule(saved_inputs=saved, internal=internal, flops=flops, expensive=True, name="attention")


def _attention(layer, ins, outs):
    """MultiHeadAttention (and subclasses: keras_hub's cached attention),
    GroupQueryAttention (fewer key/value heads than query heads)."""
    if isinstance(layer, keras.layers.MultiHeadAttention):
        key_dim = layer.key_dim or 1
        return attention_rule(ins, outs, layer.num_heads or 1, key_dim, layer.value_dim or key_dim)
    head_dim = getattr(layer, "head_dim", None) or 1
    heads = getattr(layer, "num_query_heads", None) or 1
    return attention_rule(ins, outs, heads, head_dim, kv_heads=getattr(layer, "num_key_value_heads", None))


def _dot_attention(layer, ins, outs):
    q = elems(ins[0])
    t, s = ins[0].shape[1] or 1, ins[1].shape[1] if len(ins) > 1 and ins[1].shape[1] else 1
    scores = t * s
    return LayerRule(_all(ins), frozenset(), 2 * scores * itemsize(ins[0]), 4.0 * scores * (q / t), True, "attention")


_RNN_BUFFERS = {"LSTM": 7, "GRU": 5, "SimpleRNN": 2, "ConvLSTM1D": 7, "ConvLSTM2D": 7, "ConvLSTM3D": 7}


def _rnn(layer, ins, outs):
    kind = next((k.__name__ for k in type(layer).__mro__ if k.__name__ in _RNN_BUFFERS), "SimpleRNN")
    units = getattr(layer, "units", None) or getattr(getattr(layer, "cell", None), "units", 1)
    steps = ins[0].shape[1] or 1
    per_step = _RNN_BUFFERS[kind] * units * itemsize(ins[0])
    feat = ins[0].shape[-1] or 1
    gates = {"LSTM": 4, "GRU": 3}.get(kind, 1)
    flops = 2.0 * steps * gates * units * (feat + units)
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
        return LayerRule(internal=out_bytes, flops=3.0 * out_elems, name="alpha dropout")
    mask = out_elems
    spatial = (keras.layers.SpatialDropout1D, keras.layers.SpatialDropout2D, keras.layers.SpatialDropout3D)
    if isinstance(layer, spatial) and outs and len(outs[0].shape) > 2:
        mask = outs[0].shape[-1] or 1
    return LayerRule(internal=mask, flops=2.0 * out_elems, name="dropout")


def _gaussian_dropout(layer, ins, outs):
    out_bytes = sum(o.nbytes for o in outs)
    rate = getattr(layer, "rate", 0)
    return LayerRule(internal=out_bytes if rate else 0.0, flops=2.0 * sum(elems(o) for o in outs), name="dropout")


def _batch_norm(layer, ins, outs):
    return LayerRule(_all(ins), frozenset(), 0.0, 5.0 * sum(elems(o) for o in outs), name="batch norm")


def layer_norm_rule(layer, ins, outs):
    """Normalizations over features: the input and one output-sized buffer."""
    out_bytes = sum(o.nbytes for o in outs)
    return LayerRule(_all(ins), frozenset(), out_bytes, 6.0 * sum(elems(o) for o in outs), name="layer norm")


def _saves_output(layer, ins, outs):
    return LayerRule(frozenset(), _all(outs), 0.0, sum(elems(o) for o in outs), name=type(layer).__name__.lower())


def _activation_layer(layer, ins, outs):
    out_bytes = sum(o.nbytes for o in outs)
    name = _activation_name(layer)
    saved_out, internal, suffix = _activation_rule(name, 0, out_bytes)
    saved_in = _all(ins) if name in _SAVES_INPUT else frozenset()
    internal = max(0.0, internal - out_bytes) if name in _SAVES_INPUT else internal
    return LayerRule(saved_in, saved_out, internal, 4.0 * sum(elems(o) for o in outs), name="activation" + suffix)


def _reversible_embedding(layer, ins, outs):
    """Token ids -> vectors (free), or, called with `reverse=True` on
    vectors, a matmul with the embedding matrix (logits)."""
    if ins and is_float(ins[0]):
        dim = ins[0].shape[-1] or 1
        return LayerRule(frozenset({0}), flops=2.0 * sum(elems(o) for o in outs) * dim, expensive=True, name="matmul")
    return free_rule(layer, ins, outs)


def free_rule(layer, ins, outs):
    """Gradients that need only shapes: nothing kept."""
    return LayerRule(flops=sum(elems(o) for o in outs), name="free")


def _saves_inputs(layer, ins, outs):
    return LayerRule(_all(ins), frozenset(), 0.0, sum(elems(o) for o in outs), name="saves inputs")


def _max_pooling(layer, ins, outs):
    return LayerRule(_all(ins), _all(outs), 0.0, sum(elems(i) for i in ins), name="max pooling")


_KERAS_RULES = {
    _matmul: (
        ("Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D", "Conv1DTranspose", "Conv2DTranspose")
        + ("Conv3DTranspose", "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D"),
        True,
    ),
    _attention: (("MultiHeadAttention", "GroupQueryAttention"), True),
    _dot_attention: (("Attention", "AdditiveAttention"), True),
    _rnn: (tuple(_RNN_BUFFERS), True),
    _bidirectional: (("Bidirectional",), False),
    _time_distributed: (("TimeDistributed",), False),
    _dropout: (("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "AlphaDropout"), False),
    _gaussian_dropout: (("GaussianDropout",), False),
    _batch_norm: (("BatchNormalization",), False),
    layer_norm_rule: (("LayerNormalization", "GroupNormalization", "UnitNormalization", "RMSNormalization"), False),
    _saves_output: (("ReLU", "ELU", "Softmax"), False),
    _activation_layer: (("Activation",), False),
    free_rule: (
        ("InputLayer", "Add", "Subtract", "Average", "Concatenate", "Reshape", "Flatten", "Permute")
        + ("RepeatVector", "Identity", "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D")
        + ("Cropping2D", "Cropping3D", "UpSampling1D", "UpSampling2D", "UpSampling3D", "AveragePooling1D")
        + ("AveragePooling2D", "AveragePooling3D", "GlobalAveragePooling1D", "GlobalAveragePooling2D")
        + ("GlobalAveragePooling3D", "GaussianNoise", "Rescaling", "Resizing", "CenterCrop", "Embedding")
        + ("Masking", "ActivityRegularization"),
        False,
    ),
    _saves_inputs: (("Multiply", "Maximum", "Minimum", "Dot", "PReLU", "LeakyReLU", "Normalization"), False),
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
        register_layer_rule(getattr(keras.layers, _name), _fn, expensive=_expensive)


def rule_of_layer(layer, ins, outs):
    """The registered rule's result for a layer, or None when no class in
    its MRO has a rule."""
    found = registered_rule(type(layer))
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


def rule_of_op(op, ins, outs):
    """The rule of a Keras op called in a functional graph (`keras.ops.add`
    and the like), by its operation class within Keras; the unknown rule
    for any other operation."""
    name = type(op).__name__
    if not type(op).__module__.startswith("keras."):
        return unknown_rule(op, ins, outs)
    out_bytes, out_elems = sum(o.nbytes for o in outs), sum(elems(o) for o in outs)
    if name in _OP_MATMUL:
        return LayerRule(_all(ins), flops=2.0 * out_elems * (ins[0].shape[-1] or 1), expensive=True, name="op matmul")
    if name in _OP_FREE:
        return LayerRule(flops=out_elems, name="op free")
    act = name.lower()
    if act in _SAVES_OUTPUT or act in _SAVES_INPUT:
        saved_out, internal, _ = _activation_rule(act, 0, out_bytes)
        saved_in = _all(ins) if act in _SAVES_INPUT else frozenset()
        return LayerRule(saved_in, saved_out, max(0.0, internal - out_bytes), out_elems, name=f"op {act}")
    return unknown_rule(op, ins, outs)


def op_is_expensive(op):
    return type(op).__module__.startswith("keras.") and type(op).__name__ in _OP_MATMUL
