"""Rematerialization of one function, per backend: the forward pass keeps
only the function's arguments, and the backward pass recomputes it.

`segment_remat` picks the backend's: on TensorFlow a custom gradient
(`tf_remat`), on JAX a `custom_vjp` (`jax_remat`), on PyTorch a
non-reentrant `torch.utils.checkpoint` (`torch_remat`). Each recomputes
from the forward pass's own values (the segment's inputs and its variable
reads), and each makes the recompute depend on the incoming gradient, so
that no compiler moves it into the forward pass. `graphckpt.segment` says
what goes in and comes out.
"""

import keras

from graphckpt import keras_compat

__all__ = ["segment_remat", "tf_remat", "tf_tie", "jax_remat", "jax_tie", "jax_materialize", "torch_remat"]


def segment_remat(f, n_inputs):
    """`f`, rematerialized on the current backend.

    Args:
        f: a function of tensors returning a tuple of tensors. On
            TensorFlow its recompute is called with a keyword `tie`: a
            function that returns a list of tensors unchanged but ordered
            after the incoming gradients (`_tie_closed`). `f` passes every value
            it closes over through it (state snapshots, integer inputs), so
            that no part of the recompute can run before the gradient
            exists; a forward call gets no `tie`.
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


def tf_remat(f, n_inputs):
    """On TensorFlow: a custom gradient that recomputes `f`
    from its arguments, the segment's inputs then the values its trainable
    variables were read as in the forward pass.

    The variables are read once, in the forward pass, and the recompute
    uses those reads, as a plain graph's backward pass uses its forward
    reads: nothing could order a second read before the optimizer's updates
    of the same step, and under load TensorFlow's executor would sometimes
    run an update first (docs/limitations.md).

    The segment's input gradients are returned only after its weight
    gradients exist (a control dependency), so at most one recomputed
    interior is alive at a time; `tf.recompute_grad` orders a recompute
    after the gradient of its output only, and the peak then depends on
    the executor's schedule (docs/benchmarks.md, "Recompute order").
    Gradients are unchanged.

    What `f` closes over is tied as well, through its `tie` keyword
    (`_tie_closed`): a recompute's random masks come from a closed-over seed
    snapshot and a causal mask from a closed-over integer input, and no op
    of the recompute, these included, runs before the incoming gradient
    exists (docs/benchmarks.md, "Nested models and keras_hub").

    Args:
        f: a function of tensors returning a tuple of tensors.
        n_inputs: how many leading arguments are the segment's inputs (each
            gets a gradient, zeros where none flows); the rest are variable
            reads, whose gradient stays None where none flows, as the
            original's does (optimizers skip None).
    """
    import tensorflow as tf
    context, record = keras_compat.tf_eager_internals()

    @tf.custom_gradient
    def inner(*args):
        with record.stop_recording():
            result = f(*args)

        def grad(*dresult, variables=None):
            with tf.GradientTape() as tape:
                inputs = [tf.identity(x) for x in args[:n_inputs]]
                tie = {}
                if not context.executing_eagerly():
                    # As tf.recompute_grad: recompute once dresult exists,
                    # a data dependency, tied as on JAX: a select on the
                    # gradients' bits, which XLA cannot fold (`tf_tie`).
                    inputs = tf_tie(inputs, dresult)
                    tie = {"tie": lambda tensors: _tie_closed(tensors, dresult)}
                id_args = inputs + list(args[n_inputs:])
                tape.watch(id_args)
                if variables:
                    tape.watch(variables)
                recomputed = f(*id_args, **tie)
            # NONE, not tf.recompute_grad's ZERO: a variable that reaches no
            # output (say, only through stop_gradient) gets None, as in the
            # original, which optimizers skip; a zero would be applied.
            grads = tape.gradient(
                recomputed,
                id_args + list(variables or []),
                output_gradients=dresult,
                unconnected_gradients=tf.UnconnectedGradients.NONE,
            )
            g_inputs = [tf.zeros_like(x) if g is None else g for x, g in zip(args, grads[:n_inputs])]
            g_weights = grads[n_inputs:]
            computed = [g for g in g_weights if g is not None]
            if computed and not context.executing_eagerly():
                with tf.control_dependencies(computed):
                    g_inputs = [tf.identity(g) for g in g_inputs]
            g_args = g_inputs + g_weights[: len(args) - n_inputs]
            return g_args, g_weights[len(args) - n_inputs :]

        return result, grad

    return inner


# Integer and boolean values a recompute closes over up to this many
# elements (seed states: 2) are tied by a select, which copies them.
_SELECT_MAX_ELEMENTS = 1 << 16


def _tie_closed(tensors, gradients):
    """What a recompute closes over, tied to the gradients: small integers
    and booleans of known size (seed states) by `tf_tie`'s select, a data
    dependency XLA keeps; everything else (frozen weights, moving
    statistics, token ids, an attention-mask input of any size) by a
    control dependency, which copies nothing and orders TensorFlow's
    executor, though not XLA."""
    import tensorflow as tf

    def small(x):
        return (
            (x.dtype.is_integer or x.dtype.is_bool)
            and x.shape.is_fully_defined()
            and x.shape.num_elements() <= _SELECT_MAX_ELEMENTS
        )

    dense = [i for i, x in enumerate(tensors) if isinstance(x, tf.Tensor)]
    selected = [i for i in dense if small(tensors[i])]
    out = list(tensors)
    for i, x in zip(selected, tf_tie([tensors[i] for i in selected], gradients)):
        out[i] = x
    after = [g for g in gradients if g is not None]
    ordered = sorted(set(dense) - set(selected))
    if after and ordered:
        with tf.control_dependencies(after):
            for i in ordered:
                out[i] = tf.identity(out[i])
    return out


def tf_tie(tensors, gradients):
    """`tensors`, with their values bit for bit, as results of the
    gradients: TensorFlow's `jax_tie`.

    Ties on every gradient, not only the first: TensorFlow fills an unused
    result's with zeros made in the forward pass (probabilities whose loss
    reads logits), and a tie on those alone would not wait for the
    backward pass. A select keeps every value (-0.0 too, which `x + 0`
    made +0.0)."""
    import tensorflow as tf

    # The first element of each gradient, or 0 where it has none (a size
    # TensorFlow may know only at run time).
    bits = [
        tf.bitcast(tf.cast(tf.concat([tf.reshape(g, [-1])[:1], tf.zeros([1], g.dtype)], 0)[:1], tf.float32), tf.uint32)
        for g in gradients
        if g is not None and g.dtype.is_floating
    ]
    if not bits:
        return list(tensors)
    u = bits[0]
    for b in bits[1:]:
        u = tf.bitwise.bitwise_or(u, b)
    keep = tf.reshape(tf.not_equal(tf.bitwise.bitwise_or(u, 1), 0), [])

    def tied(x):
        # Dense numbers and booleans; strings, resources and composite
        # tensors (sparse, ragged) pass as they are.
        if not isinstance(x, tf.Tensor) or not (x.dtype.is_numeric or x.dtype.is_bool):
            return x
        return tf.where(keep, x, tf.zeros([], x.dtype))  # no full-size zeros

    return [tied(x) for x in tensors]


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


def jax_remat(f, n_tied):
    """`f` as a `jax.custom_vjp` whose backward pass recomputes it, from
    arguments tied to the incoming cotangents.

    The forward pass runs `f` and saves only its arguments (the segment's
    inputs and the values its variables are read from). The backward pass
    runs `jax.vjp(f, ...)` again on those arguments, the first `n_tied`
    (the segment's inputs) passed through `jax_tie`: values unchanged, but
    computed from the cotangents, so XLA can neither merge the recompute
    into the forward pass (CSE sees different operands) nor schedule it
    there (its operands exist only once the gradient does). `jax.checkpoint`
    has no such dependency: XLA's CPU pipeline drops its optimization
    barriers (`cse_barrier_expander`) and merges the recompute back into
    the forward pass, keeping every activation alive. The
    incoming cotangents are first computed into buffers of their own
    (`jax_materialize`), and in the forward pass the seed states are tied
    to the segment's inputs, so that XLA neither recomputes a cotangent in
    every fusion that reads it nor draws a segment's randomness early.

    Everything `f` differentiates must be an argument (`custom_vjp`
    refuses closed-over values being differentiated): the trainable values
    of the trainer's enclosing `StatelessScope` are. Integer arguments and
    outputs get float0 cotangents, as `jax.vjp` gives them.

    Args:
        f: a function of arrays returning a tuple of arrays.
        n_tied: how many leading arguments to tie (the segment's inputs);
            of the rest, those that are not floats are tied too (seed
            states), not the weights, which `jax_tie` would copy.

    Returns:
        A function with the signature and values of `f`.
    """
    import jax

    @jax.custom_vjp
    def remat(*args):
        return f(*args)

    def fwd(*args):
        return f(*_states_after_inputs(args, n_tied)), args

    def bwd(args, cotangents):
        cotangents = jax_materialize(cotangents)
        # The inputs, and every non-float argument (seed states: a random
        # draw computed from them alone would be merged with the forward
        # pass's and its mask kept until the backward pass; integer state).
        # Not the float ones (weights, moving statistics), which a tie
        # would copy.
        index = [i for i, x in enumerate(args) if i < n_tied or not _jax_floating(x)]
        recomputed, vjp = jax.vjp(f, *_tied(args, index, cotangents))
        # The gradients are tied to the recomputed outputs, so that these
        # stay live as in the forward pass: with them dead, XLA fuses the
        # recompute differently from the forward pass, and gradients come
        # out 1 ulp off (tests/test_exact_fit.py's chaotic chain).
        return tuple(jax_tie(vjp(cotangents), recomputed))

    remat.defvjp(fwd, bwd)
    return remat


def jax_materialize(arrays):
    """`arrays` (a tuple), bit for bit, each computed into a buffer of its own.

    XLA fuses cheap elementwise work into every consumer, and it need not
    compute a value once: a segment's incoming cotangent (the ReLU masks
    and residual adds of the segments after it) was recomputed inside the
    fusions that read it, so the buffers it is made of (their convolution
    gradients, masks) stayed alive across the backward passes of the
    segments before, until the last such fusion ran (docs/benchmarks.md,
    "The estimator against JAX").
    Operands of a `lax.cond` cannot be fused into anything inside it, so
    the arrays go through one whose predicate is true whatever they hold
    (`_true_of` the first, as for `jax_tie`'s select) and whose taken
    branch returns them unchanged. `lax.optimization_barrier` does not do this: XLA's CPU
    pipeline removes barriers before it fuses.

    On the CPU only, where it was measured. On a GPU the host reads a
    conditional's predicate, a synchronization per segment and step, and
    whether XLA's GPU fusion recomputes cotangents the same way is not
    known (no GPU to measure on): there the arrays are returned as they are.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    index = [i for i, x in enumerate(arrays) if _jax_floating(x) and x.size]
    if not index or jax.default_backend() != "cpu":
        return tuple(arrays)
    keep = _true_of([arrays[index[0]]])
    # The other branch is never taken; it only has to differ from the first,
    # so that the conditional cannot be folded away as two equal branches.
    taken = lax.cond(keep, lambda xs: xs, lambda xs: tuple(jnp.zeros_like(x) for x in xs),
                     tuple(arrays[i] for i in index))
    out = list(arrays)
    for i, x in zip(index, taken):
        out[i] = x
    return tuple(out)


def _states_after_inputs(args, n_inputs):
    """`args`, with the seed states (the arguments after the inputs that
    are not floats) tied to the inputs (the first `n_inputs`).

    Untied, a random draw depends on its seed alone, and XLA computes the
    threefry counters of every dropout of every segment at the start of
    the step and holds them until their segment runs (docs/benchmarks.md,
    "The estimator against JAX")."""
    states = [i for i, x in enumerate(args) if i >= n_inputs and not _jax_floating(x)]
    return _tied(args, states, args[:n_inputs])


def _tied(args, index, to):
    """`args`, those at `index` passed through `jax_tie(..., to)`."""
    out = list(args)
    for i, x in zip(index, jax_tie([args[i] for i in index], to)):
        out[i] = x
    return out


def _jax_floating(x):
    import jax.numpy as jnp

    return jnp.issubdtype(x.dtype, jnp.floating)


def _true_of(arrays):
    """A boolean scalar computed from `arrays` (floating, non-empty) that is
    true whatever they hold: `(u | 1) != 0`, `u` the bits of each array's
    first element, OR'ed. None when there are no arrays."""
    if not arrays:
        return None
    import jax.numpy as jnp
    from jax import lax

    u = None
    for a in arrays:
        bits = lax.bitcast_convert_type(jnp.reshape(a, (-1,))[0].astype("float32"), jnp.uint32)
        u = bits if u is None else u | bits
    return (u | 1) != 0


def jax_tie(arrays, cotangents):
    """`arrays`, with their values bit for bit, as results of the
    cotangents.

    Each array goes through `select(p, x, 0)`, where `p` is true whatever
    the cotangents hold: `(u | 1) != 0`, `u` the bits of the first element
    of every floating cotangent, OR'ed (every one, not only the first: a
    cotangent of an output nothing reads is a zero constant, and a tie on
    constants only would fold away). A select keeps every value as it is
    (-0.0, NaN, inf, integers), where `x + 0` would turn -0.0 into +0.0;
    and unlike a comparison of a value with itself (`p == p`), XLA's
    simplifier does not fold it (the tests check the compiled step).
    """
    if not arrays:
        return []  # nothing to tie: no bitcasts left for XLA to drop
    import jax
    import jax.numpy as jnp
    from jax import lax

    keep = _true_of([c for c in cotangents if _jax_floating(c) and c.size])
    if keep is None:
        return list(arrays)
    return [
        x if x.dtype == jax.dtypes.float0 else lax.select(jnp.broadcast_to(keep, x.shape), x, jnp.zeros_like(x))
        for x in arrays
    ]
