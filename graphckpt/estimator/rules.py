"""What one layer call's backward pass keeps: the estimator's layer rules.

A rule is a function `rule(layer, inputs, outputs) -> LayerRule`, where
`inputs` and `outputs` are the call's `graphckpt.graph.build.TensorInfo`s with
*per-example* byte counts (the batch dimension is the first of `shape`).
Rules are registered by layer class and found through the class's MRO, so
a subclass of `Dense` is estimated as a Dense, and a user class that only
shares a name with a Keras layer is not. Register a rule for a custom
layer with `register_layer_rule`.

This module holds the registry and the building blocks shared by the
rules (attention, normalization, activations); the rules of Keras's own
layers and ops are in `graphckpt.estimator.keras_rules`, keras_hub's in
`graphckpt.estimator.hub_rules`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import keras

__all__ = ["LayerRule", "register_layer_rule"]


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
        prunable: whether its backward needs nothing its forward computes
            (only its inputs and weights), so that a graph compiler skips
            its recompute when nothing else in the segment reads its
            outputs (a Dense or convolution without activation, an Add);
            None: when it keeps no output and no internal buffer.
    """

    saved_inputs: frozenset = frozenset()
    saved_outputs: frozenset = frozenset()
    internal: float = 0.0
    flops: float = 0.0
    expensive: bool = False
    name: str = "free"
    workspace: float | None = None
    param_bytes: int | None = None
    prunable: bool | None = None

    @property
    def is_prunable(self):
        """`prunable`, or its default when None."""
        if self.prunable is not None:
            return self.prunable
        return not self.saved_outputs and not self.internal


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
            outputs as per-example `graphckpt.graph.build.TensorInfo`s.
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


def register_builtin_rule(layer_class, rule, expensive=False):
    """Registers one of graphckpt's own rules, unless a rule for exactly
    this class is registered already: the built-in rules of Keras's and
    keras_hub's layers register when first needed, and must not replace a
    rule the user registered before that."""
    if layer_class not in _REGISTRY:
        _REGISTRY[layer_class] = _Entry(rule, bool(expensive))


def registered_rule(layer_class):
    """The `(rule, expensive)` registered for `layer_class` or its nearest
    base class in the MRO, or None. Keras's own rules are registered by
    `graphckpt.estimator.keras_rules`, keras_hub's when `keras_rules.find_rule` first
    meets one of its layers."""
    for klass in layer_class.__mro__:
        entry = _REGISTRY.get(klass)
        if entry is not None:
            return entry.rule, entry.expensive
    return None


# ------------------------------------------------------------ helpers


def elems(info):
    """Elements per example of a TensorInfo (unknown dimensions count 1)."""
    return math.prod(d if d is not None else 1 for d in info.shape[1:])


def itemsize(info):
    n = elems(info)
    return info.nbytes / n if n else 4


def is_float(info):
    return "float" in info.dtype


def all_indices(items):
    return frozenset(range(len(items)))


# Activations whose TensorFlow gradient reads the activation's output.
SAVES_OUTPUT = {"relu", "relu6", "tanh", "sigmoid", "softmax", "log_softmax", "elu", "selu", "exponential"}
# Activations whose gradient reads the input, with the number of
# input-sized buffers kept (gelu's erf form keeps two temporaries besides
# its input; probed: Dense(gelu) keeps 3 tensors of its output's size; the
# tanh form, keras_hub's `gelu_approximate` (GPT-2, BERT), keeps 4: Tanh,
# Pow, Mul and AddV2 outputs in TensorFlow's gradient graph).
SAVES_INPUT = {
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
    "gelu_approximate": 4,
}
_NO_SAVE_ACTIVATIONS = {"linear", None}


def activation_name(layer):
    act = getattr(layer, "activation", None)
    if act is None:
        return None
    name = getattr(act, "__name__", None) or type(act).__name__
    return name.lower()


