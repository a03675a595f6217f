"""The layer graph's contract: `LayerGraph`, the graph `build_graph` makes.

A `LayerGraph` is a `networkx.DiGraph` of layer calls whose graph-level
facts are typed, read-only properties. They are stored in the graph's own
attribute dict (`graph.graph`) under the property's name, so a copy or a
subgraph view carries them, and a plain `networkx.DiGraph` with the same
keys (the hand-built graphs of the planner's tests) reads the same through
the accessor functions below, which the pure planner uses. Nothing here
imports Keras.

Nodes are layer calls keyed `(layer_path, node_index)`; their attributes
(`graph.nodes[key][...]`, set by `graphckpt.graph.build`):
- `kind`: `INPUT`, a model input, or `LAYER`, any other call (a layer's,
  an op's, or a nested model's kept whole);
- `position`: the call's index in Keras's own order of calls;
- `layer`, `class_name`, `node`: the called operation, its class name and
  its Keras `Node`;
- `in_keys`, `out_keys`: the keys of the tensors it reads and makes, in
  argument and output order (`TensorInfo.key`);
- `training`: the training flag the call gets when it is replayed, where
  an enclosing nested model fixes it, else None;
- `scope`: the nested model or opened layer the call was flattened from
  (the innermost), or None;
- `opened`, `opened_root`: for a call inside an opened composite layer, the
  path prefix of the innermost and of the outermost opened layer
  (`"block/mha/"`), else None.
An edge `producer -> consumer` has one attribute, `tensors`: the keys of the
tensors the consumer reads from the producer. The planner reads only
`kind`, `position` and `tensors`.
"""

import dataclasses
import types

import networkx as nx

__all__ = [
    "INPUT", "LAYER", "LayerGraph", "TensorInfo", "from_inputs_of", "outputs_of", "state_chains_of", "tensors_of"
]

INPUT = "input"
LAYER = "layer"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Static facts about one symbolic tensor.

    `nbytes` counts one example (the batch dimension left out); unknown
    dimensions count as 1 (`graphckpt.graph.shapes.sized_graph` gives every
    tensor its real shape from the input shapes, and warns when it can't).
    """

    key: tuple
    producer: tuple
    shape: tuple
    dtype: str
    nbytes: int
    sparse: bool = False
    ragged: bool = False


def tensors_of(graph):
    """Tensor key -> `TensorInfo`, for a `LayerGraph` or a plain DiGraph
    with a `"tensors"` graph attribute."""
    return graph.graph["tensors"]


def outputs_of(graph):
    """The model's output tensor keys, in its order."""
    return graph.graph["outputs"]


def state_chains_of(graph):
    """Tuples of calls that share state, each in execution order (none
    where the graph does not say)."""
    return graph.graph.get("state_chains", ())


def from_inputs_of(graph):
    """The calls without weights or state made from the model's inputs
    alone (none where the graph does not say)."""
    return graph.graph.get("from_inputs", frozenset())


_NONE = types.MappingProxyType({})


def _field(name, default=None, doc=""):
    return property(lambda self: self.graph.get(name, default), doc=doc)


class LayerGraph(nx.DiGraph):
    """A model's layer-call graph (see `graphckpt.graph.build` for its nodes and
    edges). Its fields are set once, by `build_graph` (`fields`) and by
    `graphckpt.graph.shapes.sized_graph` (`with_tensors`, `shapes_resolved`)."""

    tensors = property(tensors_of, doc="Tensor key -> `TensorInfo`, for every tensor of the graph.")
    outputs = property(outputs_of, doc="The model's output tensor keys, flattened, in its order.")
    state_chains = property(state_chains_of, doc="Tuples of calls sharing state (`graphckpt.graph.chains`).")
    from_inputs = property(
        from_inputs_of,
        doc="Calls without weights or state made from the model's inputs alone: masks, position ids "
        "(`graphckpt.graph.chains.from_inputs`); the planner runs each just before its first reader.",
    )
    inputs = _field("inputs", (), "The model's input tensor keys, flattened, in its order.")
    name = _field("name", None, "The model's name.")
    kept_whole = _field("kept_whole", _NONE, "Path of each nested model's call kept one node -> why.")
    not_opened = _field("not_opened", _NONE, "Path of each composite layer's call left closed -> why.")
    open_layers = _field("open_layers", False, "Whether composite layers were opened.")
    kept_closed = _field("kept_closed", (), "Paths of the composite layer calls kept whole as asked.")
    at_known_shapes = _field("at_known_shapes", False, "Whether some layer was opened at given shapes only.")
    shapes_resolved = _field(
        "shapes_resolved", False, "Whether `tensors` hold the shapes to plan with (`graphckpt.graph.shapes.sized_graph`)."
    )

    def set_fields(self, **fields):
        """Sets graph-level fields by name (`build_graph`, once)."""
        unknown = set(fields) - _FIELDS
        if unknown:
            raise TypeError(f"LayerGraph has no field(s) {sorted(unknown)}")
        self.graph.update(fields)

    def mark_shapes_resolved(self):
        """Marks `tensors` as the shapes to plan with."""
        self.graph["shapes_resolved"] = True

    def with_tensors(self, tensors, shapes_resolved=True):
        """A copy (new node and graph dicts; the Keras objects shared) whose
        `tensors` are `tensors`."""
        copy = self.copy()
        copy.graph["tensors"] = tensors
        copy.graph["shapes_resolved"] = shapes_resolved
        return copy


# The fields are the class's properties: one list, which `set_fields` checks against.
_FIELDS = frozenset(name for name, value in vars(LayerGraph).items() if isinstance(value, property))
