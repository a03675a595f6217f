"""Attention in chunks: the scores of one chunk at a time.

One `MultiHeadAttention` call over T queries and S keys holds score-sized
tensors (heads x T x S per example: the softmax output, its dropout mask
and output, and their gradients in the backward pass). A cut between layer
calls cannot go inside one call, so at long sequences they bound the peak
of any plan. `ChunkedAttention(attention, chunks)` calls the layer as it
is, except for its attention core (`MultiHeadAttention._compute_attention`):
its (example, head) pairs are cut into `chunks` pieces (heads first, then
examples; `_pieces`), and each piece's core (scores, softmax, dropout, the
weighted sum of the values) is rematerialized on its own. The forward pass
keeps no score-sized tensor; the backward pass recomputes one piece's at a
time. It is the attention-core recompute of Korthikanti et al. (2022), in
pieces as Rabe & Staats (2021) take queries.

Pieces of whole attention matrices, not of queries: every output and every
gradient of a (example, head) pair is computed by the same ops on the same
values as in the layer, sums over queries included. So outputs are equal
bit for bit, and gradients too, but where a later reduction (a projection's
bias gradient on PyTorch) sums in the memory order of the pieces' gradients
(equal to rounding). There are at most batch x heads pieces (heads only
where the batch size is not known).

Dropout: the mask is the one the layer's own Dropout layer draws (the same
seed draw, in the same order), applied per piece with the backend's own
arithmetic (`_apply_dropout`). On TensorFlow and JAX each piece draws its
own part of it, inside its recompute, from the random generator's
counters at that part's place in the whole draw (`_DrawnPerPiece`): no
mask is kept. On PyTorch (a sequential generator) it is drawn whole and
kept as booleans (`_Kept`: a quarter of one float32 score tensor). Masks
(padding, causal, explicit) are cut with the pieces.

Not chunked (the layer's own core runs): `return_attention_scores=True`,
attention over more than one axis, an unknown number of queries, flash
attention.

References:
    Korthikanti et al. "Reducing Activation Recomputation in Large
    Transformer Models", 2022 (selective recompute of the attention core).

    Rabe, Staats. "Self-attention Does Not Need O(n^2) Memory", 2021
    (attention in chunks, each checkpointed).
"""

import functools
import inspect

import keras
from keras import ops

from graphckpt import keras_compat
from graphckpt import keras_compat_attention as compat
from graphckpt.graph.attention import chunkable_attention
from graphckpt.runtime.remat import segment_remat

__all__ = ["ChunkedAttention", "chunked"]

_CACHE_ATTR = "_graphckpt_chunked"  # on the attention layer: its `_Wrappers`


def chunked(layer, chunks):
    """The `ChunkedAttention` of `layer` (`chunkable_attention`) for
    `chunks`, made once per layer and chunk count, so every rewrite of a
    model calls the same object."""
    if not chunkable_attention(layer):
        raise TypeError(f"Layer '{layer.name}' ({type(layer).__name__}) has no attention core to run in chunks.")
    cache = layer.__dict__.get(_CACHE_ATTR)
    if cache is None:
        cache = _Wrappers()
        object.__setattr__(layer, _CACHE_ATTR, cache)
    if chunks not in cache.by_chunks:
        cache.by_chunks[chunks] = _wrapper_class(type(layer))(layer, chunks)
    return cache.by_chunks[chunks]


class _Wrappers:
    """A layer's `ChunkedAttention`s by chunk count. A plain object, so
    Keras neither tracks them as sublayers nor walks them when saving (a
    dict would be walked, into a cycle back to the layer)."""

    def __init__(self):
        self.by_chunks = {}


def _wrapper_class(attention_class):
    """A `ChunkedAttention` subclass whose `call` has the signature of
    `attention_class.call`, so Keras passes it each argument as the layer
    itself gets it (masks, `training`, keras_hub's cache arguments)."""

    def call(self, *args, **kwargs):
        with _core_in_chunks(self.attention, self.chunks):
            return self.attention(*args, **kwargs)

    call.__signature__ = inspect.signature(attention_class.call)
    return type(f"Chunked{attention_class.__name__}", (ChunkedAttention,), {"call": call})


class ChunkedAttention(keras.layers.Layer):
    """Calls `attention` with its attention core run in `chunks` pieces,
    each recomputed in the backward pass (module docstring). Its
    variables are `attention`'s (`is`-identical); it has none of its own.
    Internal to checkpointed models: the plan records `attention_chunks`,
    and saving writes the source model, whose rewrite makes it again."""

    def __init__(self, attention, chunks, **kwargs):
        kwargs.setdefault("name", attention.name)
        # The inputs reach `attention` as they come: its own call casts them.
        super().__init__(autocast=False, dtype=attention.dtype_policy, **kwargs)
        self.attention = attention
        self.chunks = int(chunks)
        self.supports_masking = attention.supports_masking
        self.built = True

    def compute_output_spec(self, *args, **kwargs):
        return self.attention.compute_output_spec(*args, **kwargs)

    def compute_mask(self, *args, **kwargs):
        return self.attention.compute_mask(*args, **kwargs)


