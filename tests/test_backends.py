"""The correctness suite, backend-agnostic: it runs under whichever backend
KERAS_BACKEND selects (CI runs it under tensorflow, jax and torch, in
separate processes).

Gradients are computed the way each backend does (tests/helpers.py):
a GradientTape on TensorFlow, `jax.value_and_grad` over `stateless_call` on
JAX, `torch.autograd` on PyTorch.
"""

import keras
import numpy as np
import pytest
from keras import layers, ops

import graphckpt
from graphckpt.runtime.segment import Segment
from tests import models
from tests.helpers import BACKEND, compare_step, jax_loss_fn, state_of, to_numpy

pytestmark = pytest.mark.backends

# Compiled steps: tf.function on TensorFlow, jax.jit on JAX; PyTorch runs eagerly.
# JAX's un-jitted grad dispatches op by op and is slow on the CPU; the JAX
# trainer always jits, so that is the mode tested there.
MODES = pytest.mark.parametrize(
    "compiled",
    {"tensorflow": [False, True], "jax": [True], "torch": [False]}[BACKEND],
    ids=lambda c: "compiled" if c else "eager",
)


@MODES
@pytest.mark.parametrize("name", sorted(models.ALL))
def test_same_outputs_gradients_and_state(name, compiled):
    model = models.ALL[name]()
    ck = graphckpt.checkpoint_model(model)
    x = models.sample_inputs(model)
    for a, b in zip(keras.tree.flatten(model(x)), keras.tree.flatten(ck(x))):
        np.testing.assert_allclose(to_numpy(b), to_numpy(a), atol=1e-5)
    compare_step(model, ck, x, compiled=compiled)


def _random_chain(noise_layer):
    inp = keras.Input((6, 6, 4))
    x = inp
    for _ in range(4):
        x = layers.Conv2D(4, 3, padding="same", activation="tanh")(x)
        x = noise_layer()(x)
    return keras.Model(inp, layers.Dense(2)(layers.Flatten()(x)))


# Seeded and unseeded: on PyTorch an unseeded Dropout draws from torch's
# global generator, a seeded one from Keras's seed state.
RANDOM_LAYERS = {
    "Dropout": lambda: layers.Dropout(0.5),
    "Dropout-seeded": lambda: layers.Dropout(0.5, seed=3),
    "GaussianNoise": lambda: layers.GaussianNoise(0.7),
    "GaussianDropout": lambda: layers.GaussianDropout(0.5),
    "SpatialDropout2D": lambda: layers.SpatialDropout2D(0.5),
    "AlphaDropout": lambda: layers.AlphaDropout(0.5),
}


@MODES
@pytest.mark.parametrize("kind", sorted(RANDOM_LAYERS))
def test_random_layers_draw_the_same_masks_on_recompute(kind, compiled):
    model = _random_chain(RANDOM_LAYERS[kind])
    ck = graphckpt.checkpoint_model(model, segments=2)
    x = np.random.default_rng(0).normal(size=(3, 6, 6, 4)).astype("float32")
    compare_step(model, ck, x, compiled=compiled)


def _naive(model, input_shape):
    """The model called through plain `keras.remat`, with no snapshot."""
    inp = keras.Input(input_shape)

    class NaiveRemat(layers.Layer):
        def __init__(self):
            super().__init__()
            self.inner = model  # tracked, so its variables are the model's

        def call(self, x, training=None):
            return keras.remat(lambda t: self.inner(t, training=training))(x)

    return keras.Model(inp, NaiveRemat()(inp))


def test_naive_remat_would_be_wrong():
    """Guard for the tests above: without graphckpt's snapshot, plain remat
    of a seeded random layer is wrong on every backend, so the exactness
    tests can fail. On TensorFlow and PyTorch the recompute draws a new mask
    and the gradients differ; on JAX the seed-state update made inside
    `jax.checkpoint` leaks a tracer out of it."""
    model = _random_chain(RANDOM_LAYERS["GaussianNoise"])
    naive = _naive(model, (6, 6, 4))
    x = np.random.default_rng(0).normal(size=(3, 6, 6, 4)).astype("float32")
    if BACKEND == "jax":
        import jax

        leaked = (jax.errors.UnexpectedTracerError, jax.errors.TracerArrayConversionError)
        with pytest.raises(leaked):
            compare_step(model, naive, x)
    else:
        with pytest.raises(AssertionError, match="gradient"):
            compare_step(model, naive, x)


