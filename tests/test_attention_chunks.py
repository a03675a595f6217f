"""Attention cores in chunks (`attention_chunks=`,
`graphckpt.runtime.attention`): the same outputs and dropout masks as the
layer, the same gradients (to rounding where a reduction's order follows
memory layout), each chunk really recomputed, and models that train like
the original on every backend."""

import json
import warnings

import keras
import numpy as np
import pytest
from keras import layers

import graphckpt
from graphckpt.graph.attention import chunkable_calls
from graphckpt.runtime.attention import ChunkedAttention, chunked
from tests.helpers import compare_step, to_numpy
from tests.test_opening import blocks_model

pytestmark = pytest.mark.backends

BACKEND = keras.backend.backend()
T, DIM = 24, 16


def _attention(dropout, seed=None):
    keras.utils.set_random_seed(1)
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, dropout=dropout, seed=seed)
    x = np.random.default_rng(0).standard_normal((2, T, DIM)).astype("float32")
    layer(x, x)
    return layer, x


def _call_and_grads(layer, weights, x, kwargs):
    """Output, and gradients of sum(output**2) wrt `x` and `weights`, in
    one training call, eagerly."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        xt = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch(xt)
            y = layer(xt, xt, training=True, **kwargs)
            loss = tf.reduce_sum(y * y)
        grads = tape.gradient(loss, [xt] + [w.value for w in weights])
    elif BACKEND == "jax":
        import jax

        values = [w.value for w in weights]
        others = [v.value for v in layer.non_trainable_variables]

        def f(values, xx):
            y, _ = layer.stateless_call(values, others, xx, xx, training=True, **kwargs)
            return (y * y).sum(), y

        (_, y), (g_w, g_x) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(values, x)
        grads = [g_x] + list(g_w)
    else:
        import torch

        xt = torch.tensor(x, requires_grad=True)
        y = layer(xt, xt, training=True, **kwargs)
        (y * y).sum().backward()
        grads = [xt.grad] + [w.value.grad for w in weights]
        for w in weights:
            w.value.grad = None
    return to_numpy(y), [to_numpy(g) for g in grads]


def _run(layer, x, chunks, kwargs):
    keras.utils.set_random_seed(7)  # the global torch generator, for unseeded dropout
    state = [to_numpy(v.value) for v in layer.variables]  # seed generator states too
    target = layer if chunks is None else chunked(layer, chunks)
    result = _call_and_grads(target, layer.trainable_variables, x, kwargs)
    for v, s in zip(layer.variables, state):
        v.assign(s)
    return result


MASKS = {
    "none": lambda: {},
    "causal": lambda: {"use_causal_mask": True},
    "padding": lambda: {"attention_mask": np.arange(T)[None, None, :] < np.array([T, T - 5])[:, None, None]},
}


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("dropout,seed", [(0.0, None), (0.3, None), (0.3, 5)])
def test_chunked_core_gives_the_layers_outputs_and_its_gradients_to_rounding(dropout, seed, mask):
    layer, x = _attention(dropout, seed)
    kwargs = MASKS[mask]()
    y0, g0 = _run(layer, x, None, kwargs)
    scale = max(np.abs(g).max() for g in g0)
    for chunks in (1, 2, 3):  # 3 > 2 heads: pieces of examples too
        y1, g1 = _run(layer, x, chunks, kwargs)
        if BACKEND == "jax" and dropout:  # XLA fuses the dropout's division differently
            np.testing.assert_allclose(y1, y0, atol=2e-6, rtol=0)
        else:  # each (example, head) pair: the same ops on the same values, dropout mask included
            np.testing.assert_array_equal(y1, y0)
        for a, b in zip(g1, g0):
            # Bias gradients sum the pieces' gradients in their memory order.
            np.testing.assert_allclose(a, b, atol=2e-6 * scale, rtol=0)
        if BACKEND != "tensorflow" and not dropout:  # oneDNN rounds per kernel choice
            for a, b in zip(g1, g0):
                np.testing.assert_array_equal(a, b)
    if dropout:  # the mask is applied: not what inference gives
        inference = to_numpy(chunked(layer, 5)(x, x, training=False, **kwargs))
        assert np.abs(inference - y1).max() > 1e-2


def test_one_chunk_keeps_the_gradients_bit_for_bit_where_the_backend_refuses_nothing():
    if BACKEND != "torch":
        pytest.skip("TensorFlow's oneDNN and XLA round per kernel choice; PyTorch's CPU kernels do not")
    layer, x = _attention(0.3, seed=5)
    _, g0 = _run(layer, x, None, {})
    _, g1 = _run(layer, x, 1, {})
    for a, b in zip(g1, g0):
        np.testing.assert_array_equal(a, b)


def test_each_chunk_is_recomputed_once_in_the_backward_pass():
    if BACKEND == "jax":
        pytest.skip("JAX traces each function once; counted on the eager backends")
    layer, x = _attention(0.3)
    calls = []
    original = layer._masked_softmax

    def counted(scores, mask=None):
        calls.append(tuple(scores.shape))
        return original(scores, mask)

    object.__setattr__(layer, "_masked_softmax", counted)
    try:
        _call_and_grads(chunked(layer, 4), layer.trainable_variables, x, {})
    finally:
        object.__delattr__(layer, "_masked_softmax")
    # 4 pieces, one (example, head) pair each: forward, then each recomputed once.
    assert calls == [(1, 1, T, T)] * 8
    assert "_compute_attention" not in layer.__dict__  # the layer's own core is back


def test_the_pieces_are_split_so_no_gradient_is_padded_to_the_whole():
    """The pieces' queries, keys and values come from splits: a slice's
    gradient would be zeros of the whole tensor's size with the piece's
    part in it, and TensorFlow held every piece's until their sum (at 32
    pieces of a (8, 1280, 4, 64) query, 3 x 32 of 10 MiB each)."""
    if BACKEND != "tensorflow":
        pytest.skip("counted in TensorFlow's gradient graph")
    import tensorflow as tf

    layer, x = _attention(0.3, seed=5)
    mask = MASKS["padding"]()["attention_mask"]

    def op_types(chunks):
        target = chunked(layer, chunks)

        @tf.function
        def step(xx):
            with tf.GradientTape() as tape:
                tape.watch(xx)
                y = target(xx, xx, attention_mask=mask, training=True)
            return tape.gradient(tf.reduce_sum(y * y), [xx] + layer.trainable_variables)

        graph = step.get_concrete_function(tf.constant(x)).graph.as_graph_def()
        nodes = list(graph.node) + [n for f in graph.library.function for n in f.node_def]
        return [n.op for n in nodes]

    types = op_types(4)  # 2 examples x 2 heads
    assert types.count("SplitV") >= 3 * 3  # q, k, v by examples, then each example's by heads
    assert "StridedSliceGrad" not in types
    assert "SplitV" not in op_types(1)  # one piece: nothing cut


def _transformer(rate=0.1, seq=32, dim=16, depth=2):
    keras.utils.set_random_seed(0)
    inp = keras.Input((seq, dim))
    x = layers.Dense(dim)(inp)
    for _ in range(depth):
        h = layers.LayerNormalization()(x)
        h = layers.MultiHeadAttention(2, dim // 2, dropout=rate)(h, h)
        x = layers.Add()([x, layers.Dropout(rate)(h)])
        x = layers.Add()([x, layers.Dense(dim)(layers.LayerNormalization()(x))])
    return keras.Model(inp, layers.Dense(3)(layers.GlobalAveragePooling1D()(x)))


def test_a_model_with_attention_chunks_trains_like_the_original():
    model = _transformer()
    ck = graphckpt.checkpoint_model(model, segments=2, batch_size=4, attention_chunks=4)
    assert ck.plan.attention_chunks == 4
    wrappers = [
        layer for seg in ck.layers for layer in getattr(seg, "_flatten_layers", lambda **k: [])(include_self=False)
        if isinstance(layer, ChunkedAttention)
    ]
    attention = [layer for layer in model.layers if isinstance(layer, layers.MultiHeadAttention)]
    assert sorted(id(w.attention) for w in wrappers) == sorted(id(a) for a in attention)
    assert all(any(v is w for w in model.weights) for v in ck.weights) and len(ck.weights) == len(model.weights)
    x = np.random.default_rng(0).standard_normal((4, 32, 16)).astype("float32")
    # TensorFlow eager and in a tf.function; JAX under jit, as its trainer runs; PyTorch eager.
    for compiled in {"tensorflow": (False, True), "jax": (True,), "torch": (False,)}[BACKEND]:
        compare_step(model, ck, x, compiled=compiled, atol=1e-6, rtol=1e-5)


def test_the_estimate_counts_no_score_sized_buffer_and_the_baseline_stays_the_originals():
    # No attention dropout: its mask is drawn for the whole score tensor at once (counted too, below).
    model = _transformer(rate=0.0, seq=256, dim=32, depth=2)
    whole = graphckpt.plan(model, batch_size=4)
    in_chunks = graphckpt.plan(model, batch_size=4, attention_chunks=8)
    assert in_chunks.baseline_peak_bytes == whole.baseline_peak_bytes
    scores = 4 * 2 * 256 * 256 * 4  # one float32 score tensor: batch x heads x T x S
    assert in_chunks.estimated_peak_bytes < whole.estimated_peak_bytes - scores
    chunked_estimate = graphckpt.estimate(model, in_chunks, batch_size=4)
    assert chunked_estimate.peak_bytes == in_chunks.estimated_peak_bytes
    with_dropout = graphckpt.plan(_transformer(rate=0.1, seq=256, dim=32, depth=2), batch_size=4, attention_chunks=8)
    if BACKEND != "torch":  # each piece draws its part of the mask: nothing score-sized
        assert with_dropout.estimated_peak_bytes < whole.estimated_peak_bytes - scores
    else:  # the mask drawn whole (about 16 bytes a score, while drawn)
        assert with_dropout.estimated_peak_bytes >= in_chunks.estimated_peak_bytes + scores


def test_user_blocks_open_around_whole_attention_in_chunks():
    model = blocks_model(n=2, seq=16)
    ck = graphckpt.checkpoint_model(model, batch_size=2, open_layers=True, attention_chunks=3)
    graph = graphckpt.api.planned(model, batch_size=2, open_layers=True, attention_chunks=3).graph
    kinds = [type(graph.nodes[k]["layer"]).__name__ for k in chunkable_calls(graph)]
    assert kinds == ["MultiHeadAttention", "MultiHeadAttention"]
    assert ck.plan.open_layers and ck.plan.kept_closed == ()
    x = np.random.default_rng(0).standard_normal((2, 16, 16)).astype("float32")
    compare_step(model, ck, x, atol=1e-6, rtol=1e-5)


def test_saving_keeps_the_chunks(tmp_path):
    model = _transformer()
    ck = graphckpt.checkpoint_model(model, segments=2, batch_size=4, attention_chunks=4)
    path = str(tmp_path / "ck.keras")
    ck.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.plan.attention_chunks == 4
    x = np.random.default_rng(0).standard_normal((4, 32, 16)).astype("float32")
    np.testing.assert_allclose(to_numpy(loaded(x)), to_numpy(model(x)), atol=1e-6)


@pytest.mark.parametrize("bad", [0, -2, True, 2.5, "8"])
def test_a_bad_chunk_count_is_one_clear_error(bad):
    with pytest.raises(graphckpt.InvalidArgumentError, match="attention_chunks"):
        graphckpt.plan(_transformer(), attention_chunks=bad)


def test_a_model_without_attention_warns_and_plans_as_without_chunks():
    keras.utils.set_random_seed(0)
    inp = keras.Input((8,))
    x = inp
    for _ in range(4):
        x = layers.Dense(8, activation="relu")(x)
    model = keras.Model(inp, x)
    with pytest.warns(graphckpt.GraphckptWarning, match="no MultiHeadAttention"):
        p = graphckpt.plan(model, attention_chunks=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert p == graphckpt.plan(model)


def test_the_fit_flag_takes_attention_chunks_and_trains_as_plain_fit():
    x = np.random.default_rng(0).standard_normal((16, 32, 16)).astype("float32")
    y = np.random.default_rng(1).standard_normal((16, 3)).astype("float32")
    histories, weights = [], []
    for chunks in (None, 4):
        model = _transformer()
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        keras.utils.set_random_seed(3)
        if chunks is None:
            history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        else:
            history = graphckpt.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, attention_chunks=chunks)
        histories.append(history.history["loss"])
        weights.append([to_numpy(w) for w in model.weights])
    np.testing.assert_allclose(histories[1], histories[0], rtol=1e-5)
    for a, b in zip(weights[1], weights[0]):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_attention_chunks_without_checkpointing_is_one_clear_error():
    model = _transformer()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(graphckpt.InvalidArgumentError, match="attention_chunks` needs gradient checkpointing"):
        graphckpt.fit(model, np.zeros((2, 32, 16)), np.zeros((2, 3)), gradient_checkpointing=False, attention_chunks=4)


def test_inspect_plans_with_attention_chunks(tmp_path, capsys):
    from graphckpt import cli

    path = tmp_path / "transformer.keras"
    _transformer(rate=0.0, seq=128).save(path)
    totals = []
    for extra in ([], ["--attention-chunks", "4"]):
        assert cli.main(["inspect", str(path), "--batch-size", "4", "--format", "json", *extra]) == 0
        info = json.loads(capsys.readouterr().out)
        totals.append(info["totals"])
    assert info["attention_chunks"] == 4
    assert totals[1]["baseline_bytes"] == totals[0]["baseline_bytes"]
    assert totals[1]["plan_bytes"] < totals[0]["plan_bytes"]
    assert cli.main(["inspect", str(path), "--batch-size", "4", "--attention-chunks", "4"]) == 0
    assert "attention in 4 chunks" in " ".join(capsys.readouterr().out.split())  # the title wraps at 80 columns


def test_jax_draws_a_piece_of_the_mask_as_the_whole_draw_has_it():
    if BACKEND != "jax":
        pytest.skip("threefry over flat indices: JAX's draw")
    import jax
    import jax.numpy as jnp

    from graphckpt import keras_compat_attention as compat

    key = jnp.array([12345, 6789], jnp.uint32)
    assert compat.jax_draws_by_index(key)
    whole = np.asarray(jax.random.bernoulli(key, p=0.9, shape=(3, 5, 16, 24))).reshape(-1)
    for start, n in [(0, 384), (384, 768), (4 * 384, 6 * 384), (14 * 384, 384)]:
        run = jax.jit(compat.jax_bernoulli_run, static_argnums=(1, 2, 3))(key, start, n, 0.9)
        np.testing.assert_array_equal(np.asarray(run), whole[start : start + n])


def test_tensorflow_draws_a_piece_of_the_mask_as_the_whole_draw_has_it():
    if BACKEND != "tensorflow":
        pytest.skip("Philox counters with an offset: TensorFlow's draw only")
    import tensorflow as tf

    from graphckpt import keras_compat_attention as compat

    seed = tf.constant([7, 11], tf.int32)
    whole = tf.reshape(tf.random.stateless_uniform([3, 5, 16, 24], seed=seed), [-1]).numpy()
    state = compat.tf_key_counter_alg(seed)
    for start, n in [(0, 384), (384, 768), (4 * 384, 6 * 384), (14 * 384, 384)]:
        run = compat.tf_uniform_run(*state, start, n, "float32").numpy()
        np.testing.assert_array_equal(run, whole[start : start + n])
    assert not np.array_equal(compat.tf_uniform_run(*state, 4, 384, "float32").numpy(), whole[:384])


def test_mixed_precision_keeps_the_layers_outputs_and_masks():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        layer, x = _attention(0.3)
        y0, g0 = _run(layer, x, None, {})
        y1, g1 = _run(layer, x, 2, {})
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert y1.dtype == y0.dtype == np.float16
    if BACKEND == "tensorflow":  # the same float16 ops on each piece
        np.testing.assert_array_equal(y1, y0)
    else:  # float16 matmuls of another shape: an ulp of float16 at most; a wrong mask is far more
        np.testing.assert_allclose(y1.astype("float32"), y0.astype("float32"), atol=2e-3, rtol=0)
    scale = max(np.abs(g.astype("float32")).max() for g in g0)
    for a, b in zip(g1, g0):
        np.testing.assert_allclose(a.astype("float32"), b.astype("float32"), atol=1e-2 * scale, rtol=0)


def test_a_gpt2_causal_lm_with_its_attention_in_pieces_trains_as_plain_fit(installed):
    """keras_hub's `CachedMultiHeadAttention` (causal and padding masks,
    attention dropout), called through its own signature, in pieces."""
    keras_hub = pytest.importorskip("keras_hub", exc_type=ImportError)
    import tensorflow as tf

    from tests.test_opening import _tokens, gpt2_fits_alike

    data = tf.data.Dataset.from_tensor_slices(_tokens(8)).batch(4, drop_remainder=True)
    flag = {"gradient_checkpointing": True, "open_layers": True, "attention_chunks": 3}
    model = gpt2_fits_alike(keras_hub, data, flag)
    from graphckpt.training.flag import _CACHE_ATTR

    ((_, plan),) = model.__dict__[_CACHE_ATTR].plans.values()
    assert plan.attention_chunks == 3
