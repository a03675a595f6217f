"""Opening a composite layer's call into a functional graph of its parts.

A layer whose `call` only calls other layers and `keras.ops` (a user's
transformer block written as a `keras.layers.Layer` subclass, Keras's
`MultiHeadAttention`) is one node of the layer graph, so no cut can fall
inside it. Calling `type(layer).call(layer, *keras_inputs)` on symbolic
inputs instead of `layer(...)` records each sublayer call and each op as a
node of its own: a `Functional` that `graphckpt.graph.build` then flattens as it
flattens a nested model, the same layer objects and variables in it.

A call is opened only where replaying that graph computes what calling the
layer does (`open_call` says why not otherwise):

- the layer owns no variables, seed generators or other state itself (its
  `call` would read or assign them outside any sublayer call, and they
  would not be in the graph); all of its variables belong to sublayers;
- it is called on tensors without masks, with no argument but tensors
  (positional or keyword: a padding mask), `training` and constants (masks
  read inside `call` would become ops on whatever made them);
- tracing succeeds (no `keras.random` op outside a layer, no control
  flow on tensor values; Python arithmetic on an unknown dimension only
  where the shapes the model is planned for give it: see `open_call`);
- each `training=None` a sublayer call recorded is dropped, so the value
  the model runs with reaches it, as it reaches the sublayers of the layer
  itself (Keras 3.16 lets a recorded value win);
- inputs are cast to the layer's compute dtype first, as `Layer.__call__`
  does;
- the opened graph computes what the layer does, checked once per layer
  and input signature on a small batch in training and in inference, with
  the same seed state (`_verify`).

Opened graphs are cached per layer and call signature, so the graph of a
model is built from the same objects every time, and the names of the ops
inside are derived from the layer's name (a saved plan names them).
"""

import contextlib
import inspect

import keras
from keras import tree

from graphckpt import keras_compat

__all__ = ["open_call", "record", "cast_inputs", "own_state", "same_values", "small_batch", "is_subclassed", "random_state_kept"]

_CACHE_ATTR = "_graphckpt_opened"  # on the layer: {signature: (Functional | None, reason)}
_ARGS = ("training",)


class _Opened:
    """A layer's opened graphs by call signature (`graphs`). A plain object,
    set with `object.__setattr__`, so Keras neither tracks the Functionals
    in it as sublayers nor walks them when saving; it dies with the layer."""

    def __init__(self):
        self.graphs = {}


def _signature(node, shapes):
    kwargs = tuple(sorted((k, repr(v)) for k, v in node.arguments.kwargs.items() if k not in _ARGS))
    return tuple((tuple(s), t.dtype) for s, t in zip(shapes, node.input_tensors)), kwargs


def _known(node, known_shapes, batch):
    """The node's input shapes, each dimension the symbolic tensor leaves
    unknown taken from `known_shapes` (the shapes the model is planned
    for); the batch dimension only if `batch`."""
    return [
        tuple(d if d is not None or (i == 0 and not batch) else k for i, (d, k) in enumerate(zip(t.shape, known)))
        for t, known in zip(node.input_tensors, known_shapes)
    ]


def _constant(value):
    return value is None or isinstance(value, (bool, int, float, str))


def open_call(node, known_shapes=None):
    """`(Functional, None)` to flatten in place of the layer call `node`, or
    `(None, reason)` to keep it one node (`reason` None for a call that is
    not a composite layer's: no sublayers, a model, an op).

    A call whose trace fails on its symbolic shapes (Python arithmetic on
    an unknown dimension: keras_hub's causal masks) is traced again on
    `known_shapes` (one shape per input tensor, the shapes the model is
    planned for), if given: first with the batch dimension free, then, if
    the planned shapes fix one, with it. Its graph then serves those
    shapes only."""
    layer = node.operation
    if not isinstance(layer, keras.layers.Layer) or (isinstance(layer, keras.Model) and not is_subclassed(layer)):
        return None, None
    if not keras_compat.has_sublayers(layer):
        return None, None
    opened = layer.__dict__.get(_CACHE_ATTR)
    if opened is None:
        opened = _Opened()
        object.__setattr__(layer, _CACHE_ATTR, opened)
    cache = opened.graphs
    shapes = [tuple(t.shape) for t in node.input_tensors]
    key = _signature(node, shapes)
    if key not in cache:
        cache[key] = _open(layer, node, shapes)
    for batch in (False, True):
        if cache[key][0] is not None or known_shapes is None or not cache[key][1].startswith(_UNTRACEABLE):
            break
        shapes = _known(node, known_shapes, batch)
        key = _signature(node, shapes)
        if key not in cache:
            cache[key] = _open(layer, node, shapes)
    fn, why = cache[key]
    if fn is None and known_shapes is not None and why.startswith(_UNTRACEABLE) and shapes[0][0] is None:
        why += (
            "; it may trace at a fixed batch size: plan with one (`input_shape=` with the batch "
            "dimension; for `fit`, batches of one size, e.g. a dataset batched with `drop_remainder=True`)"
        )
    return fn, why


