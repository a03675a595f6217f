"""Estimated training-step memory of a Keras model, with or without a plan.

Contract:
- From static shapes and dtypes only: nothing is run. Each layer call gets a
  rule (`CallEstimate.rule`) saying what its backward pass needs kept:
  which of its input and output tensors, and which internal buffers
  (pre-activations of fused activations, dropout masks, attention scores,
  normalization intermediates). Rules follow what TensorFlow's gradient
  functions read, and were checked with per-layer probes against measured
  peaks (see `docs/estimator.md`). Unknown layers get a conservative rule
  (inputs and outputs kept, plus one output-sized buffer) and are listed in
  `MemoryEstimate.unknown_layers`.
- The peak itself comes from the planner's memory model
  (`graphckpt.plan.segment_peaks`): during the backward pass, for each
  segment in reverse order, the boundary tensors held for the earlier
  segments plus the segment's own recompute peak. The baseline is the plan
  with one segment that is not recomputed. The estimate and the budget
  planner use the same numbers, so a budget plan's estimate is the planner's.
- The figure is the peak training-step memory *above the resident state*
  (weights, optimizer slots, the batch), as `graphckpt.measure` reports it.
- Shapes: the model's static shapes, with unknown dimensions given by
  `input_shape` (propagated to every tensor by `graphckpt.shapes`); without
  it an unknown non-batch dimension counts as 1, with a warning.
- Batch size: the `batch_size` argument, else the batch dimension of
  `input_shape`, else the model's fixed batch dimension, else none: the
  estimate is then **per example**, activation memory only
  (parameter-sized gradient buffers left out), which scales linearly with
  the batch.

All results are frozen dataclasses of plain values.
"""

import contextlib
import dataclasses
import inspect
import math

import keras

from graphckpt.graph import TensorInfo, build_graph, functional_of
from graphckpt.graph import _itemsize as _dtype_size
from graphckpt.plan import (
    MemoryModel,
    NodeCosts,
    Plan,
    baseline_peak,
    segment_peaks,
    smallest_peak,
    topological_order,
)
from graphckpt.shapes import propagate, sized_graph

__all__ = [
    "CallEstimate",
    "MemoryEstimate",
    "estimate",
    "node_costs",
    "call_estimates",
    "resolve_batch_size",
    "is_expensive",
]


