"""Keras functional model -> `LayerGraph` of layer calls
(`graphckpt.graph.layer_graph`: a `networkx.DiGraph` with typed graph-level fields).

Contract:
- One node per layer *call* (Keras `Node`), keyed `(layer_name, node_index)`:
  a layer shared by two calls gives two nodes. Model inputs are nodes too,
  with `kind="input"`; every other node has `kind="layer"`.
- A call of a nested functional model or Sequential is **flattened**: its
  own layer calls become nodes, keyed by their path (`("resnet50v2/conv1_conv",
  0)`; a model's second flattened call is `"name@1/..."`), so cuts can fall
  inside it. Each call of a model called twice is flattened on its own, and
  its layers are then shared calls like any other. A nested call that could
  not be replayed call by call exactly (see `graphckpt.graph.nesting.flattenable`: an overridden
  `call`, extra call arguments, a call of it leading only to outputs
  nothing reads, an input it ignores) stays one node, and
  `graph.kept_whole` says why.
- Each node's `in_keys` / `out_keys` are the graph keys of its Keras
  node's `input_tensors` / `outputs`, in order: a flattened model's inner
  inputs stand for the outer tensors they were called on, and its outer
  outputs for the inner tensors that compute them.
- A flattened node's `training` is the `training=` the enclosing nested
  calls passed explicitly, resolved as Keras resolves it
  (`keras_compat.resolve_training`), or None.
- One edge per producer -> consumer pair. Its `tensors` attribute lists the
  keys of the tensors that flow along it; a key is
  `(layer_path, node_index, tensor_index)`, Keras's own `_keras_history`
  with the layer's path for the name.
- `graph.state_chains` lists tuples of layer calls that share
  state (the non-trainable variables of a shared BatchNormalization or
  Dropout; for all Lambda and custom layers, whatever their code may share,
  such as Keras's global seed generator; the mask attached to a tensor its
  readers share), each in Keras's execution order: they must run in that
  order (`graphckpt.graph.chains`).
- `graph.from_inputs` is the set of calls without weights or state that
  read only model inputs and each other (masks, position ids): the
  planner runs each just before its first reader (`graphckpt.graph.chains`).
- `graph.kept_whole` maps the path of each nested model's call that
  stays one node to why (`kept_whole_note` puts it in words for warnings).
- `graph.tensors` maps each tensor key to a `TensorInfo`; `graph.inputs` /
  `graph.outputs` list the model's input and output tensor keys, flattened,
  in the model's order. The other fields are `LayerGraph`'s.

Node attributes: `kind` (`layer_graph.INPUT` or `LAYER`), `layer` (the Keras operation), `class_name`,
`position` (the call's position in Keras's execution order), `node` (the
Keras `Node`), `in_keys` (the graph keys of the call's input tensors, aligned
with `node.input_tensors`) and `out_keys` (those of `node.outputs`). Read a
call's tensors through `in_keys` / `out_keys`, not through the Keras node.
The planner reads only `kind`, `position` and the tensor data.
"""

import math

from graphckpt import keras_compat
from graphckpt.graph import attention
from graphckpt.graph.chains import from_inputs, state_chains
from graphckpt.graph.layer_graph import INPUT, LAYER, LayerGraph, TensorInfo
from graphckpt.graph.nesting import called_on, flattenable, functional_of, kept_whole_note, nodes_of

__all__ = [
    "LayerGraph",
    "TensorInfo",
    "build_graph",
    "call_names",
    "call_ordinals",
    "saved_ordinals",
    "dependencies",
    "functional_of",
    "kept_whole_note",
    "live_tensors",
    "tensor_key",
]


def tensor_key(tensor):
    """The graph key of a KerasTensor: `(layer_name, node_index, index)`."""
    op, node_index, tensor_index = keras_compat.keras_history(tensor)
    return (op.name, node_index, tensor_index)