def is_subclassed(model):
    """Whether `model` is a `keras.Model` whose graph lives in its `call`
    (neither functional nor a `Sequential`): opened like a composite layer."""
    return (
        isinstance(model, keras.Model)
        and not isinstance(model, keras.Sequential)
        and not keras_compat.is_functional(model)
    )


def own_state(layer):
    """Variables and seed generators `layer` holds itself, not through a
    sublayer."""
    inner = {id(v) for sub in keras_compat.sublayers(layer, include_self=False) for v in sub.variables}
    own = [v for v in layer.variables if id(v) not in inner]
    return own + keras_compat.untracked_variables(layer)


_UNTRACEABLE = "its `call` cannot be traced"


def _open(layer, node, shapes):
    if own_state(layer):
        return None, "it holds variables or seed generators of its own, which its `call` reads"
    if not all(isinstance(v, keras.KerasTensor) or _constant(v) for v in tree.flatten(_bind(node, node.input_tensors))):
        return None, "it is called with arguments besides tensors, constants and `training`"
    if any(keras_compat.get_keras_mask(t) is not None for t in node.input_tensors):
        return None, "it is called on tensors with masks"
    with random_state_kept():
        try:
            fn = _trace(layer, node, shapes)
        except Exception as e:  # noqa: BLE001 - any failure keeps the layer whole
            return None, f"{_UNTRACEABLE} ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    why = _verify(layer, node, fn, shapes)
    return (fn, None) if why is None else (None, why)


def _bind(node, values):
    """The node's call arguments (`training` left out) with its input
    tensors replaced, in order, by `values`."""
    by_id = {id(t): v for t, v in zip(node.input_tensors, values)}
    args, kwargs = tree.map_structure(
        lambda v: by_id.get(id(v), v),
        (node.arguments.args, {k: v for k, v in node.arguments.kwargs.items() if k not in _ARGS}),
    )
    return args, kwargs


def _trace(layer, node, shapes):
    """The layer's `call` recorded on fresh `keras.Input`s of `shapes`
    (one per input tensor of the node, in order), as a `Functional`."""
    inputs = [
        keras.Input(batch_shape=shape, dtype=t.dtype, name=f"{layer.name}_input_{i}")
        for i, (shape, t) in enumerate(zip(shapes, node.input_tensors))
    ]
    args, kwargs = _bind(node, cast_inputs(layer, inputs))
    return record(layer, inputs, lambda: type(layer).call(layer, *args, **kwargs))


def cast_inputs(layer, inputs):
    """`inputs` (a structure of symbolic tensors) cast to `layer`'s compute
    dtype where `Layer.__call__` would cast them: floats, with autocast on."""
    return tree.map_structure(
        lambda x: keras.ops.cast(x, layer.compute_dtype)
        if "float" in x.dtype and x.dtype != layer.compute_dtype and layer.autocast
        else x,
        inputs,
    )


def record(layer, inputs, call):
    """Runs `call()` (which calls `layer`'s own `call` on `inputs`, symbolic
    tensors) and returns what it recorded as a `Functional` named after
    `layer`: its sublayer calls and ops, each recorded `training=None`
    dropped, the ops named after `layer`."""
    before = {id(n) for sub in keras_compat.sublayers(layer) for n in keras_compat.inbound_nodes(sub)}
    own_spec = keras.layers.Layer.compute_output_spec
    subs = [
        sub
        for sub in keras_compat.sublayers(layer, include_self=False)
        if type(sub).compute_output_spec is not own_spec and "compute_output_spec" not in sub.__dict__
    ]
    for sub in subs:
        object.__setattr__(sub, "compute_output_spec", _spec_without_nones(sub))
    try:
        outputs = call()
    finally:
        for sub in subs:
            object.__delattr__(sub, "compute_output_spec")
    if not tree.flatten(outputs) or not all(isinstance(t, keras.KerasTensor) for t in tree.flatten(outputs)):
        raise ValueError("its outputs are not all tensors computed from its inputs")
    fn = keras.Model(inputs, outputs, name=f"{layer.name}_opened")
    _forget_recorded_nones(fn)
    _name_ops(layer, fn, before)
    return fn


def _spec_without_nones(sub):
    """`sub.compute_output_spec`, called without the keyword arguments
    passed as None that it does not take (keras_hub's
    `CachedMultiHeadAttention` is called with `cache=None`, which
    `MultiHeadAttention.compute_output_spec` rejects)."""
    own = type(sub).compute_output_spec
    takes = inspect.signature(own).parameters

    def spec(*args, **kwargs):
        if not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
            kwargs = {k: v for k, v in kwargs.items() if v is not None or k in takes}
        return own(sub, *args, **kwargs)

    return spec


def _forget_recorded_nones(fn):
    """Drops, from every call the trace recorded, `training=None` (Keras
    passes the model's `training` to a call recorded without one) and any
    other keyword argument recorded as None that defaults to None in the
    layer's `call` (the same call, and one its `compute_output_spec` may
    not take)."""
    for node in keras_compat.nodes_of(fn):
        kwargs = node.arguments.kwargs
        if not isinstance(node.operation, keras.layers.Layer):
            continue
        params = inspect.signature(node.operation.call).parameters
        for k in [k for k, v in kwargs.items() if v is None]:
            if k == "training" or (k in params and params[k].default is None):
                del kwargs[k]


