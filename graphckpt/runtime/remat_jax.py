"""Rematerialization on JAX: a `jax.custom_vjp` whose backward pass
recomputes a segment from arguments tied to the incoming cotangents, and
the helpers that keep XLA from moving or fusing that recompute away, and
the value helpers a segment uses on JAX (`snapshot`, `components`).
`graphckpt.runtime.remat` says what goes in and comes out."""

__all__ = ["jax_remat", "jax_tie", "jax_materialize", "snapshot", "components"]


def snapshot(value):
    """A variable's `value` as it is now: JAX arrays are immutable."""
    return value


def components(x):
    """A `BCOO`'s (any `JAXSparse`'s) leaves and a function that builds it
    again from new ones; None for a dense array."""
    import jax
    from jax.experimental import sparse

    if not isinstance(x, sparse.JAXSparse):
        return None
    leaves, treedef = jax.tree_util.tree_flatten(x)
    return leaves, lambda parts: jax.tree_util.tree_unflatten(treedef, parts)


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