def dtype_size(dtype):
    import numpy as np

    try:
        return np.dtype(str(dtype)).itemsize
    except TypeError:  # bfloat16 and friends are not numpy dtypes
        digits = "".join(c for c in str(dtype) if c.isdigit())
        return max(int(digits or 32) // 8, 1)


def _tensor_info(tensor, producer, key, dense=False):
    shape = tuple(tensor.shape)
    per_example = math.prod(d if d is not None else 1 for d in shape[1:])
    return TensorInfo(
        key=key,
        producer=producer,
        shape=shape,
        dtype=str(tensor.dtype),
        nbytes=int(per_example * dtype_size(tensor.dtype)),
        sparse=bool(getattr(tensor, "sparse", False)) and not dense,
        ragged=bool(getattr(tensor, "ragged", False)),
    )


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
        outputs depend on (outputs and inputs included), and the variables
        of the layers on the way, trainable or not: `trainable` flags change
        (freezing, unfreezing), so callers filter them when they use them.
    """
    fn = functional_of(model)
    wanted = fn.outputs if outputs is None else [fn.outputs[i] for i in outputs]
    needed = {id(t) for t in wanted}
    by_depth = keras_compat.nodes_by_depth(fn)
    calls = (
        ([id(t) for t in node.outputs], [id(t) for t in node.input_tensors], node.operation, node.input_tensors)
        for depth in sorted(by_depth)  # from the outputs back
        for node in by_depth[depth]
        if not node.is_input
    )
    return needed, _walk_back(calls, needed)


def _walk_back(calls, needed, variables=True):
    """The liveness walk of `dependencies` and `live_tensors`: `calls` are
    a model's calls from its outputs back, each `(outs, ins, op, args)`: the
    handles of its output and input tensors, its operation and its input
    KerasTensors; `needed` holds the handles of the tensors wanted. Adds
    those they are computed from to `needed`, and returns the variables of
    the calls on the way (none unless `variables`)."""
    import keras

    read = {}
    for outs, ins, op, args in calls:
        used = [i for i, t in enumerate(outs) if t in needed]
        if not used:
            continue
        inner = functional_of(op) if isinstance(op, keras.Model) else None
        if keras_compat.is_functional(inner) and len(args) == len(inner.inputs):
            inner_tensors, found = dependencies(inner, used)
            ins = [t for t, x in zip(ins, inner.inputs) if id(x) in inner_tensors]
        else:
            found = getattr(op, "variables", ()) if variables else ()  # ops have none
        if variables:
            read.update((id(v), v) for v in found)
        needed.update(ins)
    return list(read.values())


class _Builder:
    """Adds the layer calls of a functional model to a graph, flattening
    nested models' calls (see `graphckpt.graph.nesting.flattenable`)."""

    def __init__(self, keep_whole=frozenset(), open_layers=False, known_shapes=None, closed=(), whole_attention=False):
        self.graph = LayerGraph()
        self.open_layers = open_layers  # open composite layers (graphckpt.graph.opening): bool or predicate
        self.whole_attention = whole_attention  # keep attention calls whole: their cores run in chunks
        self.closed = frozenset(closed)  # paths of composite layer calls kept whole as asked
        self.kept_closed = []  # those found: the predicate's no's, and `closed`
        self.inside = {}  # opened root -> how many calls inside it so far
        self.known_shapes = known_shapes or {}  # node key -> its input shapes, where planned for some
        self.at_known_shapes = False  # whether some layer was opened at them
        self.not_opened = {}  # path of a composite layer's call left closed -> why
        self.tensors = {}
        self.position = 0
        self.flattened = {}  # id(nested model) -> how many of its calls so far
        self.keep_whole = keep_whole  # ids of nested models not to flatten
        self.whole = {}  # path of a nested model's call kept whole -> why

    def add(self, fn, prefix="", bound=None, training=None, scope=None, opened=None, root=None):
        """Adds `fn`'s calls; `bound` maps `fn`'s input tensors (ids) to the
        graph keys they stand for, `training` is what an enclosing call
        forces, `opened` / `root` the paths of the innermost and outermost
        opened layer calls they are inside, if any. Returns id(KerasTensor of `fn`) -> graph tensor
        key."""
        keys = dict(bound or {})
        nodes = nodes_of(fn)
        consumed = {id(t) for n in nodes for t in n.input_tensors} | {id(t) for t in fn.outputs}
        read = set()  # ids of the tensors the calls so far read
        for node in nodes:
            if node.is_input:
                if bound is None:
                    self._add_node(node, "", [], None, kind=INPUT)
                    keys[id(node.outputs[0])] = tensor_key(node.outputs[0])
                continue
            in_keys = [keys[id(t)] for t in node.input_tensors]
            inner, outer, opens = self._inner(node, consumed, prefix, read, root)
            read.update(id(t) for t in node.input_tensors)
            if inner is None:
                out_keys = self._add_node(node, prefix, in_keys, training, scope, opened=opened, root=root)
            else:
                op = node.operation
                k = self.flattened.get(id(op), 0)
                self.flattened[id(op)] = k + 1
                inner_prefix = f"{prefix}{op.name}{'' if k == 0 else f'@{k}'}/"
                inner_bound = {id(x): keys[id(t)] for x, t in zip(inner.inputs, outer)}
                forced = keras_compat.resolve_training(training, node.arguments.kwargs.get("training"))
                inner_keys = self.add(
                    inner,
                    inner_prefix,
                    inner_bound,
                    forced,
                    op,
                    inner_prefix if opens else opened,
                    (root or inner_prefix) if opens else root,
                )
                out_keys = [inner_keys[id(x)] for x in inner.outputs]
            keys.update((id(t), k) for t, k in zip(node.outputs, out_keys))
        return keys

    def _inner(self, node, consumed, prefix, read, root=None):
        """`(Functional, outer tensors, opened)` to flatten in place of
        `node`'s call (a nested model's graph, or a composite layer's opened
        one if `opened`, bound to the tensors it was called on), or `(None,
        None, False)`; records why a nested model stays whole (`whole`) or a
        composite layer closed (`not_opened`). `read`: ids of the tensors
        the calls before it read; `root`: the outermost opened layer call
        it is inside, if any."""
        import keras
        from keras import tree

        from graphckpt.graph import opening

        op = node.operation
        clash = id(op) in self.keep_whole
        if (isinstance(op, keras.Model) and not opening.is_subclassed(op)) or not self.open_layers:
            inner, why = (None, _CLASH) if clash else flattenable(node, consumed, read)
            if why is not None:
                self.whole[prefix + op.name] = why
            return (inner, tree.flatten(called_on(node)), False) if inner is not None else (None, None, False)
        # Named as `saved_ordinals` names a call inside an opened layer
        # (`<root>#i`): a custom layer's sublayers get other names when loaded.
        where = prefix + op.name if root is None else f"{root}#{self.inside.get(root, 0)}"
        if self.whole_attention and attention.chunkable_attention(op):
            return None, None, False
        if isinstance(op, keras.layers.Layer) and keras_compat.has_sublayers(op) and (
            where in self.closed or (callable(self.open_layers) and not self.open_layers(op))
        ):
            self.kept_closed.append(where)
            return None, None, False
        known = self.known_shapes.get((prefix + op.name, keras_compat.inbound_nodes(op).index(node)))
        inner, why = (None, _CLASH) if clash else opening.open_call(node, known)
        if why is not None:
            self.not_opened[prefix + op.name] = why
        if inner is not None and [x.shape for x in inner.inputs] != [t.shape for t in node.input_tensors]:
            self.at_known_shapes = True  # traced at `known_shapes`: the graph serves those only
        return (inner, list(node.input_tensors), True) if inner is not None else (None, None, False)

    def _add_node(self, node, prefix, in_keys, training, scope=None, kind=LAYER, opened=None, root=None):
        op = node.operation
        key = (prefix + op.name, keras_compat.inbound_nodes(op).index(node))
        out_keys = [(key[0], key[1], i) for i in range(len(node.outputs))]
        self.graph.add_node(
            key,
            kind=kind,
            layer=op,
            class_name=type(op).__name__,
            position=self.position,
            node=node,
            in_keys=tuple(in_keys),
            out_keys=tuple(out_keys),
            training=training,
            scope=scope,
            opened=opened,
            opened_root=root,
        )
        self.position += 1
        if root is not None:
            self.inside[root] = self.inside.get(root, 0) + 1
        # An op on dense tensors is dense: Keras's spec of `ops.multiply(x,
        # c)` calls it sparse where the constant `c` is a backend tensor
        # without a `sparse` attribute (PyTorch's).
        import keras

        dense = kind == LAYER and not isinstance(op, keras.layers.Layer) and not any(
            getattr(t, "sparse", False) for t in node.input_tensors
        )
        for t, k in zip(node.outputs, out_keys):
            self.tensors[k] = _tensor_info(t, key, k, dense)
        for k in dict.fromkeys(in_keys):
            producer = self.tensors[k].producer
            edge = self.graph.get_edge_data(producer, key)
            if edge is None:
                self.graph.add_edge(producer, key, tensors=(k,))
            elif k not in edge["tensors"]:
                edge["tensors"] += (k,)
        return out_keys


_CLASH = "its layers' names clash with other layers of the model"


def _name_clashes(graph):
    """Ids of the innermost flattened models whose layers share a name with
    another layer of the graph. Keras needs the layers of one functional
    model to have distinct names, and a segment may hold both: such models
    are kept whole. The calls inside one opened layer's call are replayed
    in functional models of their own (`graphckpt.runtime.rewrite`), so their names
    need only differ from each other's."""
    by_name = {}
    for _, data in sorted(graph.nodes(data=True), key=lambda item: item[1]["position"]):
        by_name.setdefault((data.get("opened"), data["layer"].name), {}).setdefault(id(data["layer"]), data)
    clashes = set()
    for layers in by_name.values():
        if len(layers) > 1:
            # The first top-level layer of that name, else the first one
            # met, keeps it; the models holding the others stay whole.
            first = min(layers.values(), key=lambda d: (d["scope"] is not None, d["position"]))
            clashes.update(id(d["scope"]) for d in layers.values() if d is not first)
    return frozenset(clashes)


def build_graph(model, open_layers=False, known_shapes=None, closed=(), whole_attention=False):
    """Builds the layer-call graph of a built functional model.

    Args:
        model: A built `keras.Model` made with the functional API, or a built
            `keras.Sequential`.
        open_layers: also flatten the calls of composite layers (a layer
            whose `call` calls other layers and `keras.ops`) where
            `graphckpt.graph.opening.open_call` can; `graph.not_opened`
            says why the others stay one node. A callable `open_layers(layer)
            -> bool` opens only the composite layers it says yes to; the
            paths of the others are in `graph.kept_closed`.
        known_shapes: with `open_layers`, the input shapes of the calls of
            the graph without it (node key -> one shape per input tensor),
            for the layers that trace only at known shapes
            (`graphckpt.graph.shapes.open_graph` finds them).
        closed: paths of composite layer calls to keep whole (a saved
            plan's `kept_closed`).
        whole_attention: with `open_layers`, keep each
            `MultiHeadAttention` call whole (`chunkable_attention`): its
            core runs in chunks instead (`mark_attention_chunks`).

    Returns:
        A `LayerGraph`, as described in the module docstring.

    Example:
        >>> g = build_graph(model)
        >>> [k for k, d in g.nodes(data=True) if d["kind"] == "layer"]
    """
    fn = functional_of(model)
    keep_whole = frozenset()
    while True:
        builder = _Builder(keep_whole, open_layers, known_shapes, closed, whole_attention)
        keys = builder.add(fn)
        clashes = _name_clashes(builder.graph)
        if not clashes:
            break
        keep_whole |= clashes
    graph = builder.graph
    chains = state_chains(graph)
    graph.set_fields(
        tensors=builder.tensors,
        state_chains=chains,
        from_inputs=from_inputs(graph, chains),
        inputs=[keys[id(t)] for t in fn.inputs],
        outputs=[keys[id(t)] for t in fn.outputs],
        name=model.name,
        kept_whole=builder.whole,
        not_opened=builder.not_opened,
        open_layers=bool(open_layers),
        kept_closed=tuple(builder.kept_closed),
        at_known_shapes=builder.at_known_shapes,
    )
    return graph


def live_tensors(graph):
    """Keys of the graph's tensors that its outputs depend on.

    A call kept whole (a nested model that is not flattened) passes on only
    the inputs its used outputs read (`dependencies`), so a tensor that only
    feeds an input it ignores is not live.
    """
    needed = set(graph.outputs)
    calls = (
        (data["out_keys"], list(data["in_keys"]), data["layer"], data["node"].input_tensors)
        for _, data in sorted(graph.nodes(data=True), key=lambda item: item[1]["position"], reverse=True)
        if data["kind"] != INPUT
    )
    _walk_back(calls, needed, variables=False)
    return needed


def call_ordinals(graph):
    """Each layer call's place among the calls of its layer in the model.

    Node keys hold Keras's node indices, which depend on the layer's history
    outside the model (a layer called elsewhere first); this count does not,
    so it survives a save and load.

    Args:
        graph: a graph from `build_graph`.

    Returns:
        A dict: node key -> `(layer_path, k)`, for the k-th call (from 0) of
        that layer in the model. Model inputs are not included.
    """
    by_layer = {}
    for key, data in graph.nodes(data=True):
        if data["kind"] != INPUT:
            by_layer.setdefault(key[0], []).append(key)
    return {key: (name, k) for name, keys in by_layer.items() for k, key in enumerate(sorted(keys, key=lambda n: n[1]))}


def saved_ordinals(graph):
    """`call_ordinals`, but a call inside an opened layer's call is named
    by its place among the calls inside the outermost one (`<path>/#i`):
    the names of a custom layer's sublayers are not in its config, so they
    differ after loading, while the traced calls come in the same order."""
    ordinals = call_ordinals(graph)
    inside = {}
    for key, data in sorted(graph.nodes(data=True), key=lambda item: item[1]["position"]):
        root = data.get("opened_root")
        if root is not None:
            i = inside.setdefault(root, [0])
            ordinals[key] = (f"{root}#{i[0]}", 0)
            i[0] += 1
    return ordinals


def call_names(graph):
    """A readable name for each node: its layer path, with `#k` for the k-th
    call (k >= 1) of a layer called more than once. Model inputs keep their
    layer's name.

    Args:
        graph: a graph from `build_graph`.

    Returns:
        A dict: node key -> name, e.g. `"dense_1"`, `"shared#1"`,
        `"block@1/conv"` (a nested model's second call, see `build_graph`).
    """
    ordinals = call_ordinals(graph)
    return {key: key[0] + (f"#{ordinals[key][1]}" if ordinals.get(key, (None, 0))[1] else "") for key in graph.nodes}