def _core_in_chunks(attention, chunks):
    """A context: `attention`'s core runs in chunks for the calls inside."""

    def compute(original, query, key, value, attention_mask=None, training=None, return_attention_scores=False,
                use_causal_mask=False):
        parts = compat.parts(attention)  # read here: the layer's first call builds them
        whole = return_attention_scores or len(query.shape) != 4 or parts.axes != (1,) or query.shape[1] is None
        if whole or parts.flash:
            extra = {"use_causal_mask": True} if use_causal_mask else {}
            return original(query, key, value, attention_mask, training, return_attention_scores, **extra)
        return _chunked_core(parts, chunks, query, key, value, attention_mask, training, use_causal_mask), None

    return compat.core_replaced(attention, compute)


def _chunked_core(parts, chunks, query, key, value, mask, training, causal):
    """`MultiHeadAttention._compute_attention`'s output, chunk by chunk of
    (example, head) pairs (`_pieces`): its two paths (explicit scores when
    the layer has dropout, else `ops.dot_product_attention`) with their
    masks. `parts`: the layer's (`keras_compat_attention.parts`)."""
    scores_path = parts.dropout_rate > 0.0
    if causal and scores_path:  # as the layer's scores path builds it; its fused path takes is_causal
        mask = parts.causal_mask(query, value)
    if mask is not None and not scores_path:  # as the fused path shapes it: [B, N, T, S]
        for _ in range(4 - len(mask.shape)):
            mask = ops.expand_dims(mask, axis=-len(parts.axes) * 2 - 1)
        mask = ops.cast(mask, "bool")
    keep = _dropout_keep(parts.dropout, query, key) if scores_path and training else None

    def core(b, h, q, k, v, whole_mask, *keep_args):
        # The piece's mask is cut here, in its forward pass and again in its
        # recompute: cut outside, every piece's would be kept until its
        # backward step, the heads of one example each holding a copy of it.
        mask_c = None if whole_mask is None else _piece_of_mask(whole_mask, b, h)
        if not scores_path:
            return ops.dot_product_attention(
                query=q, key=k, value=v, bias=None, mask=mask_c, scale=parts.scale, is_causal=causal,
                flash_attention=parts.flash,
            )
        q = ops.multiply(q, ops.cast(parts.scale, q.dtype))
        scores = ops.einsum(parts.scores_equation, k, q)
        scores = parts.masked_softmax(scores, mask_c)
        if keep is not None:
            scores = _apply_dropout(parts.dropout, scores, keep.inside(keep_args, b, h))
        return ops.einsum(parts.combine_equation, scores, v)

    rows, after = [], []
    pieces = _pieces(query.shape[0], query.shape[2], chunks)
    by_examples = [_split(x, [b for b, _ in pieces], axis=0) for x in (query, key, value)]
    for i, b in enumerate(pieces):
        row = []
        by_heads = [_split(x[i], b[1], axis=2) for x in by_examples]
        for j, h in enumerate(b[1]):
            qkv = [x[j] for x in by_heads]
            if keras.backend.backend() == "jax" and (row or rows):  # XLA would run the pieces side by side
                qkv = _jax_after(qkv, row[-1] if row else rows[-1])
            keep_args = [] if keep is None else keep.outside(b[0], h)
            row.append(_remat(functools.partial(core, b[0], h), qkv, [mask, *keep_args], after))
        rows.append(row[0] if len(row) == 1 else ops.concatenate(row, axis=2))
    return rows[0] if len(rows) == 1 else ops.concatenate(rows, axis=0)


def _jax_after(tensors, previous):
    """`tensors`, their values unchanged, computed after `previous` (the
    last piece's output): so the forward pass runs one piece at a time."""
    from graphckpt.runtime.remat_jax import jax_tie

    return jax_tie(tensors, [previous])


