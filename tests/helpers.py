"""Shared test helpers: run one training step on a model and compare two
models step for step, from the same variable state."""

import keras
import numpy as np
from keras import tree


def _all_state(model):
    """`model.variables` plus Keras's global seed generator state, if any."""
    from keras.src.backend.common import global_state

    generator = global_state.get_global_attribute("global_seed_generator")
    return list(model.variables) + ([generator.state] if generator is not None else [])


def state_of(model):
    """Every variable of `model` (weights, statistics, seed states, and the
    global seed generator's state) as numpy."""
    return [np.array(keras.ops.convert_to_numpy(v.value)) for v in _all_state(model)]


def restore(model, values):
    for v, x in zip(_all_state(model), values):
        v.assign(x)


def loss_of(outputs, losses):
    total = 0.0
    for y in tree.flatten(outputs):
        total = total + keras.ops.mean(keras.ops.square(keras.ops.cast(y, "float32")))
    for extra in losses:
        total = total + keras.ops.cast(extra, "float32")
    return total


def tf_step(model, variables, inputs, graph=False, jit_compile=False):
    """Loss, gradients wrt `variables`, and outputs of one training step (TF)."""
    import tensorflow as tf

    def step(x):
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            loss = loss_of(outputs, model.losses)
        grads = tape.gradient(loss, [v.value for v in variables])
        return loss, grads, outputs

    if graph:
        step = tf.function(step, jit_compile=jit_compile)
    loss, grads, outputs = step(inputs)
    to_np = keras.ops.convert_to_numpy
    grads = [None if g is None else to_np(g) for g in grads]
    return to_np(loss), grads, tree.map_structure(to_np, outputs)


def compare_step(
    original, checkpointed, inputs, graph=False, atol=1e-5, rtol=1e-5, jit_compile=False, unconnected="error"
):
    """Runs one training step on each model from the same state; asserts equal
    loss, gradients, outputs and updated state. Leaves `original`'s state as
    the step left it. Returns the max absolute gradient difference.

    `unconnected` says what a variable without gradient (None: it does not
    reach the loss) may do: `"error"`, fail; `"same"`, be None in both
    models; `"zero"`, be None in the original and None or all zeros in the
    checkpointed model (TensorFlow's `recompute_grad` gives zeros for the
    variables a segment reads without using, e.g. behind an unused output of
    a nested model)."""
    variables = original.trainable_variables
    start = state_of(original)
    loss0, grads0, out0 = tf_step(original, variables, inputs, graph, jit_compile)
    after0 = state_of(original)
    restore(original, start)
    loss1, grads1, out1 = tf_step(checkpointed, variables, inputs, graph, jit_compile)
    after1 = state_of(original)
    np.testing.assert_allclose(loss1, loss0, atol=atol, rtol=rtol, err_msg="loss")
    for a, b in zip(tree.flatten(out1), tree.flatten(out0)):
        np.testing.assert_allclose(a, b, atol=atol, rtol=rtol, err_msg="outputs")
    worst = 0.0
    for v, a, b in zip(variables, grads1, grads0):
        assert unconnected != "error" or (a is not None and b is not None), f"no gradient for {v.path}"
        if b is None:
            zero = unconnected == "zero" and a is not None and not np.any(a)
            assert a is None or zero, f"gradient of {v.path}: None in the original, not in the checkpointed model"
            continue
        assert a is not None, f"gradient of {v.path}: None in the checkpointed model only"
        np.testing.assert_allclose(a, b, atol=atol, rtol=rtol, err_msg=f"gradient of {v.path}")
        worst = max(worst, float(np.max(np.abs(a - b))) if a.size else 0.0)
    for v, a, b in zip(_all_state(original), after1, after0):
        np.testing.assert_allclose(a, b, atol=atol, rtol=rtol, err_msg=f"state of {v.path}")
    return worst


def compare_inference(original, checkpointed, inputs, atol=1e-5):
    a = original(inputs, training=False)
    b = checkpointed(inputs, training=False)
    for x, y in zip(tree.flatten(a), tree.flatten(b)):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(y), keras.ops.convert_to_numpy(x), atol=atol)