@MODES
def test_batchnorm_statistics_updated_exactly_once(compiled):
    model = models.resnet(blocks=2)
    ck = graphckpt.checkpoint_model(model, segments=3)
    bn = [l for l in model.layers if isinstance(l, layers.BatchNormalization)][0]
    x = np.random.default_rng(1).normal(size=(4, 8, 8, 3)).astype("float32")
    before = to_numpy(bn.moving_mean)
    compare_step(model, ck, x, compiled=compiled)  # includes the state after the step
    assert not np.allclose(before, to_numpy(bn.moving_mean))


def _stateful_rnn():
    inp = keras.Input((5, 4), batch_size=4)
    x = layers.Dense(4, activation="tanh")(inp)
    x = layers.LSTM(6, return_sequences=True, stateful=True)(x)
    x = layers.Dense(6, activation="tanh")(x)
    x = layers.Dense(6, activation="tanh")(x)
    return keras.Model(inp, layers.Dense(1)(x))


@MODES
@pytest.mark.skipif(BACKEND == "torch", reason="the plain model's step fails in Keras on PyTorch (in-place state)")
def test_stateful_rnn_states_are_snapshotted_and_assigned_once(compiled):
    """A stateful RNN's states are variables Keras does not track (not in
    `model.variables`). Its segment reads them from a snapshot, in the
    forward pass and in the recompute alike, and assigns the new states
    once: the same gradients and states after the step as the original
    (`state_of` includes them). Before, the segment's forward pass left the
    new states in its StatelessScope and they were never assigned."""
    model = _stateful_rnn()
    lstm = next(l for l in model.layers if isinstance(l, layers.LSTM))
    rng = np.random.default_rng(4)
    for v in lstm.states:
        v.assign(rng.normal(size=v.shape).astype("float32"))
    ck = graphckpt.checkpoint_model(model, segments=3)
    assert any(lstm in s.model.layers for s in _segments(ck))
    before = [to_numpy(v) for v in lstm.states]
    compare_step(model, ck, rng.normal(size=(4, 5, 4)).astype("float32"), compiled=compiled)
    if BACKEND != "jax":  # Keras's JAX step does not carry the states, plain or not
        assert not np.allclose(before[0], to_numpy(lstm.states[0]))


def _two_branches_with_dropout():
    """A long branch and a short one, each with unseeded Dropout: Keras runs
    the long branch's calls first (deepest first), an as-soon-as-possible
    order the short branch's Dropout first."""
    a, b = keras.Input((8,)), keras.Input((8,))
    x = a
    for _ in range(3):
        x = layers.Dropout(0.3)(layers.Dense(8, activation="tanh")(x))
    y = layers.Dense(8, activation="tanh")(layers.Dropout(0.3)(b))
    z = layers.Dense(8, activation="tanh")(layers.Concatenate()([x, y]))
    return keras.Model([a, b], layers.Dense(1)(z))


def test_unseeded_dropout_on_two_branches_draws_the_original_masks():
    """On PyTorch, Keras's dropout with an unseeded `SeedGenerator` draws
    from torch's global generator, so masks depend on the order of the
    calls: such calls keep Keras's order (`chains.state_chains`). Before,
    the planner's as-soon-as-possible order ran the short branch's Dropout
    first, and a checkpointed BartBackbone's outputs differed from the
    original's on PyTorch."""
    model = _two_branches_with_dropout()
    ck = graphckpt.checkpoint_model(model, segments=3)
    rng = np.random.default_rng(3)
    x = [rng.normal(size=(16, 8)).astype("float32"), rng.normal(size=(16, 8)).astype("float32")]
    compare_step(model, ck, x)


def _sparse_batch(rows=8, cols=50):
    """A random sparse batch as the backend's sparse tensor."""
    dense = np.random.default_rng(5).normal(size=(rows, cols)).astype("float32")
    dense[np.random.default_rng(6).uniform(size=dense.shape) > 0.1] = 0.0
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return tf.sparse.from_dense(dense)
    from jax.experimental import sparse

    return sparse.BCOO.fromdense(dense)


