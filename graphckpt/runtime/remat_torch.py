"""Rematerialization on PyTorch: a non-reentrant `torch.utils.checkpoint`
without early stop, and the value helpers a segment uses on PyTorch
(`snapshot`, `components`). `graphckpt.runtime.remat` says what goes in
and comes out."""

__all__ = ["torch_remat", "snapshot", "components"]


def snapshot(value):
    """A copy of a variable's `value` that later in-place assignments cannot
    change, outside autograd."""
    return value.detach().clone()


def components(x):
    """None: Keras's PyTorch backend has no sparse inputs."""
    return None


def torch_remat(f):
    """`keras.remat(f)` on PyTorch (a non-reentrant
    `torch.utils.checkpoint.checkpoint`), with `early_stop=False`.

    With early stop, torch ends each recompute as soon as it has the last
    tensor the backward needs, by raising `_StopRecomputationError` from a
    saved-tensor hook deep inside the recompute. Keras's traceback filtering
    (its layers' `__call__` wrappers) keeps that exception's frames in a
    reference cycle, and the frames hold the recomputed activations: they
    stay alive after the step until Python's cyclic garbage collector runs,
    often more than the segments save (docs/how-it-works.md, "PyTorch's
    early stop"). Without early stop the recompute returns normally
    and its frames are freed by reference counting. It then also runs the
    segment's tail after the last saved tensor, which is short: a segment
    ends where it is cut, and its last layers' saved tensors come last.

    The flag is this call's own argument: no global torch or Keras setting
    changes. A `torch.utils.checkpoint.set_checkpoint_early_stop(...)`
    context the user opened still takes precedence, as torch documents.
    """
    import torch.utils.checkpoint

    def wrapped(*args):
        return torch.utils.checkpoint.checkpoint(f, *args, use_reentrant=False, early_stop=False)

    return wrapped