def activation_rule(name, out_index=0, out_bytes=0):
    """(saved outputs, internal bytes, rule suffix) for a fused activation."""
    if name in _NO_SAVE_ACTIVATIONS:
        return frozenset(), 0.0, ""
    if name in SAVES_OUTPUT:
        return frozenset({out_index}), 0.0, f"+{name}"
    if name in SAVES_INPUT:
        return frozenset(), SAVES_INPUT[name] * out_bytes, f"+{name}"
    return frozenset({out_index}), out_bytes, f"+{name}?"


def unknown_rule(layer, ins, outs):
    """The conservative guess: inputs and outputs kept, plus one
    output-sized buffer."""
    out_bytes = sum(o.nbytes for o in outs)
    return LayerRule(all_indices(ins), all_indices(outs), out_bytes, sum(elems(o) for o in outs), name="unknown")


# Score-sized buffers kept per MultiHeadAttention call (probed; see
# docs/estimator.md).
MHA_SCORE_BUFFERS = 2.2
# Bytes per score a dropout draw of attention in chunks holds while it runs:
# XLA's threefry about 16 (counters, bits, uniforms; its temporaries with and
# without the draw, benchmarks/opening.py's MHA family on JAX); PyTorch's
# whole draw about 9 (probabilities, draw, booleans).
CHUNKED_DRAW_BYTES = 16


def attention_rule(
    ins, outs, heads, key_dim, value_dim=None, kv_heads=None, self_attention=False, chunks=None, dropout=False,
    drawn_per_piece=False,
):
    """Multi-head attention over `ins` (query, then value unless
    `self_attention`): the q/k/v projections keep their inputs; inside,
    about three projection-sized buffers (q, k, v) and `MHA_SCORE_BUFFERS`
    score-sized buffers (heads x T x S: the softmax output and its
    neighbours) are kept. Fitted on probes over T, E and dropout
    (docs/estimator.md); dropout made no measurable difference.

    With its core in `chunks` pieces (`graphckpt.runtime.attention`),
    no score-sized buffer is kept but the dropout mask's booleans (with
    `dropout`); the core's output is kept beside q, k and v, and the
    backward step holds one chunk's core (`MHA_SCORE_BUFFERS`, and two
    gradients) while it recomputes it, once more a forward pass of the
    core. With `dropout`, the mask is drawn for the whole score tensor at
    once (`CHUNKED_DRAW_BYTES` a score, while it is drawn), or, where each
    piece draws its own part (`drawn_per_piece`: TensorFlow and JAX), a
    piece's, and no mask is kept."""
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
    if not chunks:
        return LayerRule(saved_inputs=saved, internal=internal, flops=flops, expensive=True, name="attention")
    kept_mask = dropout and not drawn_per_piece
    internal = (q + k + v + a) * item + (scores if kept_mask else 0)
    io = sum(i.nbytes for i in ins if is_float(i)) + sum(o.nbytes for o in outs)
    chunk = math.ceil(t / min(chunks, t)) * heads * s * item
    draw = CHUNKED_DRAW_BYTES * (scores if kept_mask else chunk / item) if dropout else 0
    return LayerRule(
        saved_inputs=saved,
        internal=internal,
        flops=flops + 2.0 * scores * (key_dim + value_dim),
        expensive=True,
        name="attention in chunks",
        workspace=io + internal + max((MHA_SCORE_BUFFERS + 2) * chunk, draw),
    )


def layer_norm_rule(layer, ins, outs):
    """Normalizations over features: the input and one output-sized buffer."""
    out_bytes = sum(o.nbytes for o in outs)
    return LayerRule(all_indices(ins), frozenset(), out_bytes, 6.0 * sum(elems(o) for o in outs), name="layer norm")


def free_rule(layer, ins, outs):
    """Gradients that need only shapes: nothing kept."""
    return LayerRule(flops=sum(elems(o) for o in outs), name="free")
