"""Keras functional model -> `networkx.DiGraph` of layer calls.

Contract:
- One node per layer *call* (Keras `Node`), keyed `(layer_name, node_index)`:
  a layer shared by two calls gives two nodes. Model inputs are nodes too,
  with `kind="input"`; every other node has `kind="layer"`.
- A nested functional model or Sequential used as a layer is **one node**;
  it is not flattened. (To checkpoint inside a nested backbone, checkpoint the
  backbone itself.)
- One edge per producer -> consumer pair. Its `tensors` attribute lists the
  keys of the tensors that flow along it; a key is
  `(layer_name, node_index, tensor_index)`, Keras's own `_keras_history`.
- `graph.graph["state_chains"]` lists tuples of layer calls that share
  state (the non-trainable variables of a shared BatchNormalization or
  Dropout; for all Lambda and custom layers, whatever their code may share,
  such as Keras's global seed generator), each in Keras's execution order:
  they must run in that order.
- `graph.graph["tensors"]` maps each tensor key to a `TensorInfo`;
  `graph.graph["inputs"]` / `["outputs"]` list the model's input and output
  tensor keys, flattened, in the model's order.

Node attributes: `kind`, `layer` (the Keras operation), `class_name`,
`position` (the call's position in Keras's execution order), `node` (the
Keras `Node`), `in_keys` (the graph keys of the call's input tensors, aligned
with `node.input_tensors`) and `out_keys` (those of `node.outputs`). Read a
call's tensors through `in_keys` / `out_keys`, not through the Keras node.
The planner reads only `kind`, `position` and the tensor data.
"""

import dataclasses
import math

import networkx as nx

