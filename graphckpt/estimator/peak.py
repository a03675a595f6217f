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
  (`graphckpt.planner.segment_peaks`): during the backward pass, for each
  segment in reverse order, the boundary tensors held for the earlier
  segments plus the segment's own recompute peak; the baseline is one
  segment not recomputed. A budget plan's estimate is the planner's.
- The figure is the peak training-step memory *above the resident state*
  (weights, optimizer slots, the batch), as `graphckpt.measure` reports it.
- Shapes: the model's static shapes, with unknown dimensions given by
  `input_shape` (propagated to every tensor by `graphckpt.graph.shapes`); without
  it an unknown non-batch dimension counts as 1, with a warning.
- Batch size: the `batch_size` argument, else the batch dimension of
  `input_shape`, else the model's fixed batch dimension, else none: the
  estimate is then **per example**, activation memory only
  (parameter-sized gradient buffers left out), which scales linearly with
  the batch. All results are frozen dataclasses of plain values.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import keras

from graphckpt import errors, keras_compat
from graphckpt.estimator import cost_model, keras_rules, layers_inside, rules
from graphckpt.graph.attention import chunkable_attention
from graphckpt.graph.build import build_graph, functional_of
from graphckpt.graph.layer_graph import LayerGraph
from graphckpt.graph.shapes import InputShape, open_graph, propagate, sized_graph
from graphckpt.planner import (
    MemoryModel,
    NodeCosts,
    Plan,
    baseline_peak,
    segment_peaks,
    smallest_peak,
    topological_order,
)