@dataclasses.dataclass(frozen=True)
class CallEstimate:
    """What one layer call costs, for the batch of the estimate.

    Attributes:
        node: the call's graph key `(layer_name, node_index)`.
        class_name: the layer's class.
        kept_bytes: bytes it keeps for backward when run as it is (its
            internal buffers and those of its outputs that are kept).
        workspace_bytes: transient bytes of its backward step.
        flops: forward floating-point operations (multiply-adds count 2).
        expensive: matmul-like (Dense, convolutions, attention, RNNs): what
            the `save_expensive` policy never recomputes.
        rule: the name of the rule used; `"unknown"` for a guess.
    """

    node: tuple
    class_name: str
    kept_bytes: int
    workspace_bytes: int
    flops: float
    expensive: bool
    rule: str


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak training-step activation memory of a model and plan.

    Attributes:
        batch_size: the batch size, or None for a per-example estimate.
        baseline_peak_bytes: the original model's estimated peak.
        peak_bytes: the plan's estimated peak (the baseline's without one).
        smallest_peak_bytes: the smallest estimated peak any plan reaches.
        fixed_bytes: the part every plan pays (loss and output gradients).
        segments: one `graphckpt.plan.SegmentPeak` per plan segment: bytes
            held before it, bytes it holds, its recompute peak and its peak.
        calls: one `CallEstimate` per layer call, in the planner's order.
        forward_flops: the model's forward cost.
        recompute_flops: the forward cost the plan recomputes.
        unknown_layers: classes estimated by the conservative fallback.
    """

    batch_size: int | None
    baseline_peak_bytes: int
    peak_bytes: int
    smallest_peak_bytes: int
    fixed_bytes: int
    segments: tuple
    calls: tuple
    forward_flops: float
    recompute_flops: float
    unknown_layers: tuple

    @property
    def ratio(self):
        """Estimated peak / estimated baseline peak."""
        return self.peak_bytes / self.baseline_peak_bytes if self.baseline_peak_bytes else 1.0


# ------------------------------------------------------------------ rules

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

_MATMUL = (
    "Dense",
    "EinsumDense",
    "Conv1D",
    "Conv2D",
    "Conv3D",
    "Conv1DTranspose",
    "Conv2DTranspose",
    "Conv3DTranspose",
    "DepthwiseConv1D",
    "DepthwiseConv2D",
    "SeparableConv1D",
    "SeparableConv2D",
)
_ATTENTION = ("MultiHeadAttention", "GroupedQueryAttention", "GroupQueryAttention")
_DOT_ATTENTION = ("Attention", "AdditiveAttention")
_RNN = {"LSTM": 7, "GRU": 5, "SimpleRNN": 2, "ConvLSTM1D": 7, "ConvLSTM2D": 7, "ConvLSTM3D": 7}
_FREE = {
    # Gradients that need only shapes: nothing kept.
    "InputLayer",
    "Add",
    "Subtract",
    "Average",
    "Concatenate",
    "Reshape",
    "Flatten",
    "Permute",
    "RepeatVector",
    "Identity",
    "ZeroPadding1D",
    "ZeroPadding2D",
    "ZeroPadding3D",
    "Cropping1D",
    "Cropping2D",
    "Cropping3D",
    "UpSampling1D",
    "UpSampling2D",
    "UpSampling3D",
    "AveragePooling1D",
    "AveragePooling2D",
    "AveragePooling3D",
    "GlobalAveragePooling1D",
    "GlobalAveragePooling2D",
    "GlobalAveragePooling3D",
    "GaussianNoise",
    "Rescaling",
    "Resizing",
    "CenterCrop",
    "Embedding",
    "Masking",
    "ActivityRegularization",
    "Cast",
}
_SAVE_INPUTS = {"Multiply", "Maximum", "Minimum", "Dot", "PReLU", "LeakyReLU", "Normalization"}
_SAVE_IN_AND_OUT = {
    "MaxPooling1D",
    "MaxPooling2D",
    "MaxPooling3D",
    "GlobalMaxPooling1D",
    "GlobalMaxPooling2D",
    "GlobalMaxPooling3D",
}
# Keras ops used in a functional graph (keras.ops.*), by class name.
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


@dataclasses.dataclass(frozen=True)
class _Rule:
    """Per-example facts about one call (bytes are per example)."""

    saved_inputs: frozenset = frozenset()
    saved_outputs: frozenset = frozenset()
    internal: float = 0.0
    flops: float = 0.0
    expensive: bool = False
    name: str = "free"
    workspace: float | None = None  # per example; None: the default formula
    param_bytes: int | None = None  # parameters whose gradients are in flight


def _elems(info):
    return math.prod(d if d is not None else 1 for d in info.shape[1:])


def _itemsize(info):
    n = _elems(info)
    return info.nbytes / n if n else 4


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


def _kernel_flops(layer, outs, ins):
    """2 x multiply-adds of a kernel layer: each output element needs
    (kernel size / output features) multiply-adds."""
    kernel = getattr(layer, "kernel", None)
    if kernel is None or not outs:
        return 2.0 * sum(_elems(o) for o in outs)
    kshape = tuple(kernel.shape)
    out_elems = _elems(outs[0])
    cls = type(layer).__name__
    if cls == "EinsumDense":
        eq = layer.equation.replace(" ", "")
        lhs, out_sub = eq.split("->")
        k_sub = lhs.split(",")[1]
        shared = math.prod(d for c, d in zip(k_sub, kshape) if c in out_sub)
        per_out = math.prod(kshape) / max(shared, 1)
    elif cls.endswith("Transpose"):
        # Each input element scatters into kernel_size x out_channels outputs.
        return 2.0 * _elems(ins[0]) * math.prod(kshape[:-1]) if ins else 0.0
    elif cls.startswith("Depthwise"):
        per_out = math.prod(kshape[:-2])
    else:
        per_out = math.prod(kshape[:-1])
    flops = 2.0 * out_elems * per_out
    if cls.startswith("Separable"):
        pointwise = getattr(layer, "pointwise_kernel", None)
        if pointwise is not None:
            flops += 2.0 * out_elems * math.prod(tuple(pointwise.shape)[:-1])
    return flops


def _attention_rule(layer, ins, outs):
    """MultiHeadAttention: the q/k/v projections keep their inputs; inside,
    about three projection-sized buffers (q, k, v) and 2.2 score-sized
    buffers (heads x T x S: the softmax output and its neighbours) are kept.
    Fitted on probes over T, E and dropout (docs/estimator.md); dropout
    made no measurable difference."""
    query = ins[0]
    value = ins[1] if len(ins) > 1 else ins[0]
    item = _itemsize(query)
    heads = getattr(layer, "num_heads", None) or getattr(layer, "_num_heads", None)
    key_dim = getattr(layer, "key_dim", None) or getattr(layer, "_key_dim", None)
    value_dim = getattr(layer, "value_dim", None) or getattr(layer, "_value_dim", None) or key_dim
    kv_heads = heads
    if heads is None:  # GroupedQueryAttention: fewer key/value heads than query heads
        heads = getattr(layer, "num_query_heads", None) or 1
        key_dim = value_dim = getattr(layer, "head_dim", None) or 1
        kv_heads = getattr(layer, "num_key_value_heads", None) or heads
    key_dim = key_dim or 1
    value_dim = value_dim or key_dim
    t = math.prod(d or 1 for d in query.shape[1:-1])
    s = math.prod(d or 1 for d in value.shape[1:-1])
    e_q, e_v = query.shape[-1] or 1, value.shape[-1] or 1
    e_out = outs[0].shape[-1] or 1 if outs else e_q
    q, k, v, a = t * heads * key_dim, s * kv_heads * key_dim, s * kv_heads * value_dim, t * heads * value_dim
    scores = heads * t * s
    internal = (q + k + v) * item + _MHA_SCORE_BUFFERS * scores * item
    flops = 2.0 * (q * e_q + k * e_v + v * e_v + a * e_out) + 2.0 * scores * (key_dim + value_dim)
    saved = frozenset(range(min(len(ins), 3)))
    return _Rule(saved_inputs=saved, internal=internal, flops=flops, expensive=True, name="attention")


# Score-sized buffers kept per MultiHeadAttention call (probed; see
# docs/estimator.md).
_MHA_SCORE_BUFFERS = 2.2


def _nested_rule(layer, ins, outs, batch_size):
    """A nested functional model or Sequential: the sum of its own calls,
    with the shapes it is called on."""
    graph = build_graph(layer)
    inner = [graph.graph["tensors"][k].shape for k in graph.graph["inputs"]]
    outer = [i.shape for i in ins]
    if outer != inner and [len(s) for s in outer] == [len(s) for s in inner]:
        graph.graph["tensors"], _ = propagate(graph, outer)
    costs, calls = _costs(graph, None)
    inner_layers = [graph.nodes[c.node]["layer"] for c in calls]
    inner_inputs = graph.graph["inputs"]
    inner_outputs = graph.graph["outputs"]
    saved_in = frozenset(i for i, k in enumerate(inner_inputs) if k in costs.saved)
    saved_out = frozenset(i for i, k in enumerate(inner_outputs) if k in costs.saved)
    internal = sum(c.kept_bytes for c in calls) - sum(
        costs.tensor_bytes[k] for k in set(inner_outputs) if k in costs.saved
    )
    return _Rule(
        saved_inputs=saved_in,
        saved_outputs=saved_out,
        internal=internal,
        flops=sum(c.flops for c in calls),
        expensive=any(c.expensive for c in calls),
        name="nested model",
        # Its backward runs one inner call at a time.
        workspace=max((c.workspace_bytes for c in calls), default=0),
        param_bytes=max((_param_bytes(layer) for layer in inner_layers), default=0),
    )


def _rule(layer, ins, outs, node=None):
    """The per-example rule of one call: `ins`/`outs` are its TensorInfos;
    `node`, its Keras `Node`, lets a layer of layers be looked into."""
    cls = type(layer).__name__
    out_bytes = sum(o.nbytes for o in outs)
    out_elems = sum(_elems(o) for o in outs)
    all_in = frozenset(range(len(ins)))
    all_out = frozenset(range(len(outs)))
    if isinstance(layer, keras.Model):
        return _nested_rule(layer, ins, outs, None)
    if not isinstance(layer, keras.layers.Layer):  # a keras.ops operation
        if cls in _OP_MATMUL:
            return _Rule(saved_inputs=all_in, flops=2.0 * out_elems * (ins[0].shape[-1] or 1), expensive=True, name="op matmul")
        if cls in _OP_FREE:
            return _Rule(flops=out_elems, name="op free")
        act = cls.lower()
        if act in _SAVES_OUTPUT or act in _SAVES_INPUT:
            saved_out, internal, _ = _activation_rule(act, 0, out_bytes)
            saved_in = all_in if act in _SAVES_INPUT else frozenset()
            return _Rule(saved_in, saved_out, max(0.0, internal - out_bytes), out_elems, name=f"op {act}")
        return _Rule(all_in, all_out, out_bytes, out_elems, name="unknown")
    if cls in _MATMUL:
        saved_out, internal, suffix = _activation_rule(_activation_name(layer), 0, out_bytes)
        return _Rule(all_in, saved_out, internal, _kernel_flops(layer, outs, ins), True, "matmul" + suffix)
    # Subclasses too: keras_hub's cached attention layers are MultiHeadAttention.
    attention = (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)
    if cls in _ATTENTION or isinstance(layer, attention):
        return _attention_rule(layer, ins, outs)
    if cls in _DOT_ATTENTION:
        q = _elems(ins[0])
        v = _elems(ins[1]) if len(ins) > 1 else q
        t, s = ins[0].shape[1] or 1, ins[1].shape[1] if len(ins) > 1 and ins[1].shape[1] else 1
        scores = t * s
        return _Rule(all_in, frozenset(), 2 * scores * _itemsize(ins[0]), 4.0 * scores * (q / t), True, "attention")
    if cls in _RNN:
        units = getattr(layer, "units", None) or getattr(getattr(layer, "cell", None), "units", 1)
        steps = ins[0].shape[1] or 1
        per_step = _RNN[cls] * units * _itemsize(ins[0])
        feat = ins[0].shape[-1] or 1
        gates = {"LSTM": 4, "GRU": 3}.get(cls, 1)
        flops = 2.0 * steps * gates * units * (feat + units)
        return _Rule(frozenset({0}), frozenset(), steps * per_step, flops, True, "rnn")
    if cls == "Bidirectional":
        inner = _rule(layer.forward_layer, ins, outs)
        return dataclasses.replace(inner, internal=2 * inner.internal, flops=2 * inner.flops, name="rnn")
    if cls == "TimeDistributed":
        return dataclasses.replace(_rule(layer.layer, ins, outs), name="time distributed")
    if cls in ("Dropout", "SpatialDropout1D", "SpatialDropout2D", "SpatialDropout3D", "AlphaDropout"):
        if not getattr(layer, "rate", 0):
            return _Rule(name="dropout off")
        # A one-byte keep mask (of the noise shape for spatial dropout).
        mask = out_elems
        if cls.startswith("Spatial") and outs:
            shape = outs[0].shape
            mask = (shape[-1] or 1) if len(shape) > 2 else out_elems
        if cls == "AlphaDropout":
            return _Rule(internal=out_bytes, flops=3.0 * out_elems, name="alpha dropout")
        return _Rule(internal=mask, flops=2.0 * out_elems, name="dropout")
    if cls == "GaussianDropout":
        return _Rule(internal=out_bytes if getattr(layer, "rate", 0) else 0.0, flops=2.0 * out_elems, name="dropout")
    if cls in ("BatchNormalization",):
        return _Rule(all_in, frozenset(), 0.0, 5.0 * out_elems, name="batch norm")
    if cls in ("LayerNormalization", "GroupNormalization", "UnitNormalization", "RMSNormalization"):
        return _Rule(all_in, frozenset(), out_bytes, 6.0 * out_elems, name="layer norm")
    if cls in ("ReLU", "ELU", "Softmax"):
        return _Rule(frozenset(), all_out, 0.0, out_elems, name=cls.lower())
    if cls == "Activation":
        name = _activation_name(layer)
        saved_out, internal, suffix = _activation_rule(name, 0, out_bytes)
        saved_in = all_in if name in _SAVES_INPUT else frozenset()
        internal = max(0.0, internal - out_bytes) if name in _SAVES_INPUT else internal
        return _Rule(saved_in, saved_out, internal, 4.0 * out_elems, name="activation" + suffix)
    if cls in _FREE:
        return _Rule(flops=out_elems, name="free")
    if cls in _SAVE_INPUTS:
        return _Rule(all_in, frozenset(), 0.0, out_elems, name="saves inputs")
    if cls in _SAVE_IN_AND_OUT:
        return _Rule(all_in, all_out, 0.0, sum(_elems(i) for i in ins), name="max pooling")
    if node is not None and layer._layers:
        composite = _composite_rule(layer, node, ins)
        if composite is not None:
            return composite
    return _Rule(all_in, all_out, out_bytes, out_elems, name="unknown")


@contextlib.contextmanager
def _recording_sublayer_calls(record):
    """Appends `(layer, args, kwargs, outputs)` to `record` for each layer
    call made directly (not inside another recorded call) while active."""
    base = keras.layers.Layer
    original = base.__call__
    depth = [0]

    def __call__(self, *args, **kwargs):
        top = depth[0] == 0
        depth[0] += 1
        try:
            outputs = original(self, *args, **kwargs)
        finally:
            depth[0] -= 1
        if top:
            record.append((self, args, kwargs, outputs))
        return outputs

    base.__call__ = __call__
    try:
        yield
    finally:
        base.__call__ = original


def _info(tensor):
    """A per-example `TensorInfo` for a backend tensor met while tracing."""
    shape = tuple(tensor.shape)
    dtype = keras.backend.standardize_dtype(tensor.dtype)
    n = math.prod(d if d is not None else 1 for d in shape[1:])
    return TensorInfo(key=id(tensor), producer=None, shape=shape, dtype=dtype, nbytes=n * _dtype_size(dtype))


def _tensors(structure):
    return [t for t in keras.tree.flatten(structure) if hasattr(t, "shape") and hasattr(t, "dtype")]


def _composite_rule(layer, node, ins):
    """A layer of layers outside Keras (keras_hub's `TransformerDecoder`,
    a user's block): the sum of what its sublayer calls keep, found by
    calling it symbolically in training on the shapes it is called with
    (batch 1). Raw ops between the sublayers are not counted. None when
    the symbolic call fails."""
    specs = {
        id(t): keras.KerasTensor((1,) + tuple(info.shape[1:]), dtype=info.dtype)
        for t, info in zip(node.input_tensors, ins)
    }
    args, kwargs = node.arguments.fill_in(specs)
    if "training" in _call_parameters(layer):
        kwargs = {**kwargs, "training": True}
    record = []
    try:
        with _recording_sublayer_calls(record):
            keras.src.backend.compute_output_spec(layer.call, *args, **kwargs)
    except Exception:  # a layer that only runs on real data: keep the generic rule
        return None
    kept, internal, flops, expensive = {}, 0.0, 0.0, False
    for sub, sub_args, sub_kwargs, sub_outputs in record:
        sub_tensors = _tensors((sub_args, sub_kwargs))
        sub_ins = [_info(t) for t in sub_tensors]
        sub_outs = [_info(t) for t in _tensors(sub_outputs)]
        rule = _rule(sub, sub_ins, sub_outs, _CallArguments(sub_args, sub_kwargs, sub_tensors))
        kept.update((sub_ins[i].key, sub_ins[i].nbytes) for i in rule.saved_inputs if _is_float(sub_ins[i]))
        kept.update((sub_outs[i].key, sub_outs[i].nbytes) for i in rule.saved_outputs)
        internal += rule.internal
        flops += rule.flops
        expensive = expensive or rule.expensive
    return _Rule(internal=internal + sum(kept.values()), flops=flops, expensive=expensive, name="layers inside")


@dataclasses.dataclass(frozen=True)
class _CallArguments:
    """A recorded sublayer call, shaped like a Keras `Node` for
    `_composite_rule`: its arguments and the tensors among them."""

    args: tuple
    kwargs: dict
    input_tensors: list

    @property
    def arguments(self):
        return self

    def fill_in(self, specs):
        return keras.tree.map_structure(lambda x: specs.get(id(x), x), (self.args, self.kwargs))


def _call_parameters(layer):
    try:
        return inspect.signature(layer.call).parameters
    except (TypeError, ValueError):
        return {}


def is_expensive(layer):
    """True for matmul-like layers: Dense, EinsumDense, convolutions,
    attention, recurrent layers (and nested models holding any)."""
    cls = type(layer).__name__
    if isinstance(layer, keras.Model):
        return any(is_expensive(inner) for inner in layer.layers)
    if cls in ("Bidirectional", "TimeDistributed"):
        inner = getattr(layer, "forward_layer", None) or getattr(layer, "layer", None)
        return is_expensive(inner)
    if not isinstance(layer, keras.layers.Layer):
        return cls in _OP_MATMUL
    return cls in _MATMUL or cls in _ATTENTION or cls in _DOT_ATTENTION or cls in _RNN


# ------------------------------------------------------------------ costs

# Transient bytes of a call's backward step: its input and output gradients
# (x its float input and output bytes), temporaries about the size of its
# internal buffers (x internal bytes: gelu's and attention's backward make
# several), and parameter gradients in flight (x its parameter bytes: the
# gradient, the optimizer's update temporary and the next call's gradient,
# since TensorFlow applies each gradient as soon as it is ready).
# Calibrated against measured peaks (docs/estimator.md).
_WORKSPACE_IO = 1.0
_WORKSPACE_INTERNAL = 1.0
_WORKSPACE_PARAMS = 3.0
# Bytes every plan pays, as multiples of the model outputs' bytes (the
# prediction, its error and its gradient in the loss).
_FIXED_OUTPUTS = 3.0


def _param_bytes(layer):
    return sum(math.prod(v.shape) * _var_itemsize(v) for v in getattr(layer, "trainable_weights", ()))


def _var_itemsize(v):
    dtype = keras.backend.standardize_dtype(v.dtype)
    return max(int("".join(c for c in dtype if c.isdigit()) or 32) // 8, 1)


def _is_float(info):
    return "float" in info.dtype


def _costs(graph, batch_size):
    """(`NodeCosts`, CallEstimates) for `graph`; per example when
    `batch_size` is None (parameter gradients left out then)."""
    tensors = graph.graph["tensors"]
    scale = batch_size or 1
    tensor_bytes = {k: info.nbytes * scale for k, info in tensors.items()}
    saved, internal, workspace, compute, rules = set(), {}, {}, {}, {}
    for key in topological_order(graph):
        data = graph.nodes[key]
        ins = [tensors[k] for k in data["in_keys"]]
        outs = [tensors[k] for k in data["out_keys"]]
        rule = _rule(data["layer"], ins, outs, data.get("node"))
        rules[key] = rule
        saved.update(ins[i].key for i in rule.saved_inputs if i < len(ins) and _is_float(ins[i]))
        saved.update(outs[i].key for i in rule.saved_outputs if i < len(outs))
        internal[key] = int(rule.internal * scale)
        io = sum(i.nbytes for i in ins if _is_float(i)) + sum(o.nbytes for o in outs)
        work = _WORKSPACE_IO * io + _WORKSPACE_INTERNAL * rule.internal if rule.workspace is None else rule.workspace
        workspace[key] = int(work * scale)
        if batch_size is not None:
            params = _param_bytes(data["layer"]) if rule.param_bytes is None else rule.param_bytes
            workspace[key] += int(_WORKSPACE_PARAMS * params)
        compute[key] = rule.flops * scale
    out_bytes = sum(tensor_bytes[k] for k in graph.graph["outputs"])
    costs = NodeCosts(
        tensor_bytes=tensor_bytes,
        saved=frozenset(saved),
        internal=internal,
        workspace=workspace,
        compute=compute,
        fixed=int(_FIXED_OUTPUTS * out_bytes),
        per_example=batch_size is None,
    )
    calls = []
    for key, rule in rules.items():
        made = [t for t in graph.graph["tensors"].values() if t.producer == key]
        kept = internal[key] + sum(tensor_bytes[t.key] for t in made if t.key in costs.saved)
        calls.append(
            CallEstimate(
                node=key,
                class_name=graph.nodes[key]["class_name"],
                kept_bytes=int(kept),
                workspace_bytes=workspace[key],
                flops=compute[key],
                expensive=rule.expensive,
                rule=rule.name,
            )
        )
    return costs, tuple(calls)


def resolve_batch_size(model_or_graph, batch_size=None):
    """`batch_size` if given, else the model's fixed batch dimension, else None.

    Raises:
        ValueError: `batch_size` is not a positive int (or None).
    """
    if batch_size is not None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"`batch_size` must be a positive int or None. Received: batch_size={batch_size!r}")
        return batch_size
    graph = model_or_graph if hasattr(model_or_graph, "graph") and hasattr(model_or_graph, "nodes") else None
    if graph is None:
        fn = functional_of(model_or_graph)
        dims = {t.shape[0] for t in fn.inputs}
    else:
        dims = {graph.graph["tensors"][k].shape[0] for k in graph.graph["inputs"]}
    dims.discard(None)
    return dims.pop() if len(dims) == 1 else None


def node_costs(graph, batch_size=None):
    """The per-call costs the planner consumes, at `batch_size`.

    Args:
        graph: a layer-call graph from `graphckpt.graph.build_graph`.
        batch_size: examples per step, or None for per-example bytes.

    Returns:
        A `graphckpt.plan.NodeCosts`.
    """
    return _costs(graph, batch_size)[0]


def call_estimates(graph, batch_size=None):
    """One `CallEstimate` per layer call of `graph`, in the planner's order."""
    return _costs(graph, batch_size)[1]


def estimate(model, plan=None, *, batch_size=None, graph=None, input_shape=None):
    """Estimates peak training-step activation memory, with or without a plan.

    Args:
        model: a built functional `keras.Model` or `keras.Sequential`.
        plan: a `graphckpt.Plan` for `model` (from `graphckpt.plan(...)`),
            or None for the model as it is.
        batch_size: examples per step; default the batch dimension of
            `input_shape`, else the model's fixed batch size, else a
            per-example estimate.
        graph: the model's layer-call graph, if already built (one from
            `graphckpt.shapes.sized_graph` is used as it is, unless
            `input_shape` is given too).
        input_shape: the input shapes to estimate for, batch dimension
            included, as `model.build` takes them: one shape tuple, a list
            of shapes, or a dict keyed by input name. Needed for real
            figures when the model's inputs have unknown dimensions
            (text models: (None, None)); without it they count as 1, with
            a warning.

    Returns:
        A `MemoryEstimate`.

    Raises:
        graphckpt.InvalidArgumentError: a wrong `input_shape`, or one whose
            batch dimension disagrees with `batch_size`.

    Example:
        >>> e = estimate(model, graphckpt.plan(model), batch_size=32)
        >>> e.peak_bytes / e.baseline_peak_bytes
    """
    graph = graph if graph is not None else build_graph(model)
    if batch_size is not None:
        resolve_batch_size(graph, batch_size)  # checked before comparing it with `input_shape`
    if input_shape is not None or not graph.graph.get("shapes_resolved"):
        graph, batch_size = sized_graph(graph, input_shape, batch_size, stacklevel=3)
    batch_size = resolve_batch_size(graph, batch_size)
    costs, calls = _costs(graph, batch_size)
    memory = MemoryModel(graph, costs)  # one O(n^2) table for the three estimates below
    baseline = baseline_peak(graph, costs, memory=memory)
    if plan is None:
        segments, peak, recompute = (), baseline, 0.0
    else:
        if not isinstance(plan, Plan):
            raise TypeError(f"`plan` must be a graphckpt.Plan or None. Received: plan={plan!r}")
        segments = segment_peaks(graph, plan, costs, memory=memory)
        peak = max(s.peak_bytes for s in segments)
        recompute = sum(s.recompute_cost for s in segments)
    by_node = {c.node: c for c in calls}
    return MemoryEstimate(
        batch_size=batch_size,
        baseline_peak_bytes=baseline,
        peak_bytes=peak,
        smallest_peak_bytes=smallest_peak(graph, costs, memory=memory),
        fixed_bytes=costs.fixed,
        segments=segments,
        calls=tuple(by_node[n] for n in memory.order),
        forward_flops=sum(c.flops for c in calls),
        recompute_flops=recompute,
        unknown_layers=tuple(sorted({c.class_name for c in calls if c.rule == "unknown"})),
    )
