"""Shared test helpers: one training step on a model, gradients computed
the way each backend does, and a step-for-step comparison of two models
from the same variable state.

- TensorFlow: `tf.GradientTape`, eagerly or in a `tf.function`.
- JAX: `jax.value_and_grad` over `model.stateless_call(trainable,
  non_trainable, x, training=True, return_losses=True)`, optionally under
  `jax.jit`; the new non-trainable values are assigned afterwards, as the
  JAX trainer does.
- PyTorch: eager forward, then `torch.autograd.grad`.
"""

import keras
import numpy as np
from keras import tree

BACKEND = keras.backend.backend()


def to_numpy(x):
    return np.array(keras.ops.convert_to_numpy(x))


def _all_state(model):
    """`model.variables`, the variables layers hold untracked (a stateful
    RNN's states), and Keras's global seed generator state, if any."""
    from keras.src.backend.common import global_state

    from graphckpt.keras_compat import untracked_variables

    generator = global_state.get_global_attribute("global_seed_generator")
    untracked = untracked_variables(model)
    return list(model.variables) + untracked + ([generator.state] if generator is not None else [])


def state_of(model):
    """Every variable of `model` (weights, statistics, seed states, a
    stateful RNN's states, and the global seed generator's state) as numpy."""
    return [to_numpy(v.value) for v in _all_state(model)]


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


def _tf_step(model, variables, inputs, compiled):
    import tensorflow as tf

    def step(x):
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            loss = loss_of(outputs, model.losses)
        return loss, tape.gradient(loss, [v.value for v in variables]), outputs

    if compiled:
        step = tf.function(step)
    return step(inputs)


def jax_loss_fn(model):
    """`(trainable_values, non_trainable_values, x) -> (loss, (outputs,
    new_non_trainable_values))`, a pure function over `model.stateless_call`."""

    def loss_fn(trainable, non_trainable, x):
        outputs, new_state, losses = model.stateless_call(
            trainable, non_trainable, x, training=True, return_losses=True
        )
        return loss_of(outputs, losses), (outputs, new_state)

    return loss_fn


def _jax_step(model, variables, inputs, compiled):
    import jax

    grad_fn = jax.value_and_grad(jax_loss_fn(model), has_aux=True)
    if compiled:
        grad_fn = jax.jit(grad_fn)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    (loss, (outputs, new_state)), grads = grad_fn(trainable, non_trainable, inputs)
    for v, value in zip(model.non_trainable_variables, new_state):
        v.assign(value)
    # The model's own variable order may differ from `variables`'s.
    by_id = {id(v): g for v, g in zip(model.trainable_variables, grads)}
    return loss, [by_id.get(id(v)) for v in variables], outputs


def _torch_step(model, variables, inputs, compiled):
    import torch

    if compiled:
        raise NotImplementedError("no compiled torch step in these tests")
    outputs = model(inputs, training=True)
    loss = loss_of(outputs, model.losses)
    grads = torch.autograd.grad(loss, [v.value for v in variables], allow_unused=True)
    return loss.detach(), list(grads), tree.map_structure(lambda t: t.detach(), outputs)


def _global_rng_state():
    """The backend's global RNG state outside Keras variables: on torch, an
    unseeded Dropout draws from torch's global generator."""
    if BACKEND == "torch":
        import torch

        return torch.get_rng_state()
    return None


def _set_global_rng_state(state):
    if BACKEND == "torch":
        import torch

        torch.set_rng_state(state)


_STEPS = {"tensorflow": _tf_step, "jax": _jax_step, "torch": _torch_step}


def train_step(model, variables, inputs, compiled=False):
    """Loss, gradients wrt `variables` (None where unconnected) and outputs of
    one training step, as numpy. `compiled`: tf.function / jax.jit."""
    loss, grads, outputs = _STEPS[BACKEND](model, variables, inputs, compiled)
    grads = [None if g is None else to_numpy(g) for g in grads]
    return to_numpy(loss), grads, tree.map_structure(to_numpy, outputs)


def compare_step(original, checkpointed, inputs, compiled=False, atol=1e-5, rtol=1e-5, unconnected="error"):
    """Runs one training step on each model from the same state; asserts equal
    loss, gradients, outputs and updated state. Leaves `original`'s state as
    the step left it. Returns the max absolute gradient difference.

    `compiled`: in a `tf.function` / under `jax.jit`.
    `unconnected` says what a variable without gradient (None: it does not
    reach the loss) may do: `"error"`, fail; `"same"`, be None in both
    models; `"zero"`, be None in the original and None or all zeros in the
    checkpointed model (TensorFlow's `recompute_grad` gives zeros for the
    variables a segment reads without using, e.g. behind an unused output of
    a nested model)."""
    variables = original.trainable_variables
    start = state_of(original)
    rng = _global_rng_state()
    loss0, grads0, out0 = train_step(original, variables, inputs, compiled)
    after0 = state_of(original)
    restore(original, start)
    _set_global_rng_state(rng)
    loss1, grads1, out1 = train_step(checkpointed, variables, inputs, compiled)
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
        np.testing.assert_allclose(to_numpy(y), to_numpy(x), atol=atol)
