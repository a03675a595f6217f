"""(model, plan) -> a new functional model made of `Segment` layers.

The new model reuses the original's input tensors and the very same layer
objects: each segment's sub-model replays the original layer calls
(`Node.arguments`, the way `Functional` runs its own graph) on fresh
`keras.Input`s. Replaying a call adds an inbound node to the layer, as any
functional reuse of a layer does; the original model's own nodes, config
and weights are untouched. If the rewrite fails part-way, the added nodes
are removed again.
"""

import re

import keras
from keras import tree

from graphckpt import errors, keras_compat
from graphckpt.graph.attention import mark_attention_chunks
from graphckpt.graph.build import functional_of, live_tensors
from graphckpt.runtime import attention
from graphckpt.runtime.segment import Segment

__all__ = ["rewrite", "OutputName"]


@keras.saving.register_keras_serializable(package="graphckpt")
class OutputName(keras.layers.Layer):
    """Gives a checkpointed model's output its original name, and changes
    nothing else.

    Keras names a model's outputs after the layers that make them, and a
    loss or metric dict is keyed by those names. An output made inside a
    segment needs a layer of its own with that name. This one returns its
    input as it is: the same tensor, with its dtype, mask and logits
    (`_keras_logits`). An `Identity` layer would cast it to its own dtype
    policy (float16 under `mixed_float16`, where the original output may be
    float32).
    """

    def __init__(self, **kwargs):
        kwargs.setdefault("autocast", False)
        super().__init__(**kwargs)
        self.supports_masking = True
        keras_compat.keep_input_dtypes(self)  # no cast to this layer's policy
        self.built = True

    def call(self, inputs):
        return inputs

    def compute_output_spec(self, inputs):
        return keras.KerasTensor(inputs.shape, dtype=inputs.dtype, sparse=inputs.sparse, ragged=inputs.ragged)


def _replay(graph, nodes, values, calls, names=None):
    """Calls the layers of `nodes` again, on the tensors in `values` (graph
    tensor key -> tensor), adding the results to `values` and the new Keras
    nodes to `calls`. A run of calls made inside one opened layer's call
    (`graph.nodes[n]["opened"]`) is replayed in a functional model of its
    own, a fragment named from `names` (`_Names`): layer names need to be
    unique only within one functional model, and keras_hub's and Keras's
    own composite layers reuse theirs (`MultiHeadAttention`'s `query`)."""
    run = []
    for node_key in list(nodes) + [None]:
        opened = None if node_key is None else graph.nodes[node_key].get("opened")
        if run and (node_key is None or opened != graph.nodes[run[0]].get("opened")):
            _replay_fragment(graph, run, values, calls, names)
            run = []
        if opened is not None:
            run.append(node_key)
        elif node_key is not None:
            _replay_calls(graph, [node_key], values, calls)


def _replay_fragment(graph, run, values, calls, names):
    """Replays `run` (calls inside one opened layer's call) as a fragment:
    a functional model of those calls, called on `values`."""
    inside = set(run)
    produced = {k for n in run for k in graph.nodes[n]["out_keys"]}
    needed = [k for n in run for k in graph.nodes[n]["in_keys"] if k not in produced]
    needed = list(dict.fromkeys(needed))
    outputs = graph.outputs
    exported = [
        k
        for n in run
        for k in graph.nodes[n]["out_keys"]
        if k in outputs or any(s not in inside and k in graph.nodes[s]["in_keys"] for s in graph.successors(n))
    ]
    tensors = graph.tensors
    local = {k: keras.Input(batch_shape=tensors[k].shape, dtype=tensors[k].dtype) for k in needed}
    inner_calls = []
    fragment_values = dict(local)
    _replay_calls(graph, run, fragment_values, inner_calls)
    name = _unique("fragment", names.taken, avoid=lambda c: c in names.source)
    fragment = keras.Model([local[k] for k in needed], [fragment_values[k] for k in exported], name=name)
    fragment.input_spec = None
    keras_compat.keep_input_dtypes(fragment)  # its calls cast what they take, as in the source
    _run_in_call_order(fragment, inner_calls)
    outs = fragment([values[k] for k in needed])
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    calls.append(keras_compat.inbound_nodes(fragment)[-1])
    values.update(zip(exported, outs))