@MODES
@pytest.mark.skipif(BACKEND == "torch", reason="Keras has no sparse inputs on PyTorch")
def test_sparse_inputs_stay_sparse_and_get_exact_gradients(compiled):
    """A sparse input reaches its segment as a sparse tensor (the
    sub-model's input is declared sparse, so Keras does not densify it) and
    enters the rematerialized function as its components, the values an
    argument. Before, TensorFlow refused a `SparseTensor` as a gradient
    source and JAX could not tie a `BCOO`."""
    inp = keras.Input((50,), sparse=True)
    x = layers.Dense(16, activation="tanh")(inp)
    x = layers.Dropout(0.2)(x)
    for _ in range(4):
        x = layers.Dense(16, activation="tanh")(x)
    model = keras.Model(inp, layers.Dense(2)(x))
    ck = graphckpt.checkpoint_model(model, segments=3)
    first = _segments(ck)[0]
    assert first.model.inputs[0].sparse
    compare_step(model, ck, _sparse_batch(), compiled=compiled)


_OUTSIDE = []


class _CountsCalls(layers.Layer):
    """Assigns a variable no layer holds (so no one can find it)."""

    def call(self, x):
        _OUTSIDE[0].assign_add(1.0)
        return x


def test_a_variable_assigned_from_outside_the_model_is_an_error():
    """Where a layer assigns a variable that is neither among the model's
    variables nor held by a layer, the assignment would stay in the
    segment's scope and be lost: one clear error instead."""
    _OUTSIDE[:] = [keras.Variable(0.0, trainable=False)]
    inp = keras.Input((4,))
    x = layers.Dense(4, activation="tanh")(inp)
    x = _CountsCalls()(x)
    x = layers.Dense(4, activation="tanh")(x)
    ck = graphckpt.checkpoint_model(keras.Model(inp, layers.Dense(1)(x)), segments=2)
    with pytest.raises(graphckpt.UnsupportedModelError, match=r"segment_\d'.*assigned 1 variable"):
        ck(np.ones((2, 4), "float32"), training=True)


@pytest.mark.skipif(BACKEND != "torch", reason="the PyTorch-specific hazard (pytorch issue 96136)")
def test_naive_torch_checkpoint_updates_batchnorm_twice():
    """Guard: plain `torch.utils.checkpoint` (what `keras.remat` is on
    PyTorch) runs BatchNormalization's update again in the recompute."""
    model = models.resnet(blocks=1)
    naive = _naive(model, (8, 8, 3))
    x = np.random.default_rng(1).normal(size=(4, 8, 8, 3)).astype("float32")
    with pytest.raises(AssertionError, match="state of .*moving"):
        compare_step(model, naive, x)


class _AddsLoss(layers.Layer):
    def call(self, x):
        self.add_loss(0.1 * ops.mean(ops.square(x)))
        return x


@MODES
def test_layer_losses_are_kept(compiled):
    inp = keras.Input((8,))
    x = inp
    for i in range(6):
        x = layers.Dense(8, activation="tanh", kernel_regularizer="l2", activity_regularizer="l1")(x)
        if i == 3:
            x = _AddsLoss()(x)
    model = keras.Model(inp, layers.Dense(1)(x))
    ck = graphckpt.checkpoint_model(model, segments=3)
    x = np.random.default_rng(2).normal(size=(5, 8)).astype("float32")
    compare_step(model, ck, x, compiled=compiled)
    model(x, training=True)
    own = sorted(float(to_numpy(v)) for v in model.losses)
    ck(x, training=True)
    ours = sorted(float(to_numpy(v)) for v in ck.losses)
    np.testing.assert_allclose(ours, own, rtol=1e-6)
    assert len(ours) == 6 + 6 + 1  # kernel l2, activity l1, add_loss


def test_no_stale_loss_ids_are_left_to_drop_a_later_loss():
    """Keras drops, at a layer's next call, every loss of the current scope
    whose id is among the ids the layer kept from its last call. Ids of
    freed losses get reused, so a stale id can drop another layer's new
    loss (a JAX CI run lost one). After a call, the layers inside the
    segments keep no loss ids, and a segment's ids are those of losses it
    still holds."""
    inp = keras.Input((8,))
    x = inp
    for i in range(6):
        x = layers.Dense(8, activation="tanh", activity_regularizer="l1")(x)
        if i == 3:
            x = _AddsLoss()(x)
    model = keras.Model(inp, layers.Dense(1)(x))
    ck = graphckpt.checkpoint_model(model, segments=3)
    x = np.ones((2, 8), "float32")
    trainable = [v.value for v in ck.trainable_variables]
    non_trainable = [v.value for v in ck.non_trainable_variables]
    _, _, losses = ck.stateless_call(trainable, non_trainable, x, training=True, return_losses=True)
    assert len(losses) == 6 + 1
    for seg in _segments(ck):
        inside = [l for l in seg.model._flatten_layers(include_self=True) if l._loss_ids]
        assert inside == [], [l.name for l in inside]
        assert seg._loss_ids == {id(loss) for loss in seg._graphckpt_losses}


