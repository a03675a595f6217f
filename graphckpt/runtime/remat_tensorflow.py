"""Rematerialization on TensorFlow: a custom gradient that recomputes a
segment from the forward pass's own values, with the recompute ordered
after the incoming gradients (`tf_tie`), and the value helpers a segment
uses on TensorFlow (`snapshot`, `components`). `graphckpt.runtime.remat`
says what goes in and comes out."""

from graphckpt import keras_compat

__all__ = ["tf_remat", "tf_tie", "tf_tie_closed", "tf_after", "snapshot", "components"]


def snapshot(value):
    """A copy of a variable's `value` that later assignments cannot change."""
    import tensorflow as tf

    return tf.identity(value)


def components(x):
    """A `SparseTensor`'s or `RaggedTensor`'s component tensors and a
    function that builds it again from new ones; None for a dense tensor."""
    import tensorflow as tf

    if not isinstance(x, (tf.SparseTensor, tf.RaggedTensor)):
        return None
    return tf.nest.flatten(x, expand_composites=True), (
        lambda parts: tf.nest.pack_sequence_as(x, parts, expand_composites=True)
    )


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
    (`tf_tie_closed`): a recompute's random masks come from a closed-over seed
    snapshot and a causal mask from a closed-over integer input, and no op
    of the recompute, these included, runs before the incoming gradient
    exists (docs/benchmarks.md, "Nested models and keras_hub"). In the
    forward pass the same `tie` orders them after the segment's inputs
    (`tf_after`), so no segment's ops run before the segments ahead of it.
    Ops `f` makes from no input at all (keras_hub's causal mask: a range
    broadcast to batch x seq x seq) are ordered by a control dependency on
    the same values, the segment's inputs forward and the incoming
    gradients in the recompute: each is otherwise ready when the step
    starts, and every segment's ran then and was held.

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
            if context.executing_eagerly():
                result = f(*args)
            else:
                # Nor does the forward pass start before the segment's
                # inputs exist: what it closes over (`tf_after`), and the
                # ops it makes from nothing (a causal mask's range).
                with tf.control_dependencies([x for x in args[:n_inputs] if isinstance(x, tf.Tensor)]):
                    result = f(*args, tie=lambda tensors: tf_after(tensors, args[:n_inputs]))

        def grad(*dresult, variables=None):
            with tf.GradientTape() as tape:
                inputs = [tf.identity(x) for x in args[:n_inputs]]
                tie, after = {}, []
                if not context.executing_eagerly():
                    # As tf.recompute_grad: recompute once dresult exists,
                    # a data dependency, tied as on JAX: a select on the
                    # gradients' bits, which XLA cannot fold (`tf_tie`).
                    inputs = tf_tie(inputs, dresult)
                    tie = {"tie": lambda tensors: tf_tie_closed(tensors, dresult)}
                    after = [g for g in dresult if isinstance(g, tf.Tensor)]
                id_args = inputs + list(args[n_inputs:])
                tape.watch(id_args)
                if variables:
                    tape.watch(variables)
                with tf.control_dependencies(after):
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


def tf_tie_closed(tensors, gradients):
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
    ordered = sorted(set(dense) - set(selected))
    for i, x in zip(ordered, tf_after([tensors[i] for i in ordered], gradients)):
        out[i] = x
    return out


def tf_after(tensors, inputs):
    """`tensors`, the dense ones ordered after `inputs` by a control
    dependency (no copy).

    In the forward pass, what a segment closes over (its integer inputs,
    seed states, frozen weights) would otherwise be ready when the step
    starts, and TensorFlow's executor runs what is ready: keras_hub's
    opened decoders make each block's causal mask (batch x seq x seq int32)
    from the padding-mask input alone, and every block's ran first and was
    held until its block (10 of 50 MiB each at sequence 1280)."""
    import tensorflow as tf

    inputs = [x for x in inputs if x is not None]
    dense = [i for i, x in enumerate(tensors) if isinstance(x, tf.Tensor)]
    if not inputs or not dense:
        return list(tensors)
    out = list(tensors)
    with tf.control_dependencies(inputs):
        for i in dense:
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