def _ranges(n, k):
    """`k` (at most `n`) slices that cut range(n) into near-equal runs."""
    k = max(1, min(k, n))
    return [slice(n * i // k, n * (i + 1) // k) for i in range(k)]


def _pieces(batch, heads, chunks):
    """`[(batch slice, [head slices])]`: `chunks` pieces of the (example,
    head) pairs, heads first, then examples where the batch size is known;
    at most batch x heads pieces, each a block of whole attention matrices."""
    if chunks <= heads or batch is None:
        return [(slice(None), _ranges(heads, chunks))]
    per_head = [slice(h, h + 1) for h in range(heads)]
    return [(b, per_head) for b in _ranges(batch, -(-chunks // heads))]


def _split(x, slices, axis):
    """`x` cut along `axis` into the consecutive `slices`, by one split,
    not a slice each: a slice's gradient is a zero-padded tensor of `x`'s
    full size, and TensorFlow held every piece's until their sum (at 32
    pieces, 3 x 32 query-sized tensors); a split's is one concatenation."""
    if len(slices) == 1:
        return [x[(slice(None),) * axis + (slices[0],)]]
    return ops.split(x, [sl.indices(x.shape[axis])[0] for sl in slices[1:]], axis=axis)


def _piece_of_mask(mask, b, h):
    """The mask of one piece: a [B, T, S] mask (scores path) or a
    [B, N, T, S] one (fused path), each axis of size 1 left whole."""
    if mask.shape[0] != 1:
        mask = mask[b]
    if len(mask.shape) == 4 and mask.shape[1] != 1:
        mask = mask[:, h]
    return mask


class _Kept:
    """A dropout mask drawn whole and kept as booleans: each piece's part
    is sliced from it (`outside`) and passed to the piece."""

    def __init__(self, keep):
        self.keep = keep

    def outside(self, b, h):
        return [self.keep[b, h]]

    def inside(self, args, b, h):
        return args[0]


class _DrawnPerPiece:
    """Each piece draws its own part of the mask, inside its recompute: the
    elements of the whole draw where that part lies (`_runs`), from the
    random generator's counters offset to them, so the same values
    (TensorFlow's Philox: `keras_compat_attention.tf_uniform_run`; JAX's
    threefry: `jax_bernoulli_run`), and no mask is kept."""

    def __init__(self, state, shape, keep):
        self.state, self.shape, self.keep = list(state), shape, keep

    def outside(self, b, h):
        return list(self.state)

    def inside(self, args, b, h):
        batch, heads, t, s = self.shape
        (b0, b1, _), (h0, h1, _) = b.indices(batch), h.indices(heads)
        parts = [self.keep(args, start, n) for start, n in _runs(self.shape, b, h)]
        flat = parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=0)
        return ops.reshape(flat, (b1 - b0, h1 - h0, t, s))


def _runs(shape, b, h):
    """`(start, length)` of the runs of the flattened [B, N, T, S] draw that
    the examples `b` and heads `h` take, in order."""
    batch, heads, t, s = shape
    (b0, b1, _), (h0, h1, _) = b.indices(batch), h.indices(heads)
    if (h0, h1) == (0, heads):  # whole examples: one run
        return [(b0 * heads * t * s, (b1 - b0) * heads * t * s)]
    return [((e * heads + h0) * t * s, (h1 - h0) * t * s) for e in range(b0, b1)]


def _dropout_keep(dropout, query, key):
    """Which score entries the layer's dropout keeps: the draw
    `keras.random.dropout` makes for the scores (Keras 3.15: one seed from
    the Dropout layer's seed generator, the scores' shape and dtype),
    without the float tensors a whole dropout call would also make; on
    TensorFlow and JAX drawn piece by piece where the shape allows
    (`_DrawnPerPiece`), else whole and kept as booleans (`_Kept`)."""
    shape = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    static = all(d is not None for d in shape)
    if not static:  # a symbolic batch: its run-time size
        shape = (ops.shape(query)[0], query.shape[2], query.shape[1], key.shape[1])
    dtype, rate = dropout.compute_dtype, dropout.rate
    backend = keras.backend.backend()
    # The seed is tied to the queries: a draw that depends on the seed alone
    # runs at the start of the step, and its mask stays alive until used.
    if backend == "tensorflow":  # tf.nn.experimental.stateless_dropout
        import tensorflow as tf

        from graphckpt.runtime.remat_tensorflow import tf_tie

        seed = tf_tie([compat.tf_cast_seed(compat.draw_seed(dropout.seed_generator))], [query])[0]
        if static and dtype == "float32" and shape[2] * shape[3] % 4 == 0:  # 4 floats a Philox counter
            return _DrawnPerPiece(
                compat.tf_key_counter_alg(seed), shape,
                lambda state, start, n: compat.tf_uniform_run(*state, start, n, dtype) >= rate,
            )
        return _Kept(tf.random.stateless_uniform(shape, seed=seed, dtype=dtype) >= rate)
    if backend == "jax":
        import jax

        from graphckpt.runtime.remat_jax import jax_tie

        seed = jax_tie([compat.draw_seed(dropout.seed_generator)], [query])[0]
        if static and compat.jax_draws_by_index(seed):
            return _DrawnPerPiece(
                [seed], shape, lambda state, start, n: compat.jax_bernoulli_run(state[0], start, n, 1.0 - rate)
            )
        return _Kept(jax.random.bernoulli(seed, p=1.0 - rate, shape=shape))
    import torch

    if compat.native_torch_dropout(dropout):  # torch's own dropout: bernoulli_ on an empty input-like tensor
        return _Kept(torch.empty(shape, dtype=getattr(torch, dtype)).bernoulli_(1.0 - rate) != 0)
    full = torch.full(shape, 1.0 - rate)
    return _Kept(torch.bernoulli(full, generator=compat.torch_seed_generator(dropout.seed_generator)).bool())


def _apply_dropout(dropout, x, keep):
    """`dropout(x, training=True)` for the mask `keep`, with the arithmetic
    of the backend's `keras.random.dropout` (Keras 3.15), so the values are
    equal bit for bit."""
    x = ops.cast(x, dropout.compute_dtype)
    rate = dropout.rate
    backend = keras.backend.backend()
    if backend == "tensorflow":  # tf.nn.experimental.stateless_dropout
        import tensorflow as tf

        return tf.where(keep, x * tf.constant(1 / (1 - rate), x.dtype), tf.zeros([], x.dtype))
    if backend == "torch":
        import torch

        if compat.native_torch_dropout(dropout):  # torch's own dropout: x * (mask / p)
            return x * keep.to(x.dtype).div_(1.0 - rate)
        return torch.where(keep, x / (1.0 - rate), torch.zeros_like(x))
    import jax

    return jax.lax.select(keep, x / (1.0 - rate), jax.numpy.zeros_like(x))


def _remat(fn, tensors, extras, after):
    """`fn(*tensors, *extras)` rematerialized: the forward pass keeps only
    the arguments; `extras` (the piece's mask and its dropout's mask or
    random state, or None) get no gradient.

    The chunks' backward steps are independent of one another, and a
    scheduler may run them all at once, every chunk's scores alive
    together (TensorFlow's executor did; XLA did on JAX). So each
    recompute is tied to the gradients of the chunk whose backward step
    ran before it (`after`, a list the chunks of one call share): a data
    dependency (`tf_tie`, `jax_tie`) that XLA keeps. PyTorch's autograd
    runs one backward step at a time anyway."""
    backend = keras.backend.backend()
    if backend == "tensorflow":
        return _tf_remat_after(fn, tensors, extras, after)
    n = len(tensors)
    present = [i for i, e in enumerate(extras) if e is not None]

    def passed(*args):
        full = list(extras)
        for i, e in zip(present, args[n:]):
            full[i] = e
        return fn(*args[:n], *full)

    args = [*tensors, *[extras[i] for i in present]]
    if backend == "jax":
        return _jax_remat_after(passed, args, n, after)
    return segment_remat(lambda *a: (passed(*a),), n)(*args)[0]


def _jax_remat_after(f, args, n, after):
    """On JAX: `f(*args)` as a `custom_vjp` whose backward pass recomputes
    it from arguments tied to the incoming cotangent and to `after`, as
    `graphckpt.runtime.remat_jax.jax_remat` does for a segment."""
    import jax

    from graphckpt.runtime.remat_jax import jax_materialize, jax_tie

    @jax.custom_vjp
    def remat(*args):
        return f(*args)

    def fwd(*args):
        return f(*args), args

    def bwd(args, dout):
        (dout,) = jax_materialize((dout,))
        recomputed, vjp = jax.vjp(f, *jax_tie(list(args), [dout] + after))
        grads = vjp(dout)
        after[:] = [g for g in grads[:n]]
        return tuple(jax_tie(list(grads), [recomputed]))

    remat.defvjp(fwd, bwd)
    return remat(*args)


def _tf_remat_after(fn, tensors, extras, after):
    import tensorflow as tf

    from graphckpt.runtime.remat_tensorflow import tf_tie, tf_tie_closed

    _, record = keras_compat.tf_eager_internals()

    @tf.custom_gradient
    def remat(*args):
        with record.stop_recording():
            out = fn(*args, *extras)

        def grad(dout):
            # The extras by `tf_tie_closed`: a whole attention mask is
            # ordered, not copied.
            tied = tf_tie(list(args), [dout] + after) + tf_tie_closed(list(extras), [dout] + after)
            with tf.GradientTape() as tape:
                tape.watch(tied[: len(args)])
                again = fn(*tied)
            grads = tape.gradient(again, tied[: len(args)], output_gradients=dout)
            grads = [tf.zeros_like(x) if g is None else g for x, g in zip(args, grads)]
            after[:] = grads
            return grads

        return out, grad

    return remat(*tensors)