@MODES
def test_masks_cross_segment_boundaries(compiled):
    model = models.masked_lstm()
    ck = graphckpt.checkpoint_model(model, segments=4)
    x = models.sample_inputs(model)
    compare_step(model, ck, x, compiled=compiled)
    unmasked = models.masked_lstm(mask_zero=False)
    unmasked.set_weights(model.get_weights())
    assert not np.allclose(to_numpy(model(x)), to_numpy(unmasked(x)), atol=1e-4)


class _Gate(layers.Layer):
    def call(self, inputs):
        x, keep = inputs
        return ops.where(keep, x, ops.zeros_like(x))


@MODES
def test_bool_and_int_inputs_cross_segments(compiled):
    """Non-float tensors cross segment boundaries without being
    differentiated: a bool gate and an int index, both used late."""
    x_in = keras.Input((8,), name="x")
    keep = keras.Input((8,), dtype="bool", name="keep")
    ids = keras.Input((3,), dtype="int32", name="ids")
    h = x_in
    for _ in range(6):
        h = layers.Dense(8, activation="tanh")(h)
    h = _Gate()([h, keep])
    e = layers.Flatten()(layers.Embedding(10, 4)(ids))
    h = layers.Dense(8, activation="tanh")(layers.Concatenate()([h, e]))
    model = keras.Model([x_in, keep, ids], layers.Dense(1)(h))
    ck = graphckpt.checkpoint_model(model, segments=3)
    rng = np.random.default_rng(6)
    x = [
        rng.normal(size=(4, 8)).astype("float32"),
        rng.random((4, 8)) > 0.5,
        rng.integers(0, 10, size=(4, 3)).astype("int32"),
    ]
    compare_step(model, ck, x, compiled=compiled)


# float16 on TensorFlow only: the CPU kernels of JAX and PyTorch for it are
# partial and slow; bfloat16 everywhere.
POLICIES = {"tensorflow": ["mixed_bfloat16", "mixed_float16"]}.get(BACKEND, ["mixed_bfloat16"])


@MODES
@pytest.mark.parametrize("policy", POLICIES)
def test_mixed_precision(policy, compiled):
    keras.config.set_dtype_policy(policy)
    model = models.resnet(blocks=2)
    ck = graphckpt.checkpoint_model(model)
    x = np.random.default_rng(5).normal(size=(2, 8, 8, 3)).astype("float32")
    assert ck.compute_dtype == model.compute_dtype == policy.removeprefix("mixed_")
    compare_step(model, ck, x, compiled=compiled, atol=2e-2, rtol=2e-2)


class _UnseededNoise(layers.Layer):
    """Draws from Keras's global seed generator (`seed=None`)."""

    def call(self, x, training=None):
        if training:
            return x * keras.random.uniform(ops.shape(x), 0.5, 1.5)
        return x


def _unseeded_model():
    keras.random.uniform((1,))  # the global generator exists before the rewrite
    inp = keras.Input((8,))
    x = inp
    for _ in range(6):
        x = _UnseededNoise()(layers.Dense(8, activation="tanh")(x))
    return keras.Model(inp, layers.Dense(1)(x))


# JAX refuses unseeded random ops in a traced function (Keras's own rule).
UNSEEDED = pytest.mark.skipif(BACKEND == "jax", reason="Keras forbids unseeded random ops under a JAX trace")


@UNSEEDED
@MODES
def test_unseeded_random_ops_are_exact(compiled):
    model = _unseeded_model()
    ck = graphckpt.checkpoint_model(model, segments=3)
    compare_step(model, ck, np.ones((4, 8), "float32"), compiled=compiled)


@UNSEEDED
def test_unseeded_random_ops_need_the_global_state(monkeypatch):
    """Guard: without the global generator in the snapshot, the forward
    pass's draws would advance it only inside the segment's scope (and the
    recompute would draw again): an error, not a silent difference."""
    monkeypatch.setattr("graphckpt.runtime.segment._global_seed_state", lambda: [])
    model = _unseeded_model()
    ck = graphckpt.checkpoint_model(model, segments=3)
    with pytest.raises(graphckpt.UnsupportedModelError, match="assigned 1 variable"):
        compare_step(model, ck, np.ones((4, 8), "float32"))


