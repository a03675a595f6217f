"""Real tensor shapes from the input shapes: what estimates and plans use.

Contract:
- `build_graph` records each tensor's static shape, and Keras often knows
  only some of its dimensions: text models take token ids of shape
  (None, None), image models may take (None, None, None, 3). Counted as 1,
  such a dimension makes every estimate and plan one for sequences of
  length 1 (or 1 x 1 images).
- `sized_graph(graph, input_shape, batch_size)` returns a copy of the graph
  whose `graph.tensors` hold every tensor's real shape: the input
  shapes given (Keras's spelling, as `model.build` takes them, batch
  dimension included), propagated call by call with each operation's
  `compute_output_spec` on KerasTensors of those shapes, the way Keras's
  `Functional.compute_output_spec` runs a graph. Nothing is run on data, no
  node is added to any layer, the model is not changed. Each call reads its
  inputs through the node attribute `in_keys` and writes its outputs through
  `out_keys`.
- The copy is for estimating and planning only (plans name calls and
  tensors by key, so they hold for the original graph): the rewrite builds
  its sub-models from the original graph's symbolic shapes, so the
  checkpointed model accepts every shape the original does.
- Without `input_shape`, an unknown non-batch dimension still counts as 1,
  and one `UnknownDimensionWarning` names the inputs that have one and the
  fix. A call whose real output shapes can't be found keeps its symbolic
  ones, with one warning naming such calls.
- A wrong `input_shape` (rank, number of inputs, names, dimensions that are
  not positive ints, a dimension the model fixes otherwise, a batch size
  that disagrees with `batch_size=`) raises one
  `graphckpt.InvalidArgumentError`.
"""

import dataclasses
import math
import numbers
import warnings
from collections.abc import Mapping, Sequence

import networkx as nx

from graphckpt import errors, keras_compat
from graphckpt.errors import UnknownDimensionWarning
from graphckpt.graph.build import build_graph, dtype_size, functional_of
from graphckpt.graph.layer_graph import INPUT

__all__ = ["UnknownDimensionWarning", "sized_graph", "parse_input_shape", "propagate", "unknown_inputs"]

# Keras's spelling of input shapes, as in `model.build`: one shape, a list,
# or a dict keyed by input name; the batch dimension included.
Shape = Sequence[int | None]
InputShape = Shape | Sequence[Shape] | Mapping[str, Shape]

_TIP = (
    "Tip: pass the shapes you train with, batch dimension included, as `input_shape=` "
    "(graphckpt.plan, checkpoint_model, estimate; e.g. input_shape=(8, 512)) or "
    "`--input-shape 8,512` on the command line. The fit flag reads them from arrays and "
    "tf.data datasets; with other data, fit `graphckpt.checkpoint_model(model, input_shape=...)`."
)


def _is_dim(d):
    return d is None or (isinstance(d, numbers.Integral) and not isinstance(d, bool))


def _is_shape(value):
    """A tuple or list of dimensions (`[8, 512]` too), not of shapes: its
    dimensions are checked later, so that a bad one is named."""
    return isinstance(value, (tuple, list)) and not any(isinstance(d, (tuple, list, dict)) for d in value)


def _input_names(graph):
    return [key[0] for key in graph.inputs]