def _name_ops(layer, fn, before):
    """Names each op the trace made after `layer` (`<layer>_<op>`, `_1`,
    ...): deterministic names, unique in the model, so that a saved plan
    finds them again when the layer is opened after loading."""
    own = {id(sub) for sub in keras_compat.sublayers(layer)}
    counts = {}
    for op in fn.operations:
        if id(op) in own or isinstance(op, keras.layers.InputLayer):
            continue
        base = f"{layer.name}_{type(op).__name__.lower()}"
        k = counts.get(base, 0)
        counts[base] = k + 1
        op.name = base if k == 0 else f"{base}_{k}"


def _verify(layer, node, fn, shapes):
    """None if `fn` computes what `layer` does on a small batch (2 examples
    where the batch dimension is free): the same outputs in training and in
    inference, and the same gradients of a loss on them with respect to
    every trainable variable, from the same seed state; else why not."""
    xs = [small_batch(shape, t.dtype, seed=i) for i, (shape, t) in enumerate(zip(shapes, node.input_tensors))]
    args, kwargs = _bind(node, xs)
    for training in (True, False):
        differs = same_values(
            layer, lambda t=training: layer(*args, training=t, **kwargs), lambda t=training: fn(xs, training=t)
        )
        if differs:
            return f"its opened graph computes other {differs} than its `call` (training={training})"
    return None


def small_batch(shape, dtype, seed=0):
    """A tensor of `shape` (2 where a dimension is None) of random values:
    normal for floats, 0 or 1 for the rest."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = tuple(2 if d is None else d for d in shape)
    if "float" in str(dtype):
        return keras.ops.convert_to_tensor(rng.normal(size=shape).astype(dtype))
    return keras.ops.convert_to_tensor(rng.integers(0, 2, size=shape).astype(dtype))


def same_values(layer, want, got):
    """None if `want()` and `got()` give the same outputs (a structure of
    tensors) and the same gradients of a loss on them with respect to each
    trainable variable of `layer`, each run from the same seed state and
    non-trainable variables (restored after); else what differs ("values",
    or "gradients (of <variable path>)")."""
    import numpy as np

    state = [v for v in layer.variables if not v.trainable]
    start = [keras.ops.convert_to_numpy(v.value) for v in state]
    trainable = list(layer.trainable_variables)
    a = _run(lambda: _with_grads(want, trainable), state, start)
    b = _run(lambda: _with_grads(got, trainable), state, start)
    if len(a) != len(b):
        return "values"
    n_outputs = len(a) - len(trainable)
    for i, (x, y) in enumerate(zip(a, b)):
        if x.shape != y.shape or not np.allclose(x, y, rtol=1e-5, atol=1e-6, equal_nan=True):
            return "values" if i < n_outputs else f"gradients (of {trainable[i - n_outputs].path})"
    return None


def _with_grads(call, variables):
    """The outputs of `call()` and the gradients of the sum of their means
    of squares with respect to `variables`, as float32 numpy arrays."""
    import numpy as np

    def loss_of(outputs):
        return sum(keras.ops.mean(keras.ops.square(keras.ops.cast(o, "float32"))) for o in tree.flatten(outputs))

    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            outputs = call()
            loss = loss_of(outputs)
        grads = tape.gradient(loss, [v.value for v in variables])
    elif backend == "torch":
        import torch

        outputs = call()
        grads = torch.autograd.grad(loss_of(outputs), [v.value for v in variables], allow_unused=True)
        outputs = tree.map_structure(lambda o: o.detach(), outputs)
    elif backend == "jax":
        import jax

        def loss_fn(values):
            with keras.StatelessScope(state_mapping=list(zip(variables, values)), collect_losses=True):
                outputs = call()
            return loss_of(outputs), outputs

        grads, outputs = jax.grad(loss_fn, has_aux=True)([v.value for v in variables])
    else:
        outputs, grads = call(), []
    found = [keras.ops.convert_to_numpy(t) for t in tree.flatten(outputs)]
    found += [np.zeros(1) if g is None else keras.ops.convert_to_numpy(g) for g in grads]
    return [np.asarray(a, dtype="float32") for a in found]


def _run(call, state, start):
    """Runs `call` from the non-trainable state `start` (and the random
    state: `random_state_kept`), then restores it: the same random draws,
    no statistics moved."""
    for v, value in zip(state, start):
        v.assign(value)
    try:
        with random_state_kept():
            return call()
    finally:
        for v, value in zip(state, start):
            v.assign(value)


@contextlib.contextmanager
def random_state_kept():
    """Restores, on exit, PyTorch's global generator, which unseeded Dropout
    draws from on PyTorch, and which a symbolic call that falls back to
    running on real tensors (float16 on the CPU) draws from too. Tracing and
    checking a graph must not move what training draws next."""
    torch_rng = None
    if keras.backend.backend() == "torch":
        import torch

        torch_rng = torch.get_rng_state()
    try:
        yield
    finally:
        if torch_rng is not None:
            torch.set_rng_state(torch_rng)