@UNSEEDED
def test_unseeded_random_ops_are_exact_when_keras_makes_its_generator_in_a_segment():
    """`keras.utils.set_random_seed` drops Keras's global seed generator;
    the first unseeded random op makes a new one, here inside a segment's
    forward pass. The segment then runs again with it in the snapshot
    (`Segment._remat_call`): `fit` trains as plain `fit` does. Before, on
    PyTorch, the next segment drew the same numbers again."""

    def trained(checkpoint):
        keras.utils.set_random_seed(1)
        inp = keras.Input((8,))
        x = inp
        for _ in range(6):
            x = _UnseededNoise()(layers.Dense(8, activation="tanh")(x))
        model = keras.Model(inp, layers.Dense(1)(x))
        target = graphckpt.checkpoint_model(model, segments=3) if checkpoint else model
        target.compile(optimizer="sgd", loss="mse")
        keras.utils.set_random_seed(5)  # no global generator from here on
        x, y = np.random.default_rng(0).normal(size=(32, 8)).astype("float32"), np.zeros((32, 1), "float32")
        history = target.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
        return history, [to_numpy(v) for v in model.weights]

    want, got = trained(False), trained(True)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _segments(ck):
    return [l for l in ck.layers if isinstance(l, Segment)]


def _jax_primitives(jaxpr):
    """Every equation of `jaxpr`, sub-jaxprs included."""
    from jax._src import core

    for eqn in jaxpr.eqns:
        yield eqn
        for sub in core.jaxprs_in_params(eqn.params):
            yield from _jax_primitives(sub)


def test_recompute_really_happens():
    """Each segment's forward runs again in the backward pass.

    TensorFlow and PyTorch (eager): the segment's Python function is called
    once in the forward pass and once more during backward. JAX traces the
    function once for the forward pass and once more for the `custom_vjp`
    backward rule (`graphckpt.runtime.remat_jax.jax_remat`), and the gradient's jaxpr
    holds the recomputed forward: more matmuls than the plain model's."""
    model = models.chain(depth=12)
    ck = graphckpt.checkpoint_model(model, segments=3)
    segments = _segments(ck)
    x = np.ones((2, 16), "float32")
    if BACKEND == "jax":
        import jax

        def grad_jaxpr(m):
            loss = lambda t, n, x: jax_loss_fn(m)(t, n, x)[0]  # noqa: E731
            values = ([v.value for v in m.trainable_variables], [v.value for v in m.non_trainable_variables])
            return jax.make_jaxpr(jax.grad(loss))(*values, x).jaxpr

        dots = lambda eqns: sum(e.primitive.name == "dot_general" for e in eqns)  # noqa: E731
        plain = dots(_jax_primitives(grad_jaxpr(model)))
        assert [s.forward_calls for s in segments] == [0, 0, 0]
        ours = dots(_jax_primitives(grad_jaxpr(ck)))
        assert [s.forward_calls for s in segments] == [2, 2, 2]  # forward, then the backward rule's recompute
        assert ours > plain
        return
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            y = ck(x, training=True)
        assert [s.forward_calls for s in segments] == [1, 1, 1]
        tape.gradient(y, [v.value for v in ck.trainable_variables])
    else:
        import torch

        y = ck(x, training=True)
        assert [s.forward_calls for s in segments] == [1, 1, 1]
        torch.autograd.grad(ops.sum(y), [v.value for v in ck.trainable_variables])
    assert [s.forward_calls for s in segments] == [2, 2, 2]


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's custom_vjp remat (TensorFlow's: tests/test_tensorflow_only.py)")
def test_jax_recompute_draws_its_random_numbers_after_the_cotangent():
    """`jax_remat` ties a seed-state argument to the incoming cotangents as
    it ties the inputs: a random draw computed from the seed alone was
    merged by XLA with the forward pass's draw, and its mask kept from the
    forward pass to the backward pass (GPT-2 with dropout 0.1 at sequence
    256: 340 -> 268 MiB at 8 blocks). In the forward pass the seed state is
    tied to the segment's input (`remat._states_after_inputs`). In the
    gradient's jaxpr the forward draw depends on the input and not on the
    cotangent; the recompute's depends on the cotangent."""
    import jax
    import jax.numpy as jnp
    from jax._src import core

    from graphckpt.runtime.remat_jax import jax_remat

    def f(x, seed):  # `seed`: a uint32 seed state, as Keras's SeedGenerator holds
        return (x * jax.random.uniform(jax.random.wrap_key_data(seed), x.shape),)

    def gradient(x, seed, ct):
        return jax.vjp(jax_remat(f, 1), x, seed)[1](ct)

    jaxpr = jax.make_jaxpr(gradient)(jnp.ones((4,)), jnp.array([0, 7], jnp.uint32), (jnp.ones((4,)),)).jaxpr
    x, _, ct = jaxpr.invars
    reached = {x: {"x"}, ct: {"ct"}}  # which of the two each value is computed from
    draws = []
    for eqn in jaxpr.eqns:
        sources = set().union(*[reached.get(v, set()) for v in eqn.invars if not isinstance(v, core.Literal)])
        for v in eqn.outvars:
            reached[v] = sources
        inside = [eqn] + [e for sub in core.jaxprs_in_params(eqn.params) for e in _jax_primitives(sub)]
        if any(e.primitive.name in ("random_bits", "threefry2x32") for e in inside):
            draws.append(sources)
    assert draws == [{"x"}, {"ct"}]  # the forward's draw waits for the input, the recompute's for the cotangent