__all__ = [
    "CallEstimate",
    "MemoryEstimate",
    "estimate",
    "node_costs",
    "call_estimates",
    "resolve_batch_size",
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
        seconds: estimated seconds of one forward run
            (`graphckpt.estimator.cost_model`): what the planner prices recompute by.
        prunable: its recompute is skipped when nothing else in its segment
            reads its outputs (`graphckpt.estimator.rules.LayerRule.prunable`), on a
            backend whose runtime drops unread ops (TensorFlow:
            `graphckpt.estimator.cost_model.PRUNING_BACKENDS`).
    """

    node: tuple
    class_name: str
    kept_bytes: int
    workspace_bytes: int
    flops: float
    expensive: bool
    rule: str
    seconds: float = 0.0
    prunable: bool = False


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak training-step activation memory of a model and plan.

    Attributes:
        batch_size: the batch size, or None for a per-example estimate.
        baseline_peak_bytes: the original model's estimated peak.
        peak_bytes: the plan's estimated peak (the baseline's without one).
        smallest_peak_bytes: the smallest estimated peak any plan reaches.
        fixed_bytes: the part every plan pays (loss and output gradients).
        segments: one `graphckpt.planner.SegmentPeak` per plan segment: bytes
            held before it, bytes it holds, its recompute peak and its peak.
        calls: one `CallEstimate` per layer call, in the planner's order.
        forward_flops: the model's forward cost.
        recompute_flops: the forward FLOPs the plan recomputes (calls pruned
            from a recompute left out).
        unknown_layers: classes estimated by the conservative fallback.
        forward_seconds: the model's forward time, estimated.
        recompute_seconds: the forward time the plan recomputes, estimated:
            what the planner minimizes under a budget.
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
    forward_seconds: float = 0.0
    recompute_seconds: float = 0.0

    @property
    def ratio(self):
        """Estimated peak / estimated baseline peak."""
        return self.peak_bytes / self.baseline_peak_bytes if self.baseline_peak_bytes else 1.0


# ------------------------------------------------------------------ rules
# Per-layer rules live in graphckpt.estimator.keras_rules and graphckpt.estimator.hub_rules (a
# registry keyed by class, in graphckpt.estimator.rules); the rules here look into
# nested models and, through graphckpt.estimator.layers_inside, layers of layers.


def _nested_rule(layer, ins, outs, batch_size):
    """A nested functional model or Sequential: the sum of its own calls,
    with the shapes it is called on."""
    graph = build_graph(layer)
    inner = [graph.tensors[k].shape for k in graph.inputs]
    outer = [i.shape for i in ins]
    if outer != inner and [len(s) for s in outer] == [len(s) for s in inner]:
        graph = graph.with_tensors(propagate(graph, outer)[0], shapes_resolved=False)
    costs, calls = _costs(graph, None)
    inner_layers = [graph.nodes[c.node]["layer"] for c in calls]
    inner_inputs = graph.inputs
    inner_outputs = graph.outputs
    saved_in = frozenset(i for i, k in enumerate(inner_inputs) if k in costs.saved)
    saved_out = frozenset(i for i, k in enumerate(inner_outputs) if k in costs.saved)
    internal = sum(c.kept_bytes for c in calls) - sum(
        costs.tensor_bytes[k] for k in set(inner_outputs) if k in costs.saved
    )
    return rules.LayerRule(
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
    if isinstance(layer, keras.Model):
        return _nested_rule(layer, ins, outs, None)
    if not isinstance(layer, keras.layers.Layer):  # a keras.ops operation
        return keras_rules.rule_of_op(layer, ins, outs)
    found = layers_inside.in_parameter_order(keras_rules.rule_of_layer, layer, ins, outs, node)
    if found is not None:
        return found
    if node is not None and keras_compat.has_sublayers(layer):
        composite = layers_inside.composite_rule(layer, node, ins, _rule, _workspace)
        if composite is not None:
            return composite
    return rules.unknown_rule(layer, ins, outs)


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
# Where the trainer frees the last step's gradients before the backward pass
# (PyTorch, `cost_model.backend_frees_gradients`), a call's backward makes
# its gradient, which stays (`NodeCosts.freed` counts it back), and the
# optimizer runs after the whole backward pass: x1, the gradient itself.
_WORKSPACE_PARAMS_FREED = 1.0
# Bytes every plan pays, as multiples of the model outputs' bytes: about one
# output-sized buffer stays alive through the whole backward pass (the
# prediction, or its gradient); the loss's other temporaries are gone before
# the first segment's backward runs, and the gradient of the outputs is in
# that segment's own peak (`out`). Measured with outputs larger than
# everything else (docs/estimator.md, "The memory model"): 3x the outputs
# over-estimates by about 2x the outputs.
_FIXED_OUTPUTS = 1.0


def _workspace(rule, ins, outs):
    """Per-example transient bytes of one call's backward step, parameter
    gradients left out: the rule's own figure, else the default formula."""
    if rule.workspace is not None:
        return rule.workspace
    io = sum(i.nbytes for i in ins if rules.is_float(i)) + sum(o.nbytes for o in outs)
    return _WORKSPACE_IO * io + _WORKSPACE_INTERNAL * rule.internal


def _param_bytes(layer):
    return sum(_var_bytes(v) for v in getattr(layer, "trainable_weights", ()))


def _freed_gradients(graph, order):
    """call -> bytes of the weight gradients freed before the backward pass
    (`NodeCosts.freed`) and made again by that call's backward: each
    trainable weight's, at the last call in `order` that uses it (the
    first whose backward runs)."""
    last = {}
    for key in order:
        for v in getattr(graph.nodes[key]["layer"], "trainable_weights", ()):
            last[id(v)] = (key, _var_bytes(v))
    freed = {}
    for key, nbytes in last.values():
        freed[key] = freed.get(key, 0) + nbytes
    return freed


def _var_bytes(v):
    dtype = keras.backend.standardize_dtype(v.dtype)
    return math.prod(v.shape) * max(int("".join(c for c in dtype if c.isdigit()) or 32) // 8, 1)


def _costs(graph, batch_size, attention_chunks=None):
    """(`NodeCosts`, CallEstimates) for `graph`; per example when
    `batch_size` is None (parameter gradients left out then); attention
    cores in `attention_chunks` chunks, if given."""
    tensors = graph.tensors
    scale = batch_size or 1
    tensor_bytes = {k: info.nbytes * scale for k, info in tensors.items()}
    saved, internal, workspace, compute, by_call, forward_temp, reads = set(), {}, {}, {}, {}, {}, {}
    prunable, prunes = set(), cost_model.backend_prunes()
    frees = batch_size is not None and cost_model.backend_frees_gradients()
    params_factor = _WORKSPACE_PARAMS_FREED if frees else _WORKSPACE_PARAMS
    order = topological_order(graph)
    for key in order:
        data = graph.nodes[key]
        ins = [tensors[k] for k in data["in_keys"]]
        outs = [tensors[k] for k in data["out_keys"]]
        rule = _rule(data["layer"], ins, outs, data.get("node"))
        if attention_chunks and chunkable_attention(data["layer"]):
            rule = layers_inside.in_parameter_order(
                functools.partial(keras_rules.chunked_attention, chunks=attention_chunks),
                data["layer"], ins, outs, data.get("node"),
            )
        by_call[key] = rule
        reads[key] = frozenset(ins[i].key for i in rule.saved_inputs if i < len(ins) and rules.is_float(ins[i]))
        saved.update(reads[key], (outs[i].key for i in rule.saved_outputs if i < len(outs)))
        internal[key] = int(rule.internal * scale)
        workspace[key] = int(_workspace(rule, ins, outs) * scale)
        if batch_size is not None:
            params = _param_bytes(data["layer"]) if rule.param_bytes is None else rule.param_bytes
            workspace[key] += int(params_factor * params)
        if frees:
            forward_temp[key] = int(keras_rules.forward_temporaries(data["layer"], outs) * scale)
        compute[key] = cost_model.nanoseconds(cost_model.call_seconds(data["class_name"], rule, ins, outs, batch_size))
        if prunes and rule.is_prunable:
            prunable.add(key)
    out_bytes = sum(tensor_bytes[k] for k in graph.outputs)
    costs = NodeCosts(
        tensor_bytes=tensor_bytes,
        saved=frozenset(saved),
        internal=internal,
        workspace=workspace,
        compute=compute,
        fixed=int(_FIXED_OUTPUTS * out_bytes),
        per_example=batch_size is None,
        prunable=frozenset(prunable),
        segment_cost=cost_model.nanoseconds(cost_model.segment_seconds()),
        freed=_freed_gradients(graph, order) if frees else {},
        forward_temp=forward_temp,
        reads=reads if cost_model.backend_holds_read_values() else {},
    )
    calls = []
    for key, rule in by_call.items():
        made = [t for t in graph.tensors.values() if t.producer == key]
        kept = internal[key] + sum(tensor_bytes[t.key] for t in made if t.key in costs.saved)
        calls.append(
            CallEstimate(
                node=key,
                class_name=graph.nodes[key]["class_name"],
                kept_bytes=int(kept),
                workspace_bytes=workspace[key],
                flops=rule.flops * scale,
                expensive=rule.expensive,
                rule=rule.name,
                seconds=compute[key] * cost_model.NANOSECOND,
                prunable=key in costs.prunable,
            )
        )
    return costs, tuple(calls)


def resolve_batch_size(model_or_graph, batch_size=None):
    """`batch_size` if given, else the model's fixed batch dimension, else None.

    Raises:
        graphckpt.InvalidArgumentError: `batch_size` is not a positive int (or None).
    """
    if batch_size is not None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise errors.InvalidArgumentError(
                f"`batch_size` must be a positive int or None. Received: batch_size={batch_size!r}"
            )
        return batch_size
    graph = model_or_graph if hasattr(model_or_graph, "graph") and hasattr(model_or_graph, "nodes") else None
    if graph is None:
        fn = functional_of(model_or_graph)
        dims = {t.shape[0] for t in fn.inputs}
    else:
        dims = {graph.tensors[k].shape[0] for k in graph.inputs}
    dims.discard(None)
    return dims.pop() if len(dims) == 1 else None


def node_costs(graph, batch_size=None, attention_chunks=None):
    """The per-call costs the planner consumes, at `batch_size`.

    Args:
        graph: a layer-call graph from `graphckpt.graph.build.build_graph`.
        batch_size: examples per step, or None for per-example bytes.
        attention_chunks: count attention cores in this many chunks
            (`graphckpt.runtime.attention`), or None.

    Returns:
        A `graphckpt.planner.NodeCosts`.
    """
    return _costs(graph, batch_size, attention_chunks)[0]


def call_estimates(graph, batch_size=None):
    """One `CallEstimate` per layer call of `graph`, in the planner's order."""
    return _costs(graph, batch_size)[1]


def estimate(
    model: keras.Model,
    plan: Plan | None = None,
    *,
    batch_size: int | None = None,
    graph: LayerGraph | None = None,
    input_shape: InputShape | None = None,
) -> MemoryEstimate:
    """Estimates peak training-step activation memory, with or without a plan.

    Args:
        model: a built functional `keras.Model` or `keras.Sequential`.
        plan: a `graphckpt.Plan` for `model` (from `graphckpt.plan(...)`),
            or None for the model as it is.
        batch_size: examples per step; default the batch dimension of
            `input_shape`, else the model's fixed batch size, else a
            per-example estimate.
        graph: the model's layer-call graph, if already built (one from
            `graphckpt.graph.shapes.sized_graph` is used as it is, unless
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
            batch dimension disagrees with `batch_size`; a `batch_size` that
            is not a positive int.
        graphckpt.InvalidArgumentTypeError: `plan` is not a `Plan` (or None).

    Example:
        >>> e = estimate(model, graphckpt.plan(model), batch_size=32)
        >>> e.peak_bytes / e.baseline_peak_bytes
    """
    chunks = plan.attention_chunks if isinstance(plan, Plan) else None
    if graph is None and isinstance(plan, Plan) and plan.open_layers:  # as the plan was made
        graph, input_shape = open_graph(
            model, input_shape or plan.opened_at, batch_size, closed=plan.kept_closed, whole_attention=bool(chunks)
        )
    elif graph is None:
        graph = build_graph(model)
    if batch_size is not None:
        resolve_batch_size(graph, batch_size)  # checked before comparing it with `input_shape`
    if input_shape is not None or not graph.shapes_resolved:
        graph, batch_size = sized_graph(graph, input_shape, batch_size, stacklevel=3)
    batch_size = resolve_batch_size(graph, batch_size)
    costs, calls = _costs(graph, batch_size)
    memory = MemoryModel(graph, costs)  # one O(n^2) table for the three estimates below
    baseline = baseline_peak(graph, costs, memory=memory)
    if chunks:  # the plan's cores in chunks; the baseline's whole
        costs, calls = _costs(graph, batch_size, chunks)
        memory = MemoryModel(graph, costs)
    if plan is None:
        segments, peak, recompute, recompute_flops = (), baseline, 0.0, 0.0
    else:
        if not isinstance(plan, Plan):
            raise errors.InvalidArgumentTypeError(
                f"`plan` must be a graphckpt.Plan or None. Received: plan={plan!r}. "
                "Tip: pass what `graphckpt.plan(model)` returns, or None for the model without checkpointing."
            )
        segments = segment_peaks(graph, plan, costs, memory=memory)
        peak = max(s.peak_bytes for s in segments)
        recompute = sum(s.recompute_cost for s in segments)
        recompute_flops = cost_model.recompute_flops(graph, plan, calls)
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
        recompute_flops=recompute_flops,
        unknown_layers=tuple(sorted({c.class_name for c in calls if c.rule == "unknown"})),
        forward_seconds=sum(c.seconds for c in calls),
        recompute_seconds=recompute * cost_model.NANOSECOND,
    )
