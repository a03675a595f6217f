"""The estimator's rule for a layer of layers outside Keras (keras_hub's
`TransformerDecoder`, a user's block): what its sublayer calls keep, found
by calling it symbolically and recording the calls it makes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math

import keras

from graphckpt import keras_compat
from graphckpt.estimator import rules
from graphckpt.graph.build import TensorInfo, dtype_size

__all__ = ["composite_rule", "in_parameter_order", "parameter_order"]


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
    return TensorInfo(key=id(tensor), producer=None, shape=shape, dtype=dtype, nbytes=n * dtype_size(dtype))


def _tensors(structure):
    return [t for t in keras.tree.flatten(structure) if hasattr(t, "shape") and hasattr(t, "dtype")]


def composite_rule(layer, node, ins, rule_of, workspace_of):
    """A layer of layers outside Keras (keras_hub's `TransformerDecoder`,
    a user's block): the sum of what its sublayer calls keep, found by
    calling it symbolically in training on the shapes it is called with
    (batch 1). Raw ops between the sublayers are not counted. None when
    the symbolic call fails.

    `rule_of(layer, ins, outs, node)` gives each sublayer call's rule (the
    estimator's, which may come back here for a sublayer of layers), and
    `workspace_of(rule, ins, outs)` the transient bytes of its backward
    step. The sublayers' backward steps run one at a time, in reverse, each
    after the later ones have freed what they kept: the layer's backward
    peaks at the largest over its sublayers of (what it and the sublayers
    before it keep + its workspace), plus the gradients of the layer's own
    inputs and outputs, alive throughout. Its workspace is that peak less
    what the layer keeps (the planner adds the two)."""
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
            outputs = keras_compat.compute_output_spec(layer.call, *args, **kwargs)
    except Exception:  # a layer that only runs on real data: keep the generic rule
        return None
    kept, internal, flops, expensive, peak = {}, 0.0, 0.0, False, 0.0
    for sub, sub_args, sub_kwargs, sub_outputs in record:
        sub_tensors = _tensors((sub_args, sub_kwargs))
        sub_ins = [_info(t) for t in sub_tensors]
        sub_outs = [_info(t) for t in _tensors(sub_outputs)]
        rule = rule_of(sub, sub_ins, sub_outs, _CallArguments(sub_args, sub_kwargs, sub_tensors))
        kept.update((sub_ins[i].key, sub_ins[i].nbytes) for i in rule.saved_inputs if rules.is_float(sub_ins[i]))
        kept.update((sub_outs[i].key, sub_outs[i].nbytes) for i in rule.saved_outputs)
        internal += rule.internal
        flops += rule.flops
        expensive = expensive or rule.expensive
        # While this sublayer's backward runs, what the later ones kept is
        # already freed.
        peak = max(peak, internal + sum(kept.values()) + workspace_of(rule, sub_ins, sub_outs))
    total = internal + sum(kept.values())
    io = sum(i.nbytes for i in ins if rules.is_float(i)) + sum(_info(t).nbytes for t in _tensors(outputs))
    return rules.LayerRule(
        internal=total,
        flops=flops,
        expensive=expensive,
        name="layers inside",
        workspace=peak - total + io,
    )


@dataclasses.dataclass(frozen=True)
class _CallArguments:
    """A recorded sublayer call, shaped like a Keras `Node` for
    `composite_rule`: its arguments and the tensors among them."""

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


def parameter_order(layer, node):
    """The indices of a call's input tensors (`node.input_tensors`) in the
    order of `layer.call`'s parameters, or None where that is their order
    already (or unknown).

    Keras flattens a call's keyword arguments by name, so keras_hub's
    `attention(query=x, value=x, attention_mask=mask)` has the mask first,
    and a rule that reads the query as its first input read the mask: a
    boolean causal mask made the scores a quarter of their bytes
    (benchmarks/notes.md, "The LoRA line")."""
    arguments = getattr(node, "arguments", None)
    if arguments is None or not arguments.kwargs:
        return None
    rank = {name: i for i, name in enumerate(_call_parameters(layer))}
    keys = []
    for i, arg in enumerate(arguments.args):
        keys += [(i, j) for j, _ in enumerate(_tensors(arg))]
    for name in sorted(arguments.kwargs):  # Keras's order
        keys += [(rank.get(name, len(rank)), j) for j, _ in enumerate(_tensors(arguments.kwargs[name]))]
    if len(keys) != len(node.input_tensors):
        return None
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return None if order == list(range(len(keys))) else order


def in_parameter_order(rule_of, layer, ins, outs, node):
    """`rule_of(layer, ins, outs)` with `ins` in the order of the layer's
    call parameters (`layers_inside.parameter_order`: query before an
    attention mask passed by keyword), its saved inputs mapped back."""
    order = parameter_order(layer, node) if node is not None else None
    if order is None:
        return rule_of(layer, ins, outs)
    rule = rule_of(layer, [ins[i] for i in order], outs)
    if rule is None:
        return None
    return dataclasses.replace(rule, saved_inputs=frozenset(order[i] for i in rule.saved_inputs if i < len(order)))