def test_inference_takes_no_remat_path():
    model = models.chain(dropout=0.3)
    ck = graphckpt.checkpoint_model(model, segments=3)
    x = np.ones((2, 16), "float32")
    ck(x, training=False)
    ck.predict(x, verbose=0)
    assert [s.forward_calls for s in _segments(ck)] == [0, 0, 0]


def _fit(model, x, y, **compile_kwargs):
    # SGD, not Adam: a conv bias before BatchNormalization has a zero true
    # gradient, and Adam scales its rounding noise (1e-9) up to steps of the
    # learning rate, so any change of float summation order (a different
    # plan, a different backend) would move those biases by 1e-4.
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", **compile_kwargs)
    return model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0).history["loss"]


# On TensorFlow also under XLA (`jit_compile=True`): the segments' custom
# gradients survive it. JAX's fit always jits; PyTorch has no XLA here.
@pytest.mark.parametrize("xla", {"tensorflow": [False, True]}.get(BACKEND, [False]), ids=lambda x: "xla" if x else "")
def test_fit_gives_the_same_history_and_trains_the_original(xla):
    def fresh():
        keras.utils.set_random_seed(7)
        return models.resnet(blocks=2)

    x = np.random.default_rng(3).normal(size=(16, 8, 8, 3)).astype("float32")
    y = np.random.default_rng(4).normal(size=(16, 3)).astype("float32")
    xla = {"jit_compile": True} if xla else {}
    plain = fresh()
    h0 = _fit(plain, x, y, **xla)
    model = fresh()
    ck = graphckpt.checkpoint_model(model)
    h1 = _fit(ck, x, y, **xla)
    np.testing.assert_allclose(h1, h0, rtol=1e-4)
    assert h1[-1] < h1[0]
    for a, b in zip(state_of(model), state_of(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_fit_with_random_layers_runs_and_trains_the_original():
    model = models.chain(dropout=0.3, bn=True)
    ck = graphckpt.checkpoint_model(model)
    x = np.random.default_rng(3).normal(size=(32, 16)).astype("float32")
    y = np.random.default_rng(4).normal(size=(32, 2)).astype("float32")
    before = state_of(model)
    history = _fit(ck, x, y)
    assert np.all(np.isfinite(history))
    for v, a in zip(model.variables, before):
        if v.trainable or "moving" in v.path:
            assert not np.array_equal(a, to_numpy(v)), f"{v.path} did not change"


def test_weights_are_shared_by_identity():
    model = models.multi_io()
    ck = graphckpt.checkpoint_model(model)
    ids = {id(v) for v in model.trainable_variables}
    assert len(ck.trainable_variables) == len(ids)
    assert all(id(v) in ids for v in ck.trainable_variables)
    shared = model.get_layer("shared")
    inside = [l for seg in _segments(ck) for l in seg.model.layers]
    assert any(l is shared for l in inside)
    x = models.sample_inputs(model)
    before = to_numpy(ck(x)["main"])
    shared.kernel.assign(shared.kernel * 2.0)
    assert not np.allclose(before, to_numpy(ck(x)["main"]))