def _replay_calls(graph, nodes, values, calls):
    """Calls the layers of `nodes` again, one by one (see `_replay`)."""
    for node_key in nodes:
        data = graph.nodes[node_key]
        node = data["node"]
        by_id = {id(t): values[k] for t, k in zip(node.input_tensors, data["in_keys"])}
        args, kwargs = node.arguments.fill_in(by_id)
        operation = node.operation
        if data.get("attention_chunks"):  # its core in chunks (graphckpt.runtime.attention)
            operation = attention.chunked(operation, data["attention_chunks"])
        if data["training"] is not None and keras_compat.takes_call_context_arg(node.operation, "training"):
            # What the enclosing nested model's call passed on to this call,
            # resolved against the call's own as Keras resolves them.
            kwargs["training"] = keras_compat.resolve_training(data["training"], kwargs.get("training"))
        try:
            outputs = tree.flatten(operation(*args, **kwargs))
        except Exception as e:
            raise _cannot_replay(node.operation, e) from e
        calls.append(keras_compat.inbound_nodes(operation)[-1])
        values.update(zip(data["out_keys"], outputs))


def _cannot_replay(layer, error):
    """The error for a layer that fails when called again on new inputs."""
    # Keras wraps a call's error with bold text and the arguments received.
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(error)).splitlines()]
    reason = " ".join(line for line in lines if line and not line.startswith(("Arguments received", "•")))
    return errors.UnsupportedModelError(
        f"Layer '{layer.name}' ({type(layer).__name__}) could not be called again on new "
        f"inputs, which graphckpt does to build the segment that holds it. It raised "
        f"{type(error).__name__}: {reason} Tip: a layer must be callable more than once, as "
        "when shared in the functional API: create its state in `build()`, and give it "
        "`compute_output_spec()` if Keras cannot infer its output."
    )


def _run_in_call_order(fn, calls):
    """Makes Keras run the functional model `fn`'s calls in the order of
    `calls`, the order they were made in.

    Keras runs a functional model by depth from its outputs, which can swap
    two calls that do not depend on each other. Calls sharing state (a
    shared BatchNormalization or Dropout) must keep the original's order,
    which the plan keeps (`plan.topological_order`), or they read and write
    that state in another order: other statistics, other masks.
    """
    rank = {id(node): i for i, node in enumerate(calls)}
    by_depth = keras_compat.nodes_by_depth(fn)
    nodes = [node for depth in sorted(by_depth, reverse=True) for node in by_depth[depth]]
    for n in nodes:
        # A node Keras made itself while a layer ran inline (an Embedding's
        # mask op) runs right after the nodes it reads.
        if id(n) not in rank:
            rank[id(n)] = max((rank.get(id(p), -1) for p in n.parent_nodes), default=-1) + 0.5
    ordered = [n for n in nodes if n.is_input] + sorted((n for n in nodes if not n.is_input), key=lambda n: rank[id(n)])
    keras_compat.set_nodes_by_depth(fn, {len(ordered) - 1 - i: [node] for i, node in enumerate(ordered)})
    return fn


def _segment_model(graph, seg, name, policy, names):
    """The functional sub-model of one planned segment, with the source
    model's dtype `policy`. A segment cut again (`seg.inner`) holds its
    recomputed inner segments as `Segment` layers of their own, named from
    `name` (`names`: `_Names`)."""
    tensors = graph.tensors
    values = {}
    inputs = []
    for key in seg.inputs:
        info = tensors[key]
        x = keras.Input(
            batch_shape=info.shape, dtype=info.dtype, sparse=info.sparse, ragged=info.ragged, name=f"{name}_in{len(inputs)}"
        )
        values[key] = x
        inputs.append(x)
    calls = []
    if seg.inner:
        for sub in seg.inner:
            _add_segment(graph, sub, values, calls, policy, names, prefix=f"{name}_")
    else:
        _replay(graph, seg.nodes, values, calls, names)
    outputs = [values[key] for key in seg.outputs]
    sub = keras.Model(inputs=inputs, outputs=outputs, name=f"{name}_model")
    # A model's policy sets the autocast scope its layers run in.
    keras_compat.set_dtype_policy(sub, policy)
    # The inputs' declared shapes are what the source graph's symbolic
    # tensors say; a layer may return another (keras_hub's SigLIP embedding
    # declares 17 tokens and returns 16). The source model never checks a
    # tensor in its interior against them, so a segment does not either.
    sub.input_spec = None
    return _run_in_call_order(sub, calls)


def _live(seg, live):
    """Indices of `seg`'s outputs the model's outputs depend on (`live`:
    graph tensor keys from `live_tensors`), or None for all of them."""
    indices = [i for i, key in enumerate(seg.outputs) if key in live]
    return None if len(indices) == len(seg.outputs) else indices


def _unique(name, taken, avoid=lambda candidate: False):
    """`name`, or `name_1`, `name_2`, ...: the first not in `taken` nor
    refused by `avoid`; it is added to `taken`."""
    candidate, i = name, 1
    while candidate in taken or avoid(candidate):
        candidate, i = f"{name}_{i}", i + 1
    taken.add(candidate)
    return candidate


