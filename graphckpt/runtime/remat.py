"""Rematerialization of one function, per backend: the forward pass keeps
only the function's arguments, and the backward pass recomputes it.

`segment_remat` picks the backend's: on TensorFlow a custom gradient
(`tf_remat`), on JAX a `custom_vjp` (`jax_remat`), on PyTorch a
non-reentrant `torch.utils.checkpoint` (`torch_remat`), one module per
backend (`remat_tensorflow`, `remat_jax`, `remat_torch`). Each recomputes
from the forward pass's own values (the segment's inputs and its variable
reads), and each makes the recompute depend on the incoming gradient, so
that no compiler moves it into the forward pass. `graphckpt.runtime.segment` says
what goes in and comes out.
"""

import keras

from graphckpt.runtime import remat_jax, remat_tensorflow, remat_torch
from graphckpt.runtime.remat_jax import jax_remat
from graphckpt.runtime.remat_tensorflow import tf_remat
from graphckpt.runtime.remat_torch import torch_remat

__all__ = ["segment_remat", "snapshot", "components"]

_BACKENDS = {"tensorflow": remat_tensorflow, "jax": remat_jax, "torch": remat_torch}


def segment_remat(f, n_inputs):
    """`f`, rematerialized on the current backend.

    Args:
        f: a function of tensors returning a tuple of tensors. On
            TensorFlow its recompute is called with a keyword `tie`: a
            function that returns a list of tensors unchanged but ordered
            after the incoming gradients (`remat_tensorflow.tf_tie_closed`). `f` passes every value
            it closes over through it (state snapshots, integer inputs), so
            that no part of the recompute can run before the gradient
            exists. In a graph, the forward call's `tie` orders them after
            the segment's inputs (`remat_tensorflow.tf_after`); an eager one
            gets none.
        n_inputs: how many leading arguments are the segment's inputs; the
            rest are the values its trainable variables were read as.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return tf_remat(f, n_inputs)
    if backend == "jax":
        return jax_remat(f, n_inputs)
    if backend == "torch":
        return torch_remat(f)
    return keras.remat(f)


def snapshot(variable):
    """The variable's current value, as a tensor that later assignments to
    the variable cannot change."""
    module = _BACKENDS.get(keras.backend.backend())
    return variable.value if module is None else module.snapshot(variable.value)


def components(x):
    """`x`'s component tensors, and a function that builds `x` again from
    new ones: a sparse tensor's (TensorFlow's `SparseTensor`: indices,
    values, shape; JAX's `BCOO`: data, indices), or `[x]` for a tensor."""
    module = _BACKENDS.get(keras.backend.backend())
    found = None if module is None else module.components(x)
    return found or ([x], lambda parts: parts[0])