__all__ = ["TensorInfo", "build_graph", "dependencies", "functional_of", "tensor_key"]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Static facts about one symbolic tensor.

    `nbytes` counts one example (the batch dimension left out); unknown
    dimensions count as 1 (`graphckpt.shapes.sized_graph` gives every
    tensor its real shape from the input shapes, and warns when it can't).
    """

    key: tuple
    producer: tuple
    shape: tuple
    dtype: str
    nbytes: int


def tensor_key(tensor):
    """The graph key of a KerasTensor: `(layer_name, node_index, index)`."""
    op, node_index, tensor_index = tensor._keras_history
    return (op.name, node_index, tensor_index)


def _node_key(node):
    op = node.operation
    return (op.name, op._inbound_nodes.index(node))


def _itemsize(dtype):
    import numpy as np

    try:
        return np.dtype(str(dtype)).itemsize
    except TypeError:  # bfloat16 and friends are not numpy dtypes
        digits = "".join(c for c in str(dtype) if c.isdigit())
        return max(int(digits or 32) // 8, 1)


def _tensor_info(tensor, producer):
    shape = tuple(tensor.shape)
    per_example = math.prod(d if d is not None else 1 for d in shape[1:])
    return TensorInfo(
        key=tensor_key(tensor),
        producer=producer,
        shape=shape,
        dtype=str(tensor.dtype),
        nbytes=int(per_example * _itemsize(tensor.dtype)),
    )


def functional_of(model):
    """The `Functional` that holds `model`'s graph (a Sequential's inner one)."""
    import keras

    if isinstance(model, keras.Sequential):
        return model._functional
    return model


def dependencies(model, outputs=None):
    """What a functional model's outputs are computed from, through its
    layer graph.

    A nested functional model counts only through the outputs used, and
    passes on only the inputs those read: a branch that only feeds an unused
    output, or an input a nested model ignores, is not a dependency.

    Args:
        model: a built functional model or Sequential.
        outputs: indices into its flat outputs (default: all of them).

    Returns:
        `(tensors, variables)`: the ids of the model's KerasTensors the
        outputs depend on (outputs and inputs included), and the trainable
        variables read on the way.
    """
    import keras

    fn = functional_of(model)
    wanted = fn.outputs if outputs is None else [fn.outputs[i] for i in outputs]
    needed = {id(t) for t in wanted}
    read = {}
    for depth in sorted(fn._nodes_by_depth):  # from the outputs back
        for node in fn._nodes_by_depth[depth]:
            used = [i for i, t in enumerate(node.outputs) if id(t) in needed]
            if node.is_input or not used:
                continue
            op, args = node.operation, node.input_tensors
            inner = functional_of(op) if isinstance(op, keras.Model) else None
            if isinstance(inner, keras.src.models.functional.Functional) and len(args) == len(inner.inputs):
                inner_tensors, variables = dependencies(inner, used)
                args = [a for a, x in zip(args, inner.inputs) if id(x) in inner_tensors]
            else:
                variables = getattr(op, "trainable_variables", ())  # ops have none
            read.update((id(v), v) for v in variables)
            needed.update(id(t) for t in args)
    return needed, list(read.values())


def _runs_user_code(layer):
    """Whether `layer`, or a layer nested in it, runs code graphckpt cannot
    see into: a Lambda, or a layer or op defined outside Keras."""
    import keras

    inner = layer._flatten_layers() if isinstance(layer, keras.layers.Layer) else [layer]
    return any(isinstance(op, keras.layers.Lambda) or not type(op).__module__.startswith("keras.") for op in inner)


def _state_chains(graph):
    """Chains of layer calls that share state, each in Keras's execution
    order.

    A layer called twice (or a nested model holding it) updates the same
    BatchNormalization statistics or seed-generator state on each call, and
    each call reads what the one before it wrote: such calls only give the
    original's results in the original's order. User code (Lambda and custom
    layers) may share state no layer owns, e.g. Keras's global seed generator
    (`keras.random.*` with `seed=None`), so all its calls form one chain too.
    """
    by_variable = {}
    calls = sorted(graph.nodes(data=True), key=lambda item: item[1]["position"])
    for key, data in calls:
        if data["kind"] == "input":
            continue
        for v in getattr(data["layer"], "non_trainable_variables", ()):  # ops have none
            by_variable.setdefault(id(v), []).append(key)
        if _runs_user_code(data["layer"]):
            by_variable.setdefault("user code", []).append(key)
    chains = (tuple(keys) for keys in by_variable.values() if len(keys) > 1)
    return list(dict.fromkeys(chains))


def build_graph(model):
    """Builds the layer-call graph of a built functional model.

    Args:
        model: A built `keras.Model` made with the functional API, or a built
            `keras.Sequential`.

    Returns:
        A `networkx.DiGraph`, as described in the module docstring.

    Example:
        >>> g = build_graph(model)
        >>> [k for k, d in g.nodes(data=True) if d["kind"] == "layer"]
    """
    fn = functional_of(model)
    graph = nx.DiGraph()
    tensors = {}
    position = 0
    for depth in sorted(fn._nodes_by_depth, reverse=True):
        for node in fn._nodes_by_depth[depth]:
            key = _node_key(node)
            graph.add_node(
                key,
                kind="input" if node.is_input else "layer",
                layer=node.operation,
                class_name=type(node.operation).__name__,
                position=position,
                node=node,
                in_keys=tuple(tensor_key(t) for t in node.input_tensors),
                out_keys=tuple(tensor_key(t) for t in node.outputs),
            )
            position += 1
            for t in node.outputs:
                tensors[tensor_key(t)] = _tensor_info(t, key)
    for key, data in graph.nodes(data=True):
        if data["kind"] == "input":
            continue
        for tk in data["in_keys"]:
            producer = tensors[tk].producer
            edge = graph.get_edge_data(producer, key)
            if edge is None:
                graph.add_edge(producer, key, tensors=(tk,))
            elif tk not in edge["tensors"]:
                edge["tensors"] += (tk,)
    graph.graph["tensors"] = tensors
    graph.graph["state_chains"] = _state_chains(graph)
    graph.graph["inputs"] = [tensor_key(t) for t in fn.inputs]
    graph.graph["outputs"] = [tensor_key(t) for t in fn.outputs]
    graph.graph["name"] = model.name
    return graph