def _source_names(model, graph):
    """Every layer and input name in `model`, at any depth: a generated
    name must not take one (an output layer named `segment_1` keeps its
    name, so a loss dict keyed by it still applies)."""
    names = {t.name for t in functional_of(model).inputs}
    for _, data in graph.nodes(data=True):
        layer = data["layer"]
        inner = keras_compat.sublayers(layer) if isinstance(layer, keras.layers.Layer) else [layer]
        names.update(op.name for op in inner)
    return names


class _Names:
    """The names taken in the new model (`taken`), and those of the source
    model (`source`), which a generated name must not take."""

    def __init__(self, taken, source, live):
        self.taken, self.source, self.live = taken, source, live

    def segment(self, seg, prefix):
        """A name for `seg`'s layer whose derived names (`_model`,
        `_in<k>`) are free too."""

        def clashes(name):
            derived = {name, f"{name}_model"} | {f"{name}_in{k}" for k in range(len(seg.inputs))}
            return bool(derived & self.source)

        return _unique(f"{prefix}{seg.index}", self.taken, avoid=clashes)


def _add_segment(graph, seg, values, calls, policy, names, prefix="segment_"):
    """Calls `seg`'s layers on `values` (graph tensor key -> tensor): as
    they are when it is not recomputed, else through a new `Segment`."""
    if not seg.remat:
        _replay(graph, seg.nodes, values, calls, names)
        return
    name = names.segment(seg, prefix)
    sub = _segment_model(graph, seg, name, policy, names)
    layer = Segment(sub, live_outputs=_live(seg, names.live), name=name, dtype=policy)
    # `mask` given as None for each input, so that Keras records no masks
    # of its own: at run time the segment reads the masks its inputs carry
    # then, as the layers inside did in the original (a layer before may
    # have removed one since it was made).
    outs = layer([values[k] for k in seg.inputs], mask=[None] * len(seg.inputs))
    calls.append(keras_compat.inbound_nodes(layer)[-1])
    values.update(zip(seg.outputs, outs))


def _nodes_lengths(graph):
    layers = {id(d["layer"]): d["layer"] for _, d in graph.nodes(data=True)}
    return {i: (layer, *keras_compat.call_counts(layer)) for i, layer in layers.items()}


def _restore_nodes(lengths):
    for layer, n_in, n_out in lengths.values():
        keras_compat.truncate_calls(layer, n_in, n_out)


def rewrite(model, graph, plan, model_class):
    """Builds the checkpointed functional model for `plan`.

    Args:
        model: the built functional model (or Sequential) `graph` came from.
        graph: its layer-call graph.
        plan: a `graphckpt.planner.Plan` over `graph`.
        model_class: the new model's class, called as
            `model_class(inputs=, outputs=, source=, plan=, name=)`:
            `graphckpt.runtime.checkpointed.CheckpointedModel`, whose
            `checkpointed_model` is the way to call this.

    Returns:
        A new `model_class` (a functional `keras.Model`) with the same
        inputs and output structure and the same dtype policy, whose layers
        are `Segment`s (plus one `OutputName` per output made in a segment,
        which keeps the original output name). It remembers `model` and
        `plan`, which is what it saves.
    """
    fn = functional_of(model)
    policy = model.dtype_policy
    if plan.attention_chunks:
        mark_attention_chunks(graph, plan.attention_chunks)
    source_names = _source_names(model, graph)
    lengths = _nodes_lengths(graph)
    try:
        values = dict(zip(graph.inputs, fn.inputs))
        taken = {t.name for t in fn.inputs}
        # Segments with `remat=False` (budget plans, policies) call their
        # layers directly in the new model, under their own names.
        inline = {n for seg in plan.segments if not seg.remat for n in seg.nodes}
        taken |= {graph.nodes[n]["layer"].name for n in inline}
        calls = []
        names = _Names(taken, source_names, live_tensors(graph))
        for seg in plan.segments:
            _add_segment(graph, seg, values, calls, policy, names)
        outputs = []
        for key, original in zip(graph.outputs, fn.outputs):
            out = values[key]
            # An output made inline by the original's own output layer
            # already carries its name.
            want = keras_compat.keras_history(original).operation.name
            if keras_compat.keras_history(out).operation.name != want:
                named = OutputName(name=_unique(want, taken), dtype=policy)
                out = named(out)
                calls.append(keras_compat.inbound_nodes(named)[-1])
            outputs.append(out)
        inputs_struct, outputs_struct = keras_compat.structures(fn)
        outputs = tree.pack_sequence_as(outputs_struct, outputs)
        checkpointed = model_class(
            inputs=inputs_struct,
            outputs=outputs,
            source=model,
            plan=plan,
            name=f"{model.name}_checkpointed",
        )
        return _run_in_call_order(checkpointed, calls)
    except Exception:
        _restore_nodes(lengths)
        raise