def _shape_text(shape):
    return "(" + ", ".join("None" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _bad(input_shape, why):
    return errors.InvalidArgumentError(f"Invalid `input_shape`: {why}. Received: input_shape={input_shape!r}. {_TIP}")


def _by_input(graph, input_shape):
    """`input_shape` -> {input index: given shape}; checks only its form."""
    names = _input_names(graph)
    expected = (
        f"the model has {len(names)} input(s), {', '.join(map(repr, names))}: pass one shape tuple"
        + (", a list of shapes or a dict keyed by input name" if len(names) > 1 else "")
    )
    if isinstance(input_shape, dict):
        unknown = [k for k in input_shape if k not in names]
        if unknown:
            raise _bad(input_shape, f"unknown input name(s) {unknown}; {expected}")
        given = {names.index(k): v for k, v in input_shape.items()}
    elif _is_shape(input_shape):
        if len(names) != 1:
            raise _bad(input_shape, f"one shape for {len(names)} inputs; {expected}")
        given = {0: input_shape}
    elif isinstance(input_shape, (tuple, list)):
        if len(input_shape) != len(names):
            raise _bad(input_shape, f"{len(input_shape)} shape(s) for {len(names)} input(s); {expected}")
        given = dict(enumerate(input_shape))
    else:
        raise _bad(input_shape, f"expected a shape tuple, a list of shapes or a dict; {expected}")
    for i, shape in given.items():
        if not isinstance(shape, (tuple, list)):
            raise _bad(input_shape, f"the shape of input {names[i]!r} is {shape!r}, not a tuple of ints")
    return given


def _check_one(input_shape, name, symbolic, shape):
    """The shape given for one input, checked against its symbolic shape."""
    if len(shape) != len(symbolic):
        raise _bad(
            input_shape,
            f"input {name!r} has rank {len(symbolic)}, shape {_shape_text(symbolic)} (batch dimension "
            f"first), and the shape given for it, {_shape_text(shape)}, has rank {len(shape)}",
        )
    for axis, d in enumerate(shape):
        if d is None and axis == 0:
            continue  # the batch size may come from `batch_size=` (or the model)
        if not _is_dim(d) or d is None or d < 1:
            what = "a positive int" + (" (or None, for the batch dimension)" if axis == 0 else "")
            raise _bad(input_shape, f"dimension {axis} of input {name!r} is {d!r}; each must be {what}")
        if symbolic[axis] is not None and symbolic[axis] != d:
            raise _bad(
                input_shape,
                f"input {name!r} has shape {_shape_text(symbolic)}: the model fixes dimension {axis} "
                f"at {symbolic[axis]}, and the shape given has {d}",
            )
    dims = tuple(None if d is None else int(d) for d in shape)
    return dims if not dims or dims[0] is not None else (symbolic[0],) + dims[1:]


def parse_input_shape(graph, input_shape, batch_size=None):
    """Checks `input_shape` against the graph's inputs.

    Args:
        graph: a layer-call graph (`graphckpt.graph.build.build_graph`).
        input_shape: one shape tuple (a model with one input), a list of
            shapes in the model's input order, or a dict keyed by input
            name; batch dimension first, as `model.build` takes them. A
            dict may leave out inputs whose non-batch dimensions the model
            fixes. The batch dimension may be None where `batch_size=`
            gives it.
        batch_size: the `batch_size=` argument, if any.

    Returns:
        `(shapes, batch_size)`: one shape per graph input, in order, and
        the batch size (None when no shape nor `batch_size` gives one).

    Raises:
        graphckpt.InvalidArgumentError: a wrong form, rank, name, number
            of inputs or dimension, or batch sizes that disagree.
    """
    names = _input_names(graph)
    tensors = graph.tensors
    symbolic = [tensors[k].shape for k in graph.inputs]
    given = _by_input(graph, input_shape)
    shapes = []
    for i, name in enumerate(names):
        if i in given:
            shapes.append(_check_one(input_shape, name, symbolic[i], given[i]))
        elif any(d is None for d in symbolic[i][1:]):
            raise _bad(input_shape, f"no shape for input {name!r}, whose shape is {_shape_text(symbolic[i])}")
        else:
            shapes.append(tuple(symbolic[i]))
    batches = {s[0] for s in shapes if s} - {None}
    if len(batches) > 1:
        raise _bad(input_shape, f"the inputs' batch dimensions differ ({sorted(batches)}); one training step has one batch size")
    batch = batches.pop() if batches else None
    if batch_size is not None and batch is not None and batch != batch_size:
        raise errors.InvalidArgumentError(
            f"`input_shape` and `batch_size` give two batch sizes: {batch} (the first dimension of "
            f"input_shape={input_shape!r}) and batch_size={batch_size!r}. Tip: pass one of them, or "
            "make them agree."
        )
    batch = batch if batch is not None else batch_size
    shapes = [(batch,) + s[1:] if s and s[0] is None else s for s in shapes]
    return shapes, batch


def _topological(graph):
    return nx.lexicographical_topological_sort(graph, key=lambda n: graph.nodes[n]["position"])


def _info(info, shape):
    per_example = math.prod(d if d is not None else 1 for d in shape[1:])
    return dataclasses.replace(info, shape=shape, nbytes=int(per_example * dtype_size(info.dtype)))


def _spec_shapes(outputs):
    from keras import tree

    return [tuple(o.shape) for o in tree.flatten(outputs)]


def propagate(graph, shapes):
    """Every tensor's shape, from one shape per graph input.

    Runs each call's `compute_output_spec` on KerasTensors of the shapes
    found so far, in a topological order. A call whose spec can't be found
    (an error, or a different number of outputs) keeps its symbolic output
    shapes, and so do the calls downstream of it, when theirs fail too.

    Args:
        graph: a layer-call graph.
        shapes: one shape per `graph.inputs` key, in order.

    Returns:
        `(tensors, failed)`: a dict tensor key -> `TensorInfo` with the
        shapes found, and `{call: reason}` for the calls that kept theirs.
    """
    from keras import KerasTensor

    tensors = dict(graph.tensors)
    specs = {}

    def spec(key, shape):
        info = graph.tensors[key]
        specs[key] = KerasTensor(shape, dtype=info.dtype)
        tensors[key] = _info(info, tuple(shape))

    for key, shape in zip(graph.inputs, shapes):
        spec(key, shape)
    failed = {}
    for call in _topological(graph):
        data = graph.nodes[call]
        if data["kind"] == INPUT:
            continue
        in_keys, out_keys = data["in_keys"], data["out_keys"]
        mapping = {id(t): specs.get(k) for t, k in zip(data["node"].input_tensors, in_keys)}
        try:
            args, kwargs = data["node"].arguments.fill_in(mapping)
            found = _spec_shapes(data["layer"].compute_output_spec(*args, **kwargs))
            if _lost_dimensions(found, args, kwargs):
                # A layer's own shape rule can lose a dimension its inputs
                # give (`EinsumDense` with a partial `output_shape`): run
                # its `call` symbolically instead, as Keras's backends do.
                found = _spec_shapes(keras_compat.compute_output_spec(data["layer"].call, *args, **kwargs))
            if len(found) != len(out_keys):
                raise ValueError(f"{len(found)} outputs, where the graph has {len(out_keys)}")
        except Exception as e:  # noqa: BLE001 - any failure keeps the symbolic shapes
            failed[call] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
            found = [tuple(graph.tensors[k].shape) for k in out_keys]
        for key, shape in zip(out_keys, found):
            spec(key, shape)
    return tensors, failed


def _lost_dimensions(found, args, kwargs):
    """Whether an output shape has an unknown non-batch dimension where
    every input's non-batch dimensions are known."""
    from keras import KerasTensor, tree

    inputs = [t for t in tree.flatten((args, kwargs)) if isinstance(t, KerasTensor)]
    known = inputs and all(d is not None for t in inputs for d in t.shape[1:])
    return bool(known) and any(d is None for shape in found for d in shape[1:])


def unknown_inputs(graph):
    """`(name, shape)` of each graph input with an unknown non-batch dimension."""
    tensors = graph.tensors
    return [
        (key[0], tensors[key].shape)
        for key in graph.inputs
        if any(d is None for d in tensors[key].shape[1:])
    ]


def _warn_unknown_inputs(graph, stacklevel):
    unknown = unknown_inputs(graph)
    if not unknown:
        return
    listed = ", ".join(f"{name!r} {_shape_text(shape)}" for name, shape in unknown)
    warnings.warn(
        f"Model {graph.name!r}: input(s) {listed} have unknown non-batch dimensions. "
        "graphckpt counts each as 1, so its memory estimates and plans are for inputs of that size "
        f"(for text models: sequences of length 1), not for the data you train on. {_TIP}",
        UnknownDimensionWarning,
        stacklevel=stacklevel + 1,
    )


def _warn_failed(graph, failed, stacklevel):
    if not failed:
        return
    listed = "; ".join(f"{call[0]!r} ({why})" for call, why in list(failed.items())[:3])
    more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
    warnings.warn(
        f"Model {graph.name!r}: the real output shapes of {len(failed)} layer call(s) could "
        f"not be found from `input_shape`: {listed}{more}. Their unknown dimensions count as 1.",
        UnknownDimensionWarning,
        stacklevel=stacklevel + 1,
    )


def sized_graph(graph, input_shape=None, batch_size=None, *, stacklevel=2):
    """The graph to estimate and plan with, and the batch size.

    Args:
        graph: a layer-call graph (`graphckpt.graph.build.build_graph`).
        input_shape: the input shapes (see `parse_input_shape`), or None.
        batch_size: the `batch_size=` argument, or None.
        stacklevel: where warnings point, as for `warnings.warn`.

    Returns:
        `(graph, batch_size)`. Without `input_shape`, the graph itself (with
        one warning, the first time, if an input has an unknown non-batch
        dimension) and `batch_size`; with it, a copy whose tensors have the
        propagated shapes, and the batch size they give. Either way
        `graph.shapes_resolved` is then true: `estimate(graph=...)`
        uses such a graph as it is.

    Raises:
        graphckpt.InvalidArgumentError: a wrong `input_shape`.
    """
    if input_shape is None:
        if not graph.shapes_resolved:
            _warn_unknown_inputs(graph, stacklevel)
        graph.mark_shapes_resolved()  # warned once
        return graph, batch_size
    shapes, batch = parse_input_shape(graph, input_shape, batch_size)
    tensors, failed = propagate(graph, shapes)
    _warn_failed(graph, failed, stacklevel)
    return graph.with_tensors(tensors), batch


def open_graph(model, input_shape=None, batch_size=None, open_layers=True, closed=(), whole_attention=False):
    """`(graph, shapes)`: `model`'s layer-call graph with its composite
    layers opened (`build_graph(..., open_layers=True)`), and the input
    shapes to size it with: `input_shape`, parsed, where given (a layer
    whose trace needs a known dimension is traced at it), else the model's
    own. A layer is traced at a fixed batch size only where `input_shape`
    gives one. `open_layers` (True or a predicate), `closed` and
    `whole_attention` as for `build_graph`."""
    if input_shape is None:
        graph = build_graph(model, open_layers=open_layers, closed=closed, whole_attention=whole_attention)
        return graph, [tuple(t.shape) for t in functional_of(model).inputs]
    plain = build_graph(model)
    parse_input_shape(plain, input_shape, batch_size)  # raises on a wrong one
    # A batch dimension left None varies: no layer is traced at `batch_size`.
    shapes, _ = parse_input_shape(plain, input_shape)
    tensors, _ = propagate(plain, shapes)
    known = {
        key: [tensors[k].shape for k in data["in_keys"]] for key, data in plain.nodes(data=True) if data["kind"] != INPUT
    }
    graph = build_graph(model, open_layers=open_layers, known_shapes=known, closed=closed, whole_attention=whole_attention)
    return graph, [tuple(s) for s in shapes]


def plan_graph(model, plan):
    """The layer-call graph `plan` was made on, opened as it was: `plan` a
    `graphckpt.Plan`, or the `info` of a saved one (a dict)."""
    fields = ("open_layers", "opened_at", "kept_closed", "attention_chunks")
    info = plan if isinstance(plan, Mapping) else {f: getattr(plan, f) for f in fields}
    if not info.get("open_layers"):
        return build_graph(model)
    at = info.get("opened_at")
    shapes = None if at is None else [tuple(s) for s in at]
    whole = bool(info.get("attention_chunks"))  # attention calls stay whole, their cores in chunks
    return open_graph(model, shapes, closed=info.get("kept_closed", ()), whole_attention=whole)[0]
