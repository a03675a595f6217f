"""Opening a composite layer's call into a functional graph of its parts.

A layer whose `call` only calls other layers and `keras.ops` (a user's
transformer block written as a `keras.layers.Layer` subclass, Keras's
`MultiHeadAttention`) is one node of the layer graph, so no cut can fall
inside it. Calling `type(layer).call(layer, *keras_inputs)` on symbolic
inputs instead of `layer(...)` records each sublayer call and each op as a
node of its own: a `Functional` that `graphckpt.graph` then flattens as it
flattens a nested model, the same layer objects and variables in it.

A call is opened only where replaying that graph computes what calling the
layer does (`open_call` says why not otherwise):

- the layer owns no variables, seed generators or other state itself (its
  `call` would read or assign them outside any sublayer call, and they
  would not be in the graph); all of its variables belong to sublayers;
- it is called on tensors without masks, with no argument but its input
  tensors, `training` and constants (masks read inside `call` would become
  ops on whatever made them);
- tracing succeeds (no Python arithmetic on unknown dimensions, no
  `keras.random` op outside a layer, no control flow on tensor values);
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

import keras
from keras import tree

from graphckpt import keras_compat

__all__ = ["open_call"]

_CACHE_ATTR = "_graphckpt_opened"  # on the layer: {signature: (Functional | None, reason)}
_ARGS = ("training",)


class _Opened:
    """A layer's opened graphs by call signature (`graphs`). A plain object,
    set with `object.__setattr__`, so Keras neither tracks the Functionals
    in it as sublayers nor walks them when saving; it dies with the layer."""

    def __init__(self):
        self.graphs = {}


def _signature(node):
    kwargs = tuple(sorted((k, repr(v)) for k, v in node.arguments.kwargs.items() if k not in _ARGS))
    return tuple((tuple(t.shape), t.dtype) for t in node.input_tensors), kwargs


def _constant(value):
    return value is None or isinstance(value, (bool, int, float, str))


def open_call(node):
    """`(Functional, None)` to flatten in place of the layer call `node`, or
    `(None, reason)` to keep it one node (`reason` None for a call that is
    not a composite layer's: no sublayers, a model, an op)."""
    layer = node.operation
    if not isinstance(layer, keras.layers.Layer) or isinstance(layer, keras.Model):
        return None, None
    if not keras_compat.has_sublayers(layer):
        return None, None
    opened = layer.__dict__.get(_CACHE_ATTR)
    if opened is None:
        opened = _Opened()
        object.__setattr__(layer, _CACHE_ATTR, opened)
    cache = opened.graphs
    key = _signature(node)
    if key not in cache:
        cache[key] = _open(layer, node)
    return cache[key]


def _own_state(layer):
    """Variables and seed generators `layer` holds itself, not through a
    sublayer."""
    inner = {id(v) for sub in keras_compat.sublayers(layer, include_self=False) for v in sub.variables}
    own = [v for v in layer.variables if id(v) not in inner]
    return own + keras_compat.untracked_variables(layer)


def _open(layer, node):
    if _own_state(layer):
        return None, "it holds variables or seed generators of its own, which its `call` reads"
    kwargs = node.arguments.kwargs
    if len(node.arguments.args) != len(node.input_tensors) or not all(
        _constant(v) for k, v in kwargs.items() if k not in _ARGS
    ):
        return None, "it is called with arguments besides its input tensors, constants and `training`"
    if any(keras_compat.get_keras_mask(t) is not None for t in node.input_tensors):
        return None, "it is called on tensors with masks"
    try:
        fn = _trace(layer, node)
    except Exception as e:  # noqa: BLE001 - any failure keeps the layer whole
        return None, f"its `call` cannot be traced ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    why = _verify(layer, node, fn)
    return (fn, None) if why is None else (None, why)


def _trace(layer, node):
    """The layer's `call` recorded on fresh `keras.Input`s of the node's
    input shapes, as a `Functional`."""
    inputs = [
        keras.Input(batch_shape=tuple(t.shape), dtype=t.dtype, name=f"{layer.name}_input_{i}")
        for i, t in enumerate(node.input_tensors)
    ]
    before = {id(n) for sub in keras_compat.sublayers(layer) for n in keras_compat.inbound_nodes(sub)}
    xs = [
        keras.ops.cast(x, layer.compute_dtype)
        if "float" in x.dtype and x.dtype != layer.compute_dtype and layer.autocast
        else x
        for x in inputs
    ]
    constants = {k: v for k, v in node.arguments.kwargs.items() if k not in _ARGS}
    outputs = type(layer).call(layer, *xs, **constants)
    if not tree.flatten(outputs) or not all(isinstance(t, keras.KerasTensor) for t in tree.flatten(outputs)):
        raise ValueError("its outputs are not all tensors computed from its inputs")
    fn = keras.Model(inputs, outputs, name=f"{layer.name}_opened")
    _forget_recorded_training(fn)
    _name_ops(layer, fn, before)
    return fn


def _forget_recorded_training(fn):
    """Drops `training=None` from every call the trace recorded: Keras
    passes the model's `training` to a call recorded without one."""
    for node in keras_compat.nodes_of(fn):
        kwargs = node.arguments.kwargs
        if "training" in kwargs and kwargs["training"] is None:
            del kwargs["training"]


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


def _verify(layer, node, fn):
    """None if `fn` computes what `layer` does on a small batch (2 examples
    where the batch dimension is free): the same outputs in training and in
    inference, and the same gradients of a loss on them with respect to
    every trainable variable, from the same seed state; else why not."""
    import numpy as np

    rng = np.random.default_rng(0)
    xs = []
    for t in node.input_tensors:
        shape = tuple(2 if d is None else d for d in t.shape)
        if "float" in t.dtype:
            xs.append(keras.ops.convert_to_tensor(rng.normal(size=shape).astype(t.dtype)))
        else:
            xs.append(keras.ops.convert_to_tensor(rng.integers(0, 2, size=shape).astype(t.dtype)))
    state = [v for v in layer.variables if not v.trainable]
    start = [keras.ops.convert_to_numpy(v.value) for v in state]
    trainable = list(layer.trainable_variables)
    constants = {k: v for k, v in node.arguments.kwargs.items() if k not in _ARGS}
    for training in (True, False):
        want = _run(lambda t=training: _with_grads(lambda: layer(*xs, training=t, **constants), trainable), state, start)
        got = _run(lambda t=training: _with_grads(lambda: fn(xs, training=t), trainable), state, start)
        for a, b in zip(want, got):
            if a.shape != b.shape or not np.allclose(a, b, rtol=1e-5, atol=1e-6, equal_nan=True):
                return f"its opened graph computes other values or gradients than its `call` (training={training})"
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
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                outputs = call()
            return loss_of(outputs), outputs

        grads, outputs = jax.grad(loss_fn, has_aux=True)([v.value for v in variables])
    else:
        outputs, grads = call(), []
    found = [keras.ops.convert_to_numpy(t) for t in tree.flatten(outputs)]
    found += [np.zeros(1) if g is None else keras.ops.convert_to_numpy(g) for g in grads]
    return [np.asarray(a, dtype="float32") for a in found]


def _run(call, state, start):
    """Runs `call` from the non-trainable state `start` (and, on PyTorch,
    the global generator's, which unseeded Dropout draws from), then
    restores it: the same random draws, no statistics moved."""
    torch_rng = None
    if keras.backend.backend() == "torch":
        import torch

        torch_rng = torch.get_rng_state()
    for v, value in zip(state, start):
        v.assign(value)
    try:
        return call()
    finally:
        for v, value in zip(state, start):
            v.assign(value)
        if torch_rng is not None:
            torch.set_rng_state(torch_rng)
