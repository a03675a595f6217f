"""The fit flag on subclassed models: `call` traced into a graph of layer
calls (`graphckpt.graph.tracing`), planned, and the user's own object trained
through it, exactly as plain `fit` trains it; a `call` that can't be
traced exactly is refused, naming the construct and the line."""

import keras
import numpy as np
import pytest
from keras import layers, ops

import graphckpt
from graphckpt.training.flag import _CACHE_ATTR
from tests import subclassed_models as sm
from tests.helpers import BACKEND, to_numpy

pytestmark = pytest.mark.backends

RNG = np.random.default_rng(0)
TOKENS = RNG.integers(1, 1000, size=(16, 32))
NEXT = RNG.integers(0, 1000, size=(16, 32))
IMAGES = RNG.normal(size=(16, 12, 12, 3)).astype("float32")
CLASSES = RNG.integers(0, 4, size=(16,))
VECTORS = RNG.uniform(size=(32, 16)).astype("float32")
PADDED = np.where(RNG.uniform(size=(16, 10)) < 0.3, 0, RNG.integers(1, 50, size=(16, 10)))
TAGS = RNG.integers(0, 3, size=(16,))
SCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

CASES = {
    "gpt": (lambda: sm.GPT(length=32, dim=32, heads=4, ffn=64, depth=4), (TOKENS, NEXT), SCE),
    "resnet": (lambda: sm.ResNet(), (IMAGES, CLASSES), SCE),
    "vae": (lambda: sm.VAE(), (VECTORS,), None),
    "tagger": (lambda: sm.Tagger(), (PADDED, TAGS), SCE),
}


def _fit(case, **flag):
    build, data, loss = CASES[case]
    keras.utils.set_random_seed(5)
    model = build()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss)
    keras.utils.set_random_seed(11)  # the same dropout masks and noise in both runs
    history = model.fit(*data, batch_size=8, epochs=2, shuffle=False, verbose=0, **flag)
    return model, history.history["loss"]


def _twin(model):
    (twin,) = model.__dict__[_CACHE_ATTR].twins.values()
    return twin


CASES["gpt_256"] = (
    lambda: sm.GPT(length=256, dim=64, heads=4, ffn=128, depth=8),
    (RNG.integers(1, 1000, size=(16, 256)), RNG.integers(0, 1000, size=(16, 256))),
    SCE,
)  # the size: 8 blocks at sequence 256 (slow: run by hand, `-m slow`)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c == "gpt_256" else c for c in CASES]
)
def test_a_subclassed_model_trains_exactly_as_plain_fit(installed, case):
    plain, plain_losses = _fit(case)
    model, losses = _fit(case, gradient_checkpointing=True)
    # Equal to the rounding of the same arithmetic (JAX's XLA may fuse the
    # recomputed segments otherwise; TF and torch give the same bits here).
    # The VAE's KL term reads the encoder's outputs, which the reconstruction
    # reads in another segment: their gradients are summed in another order.
    tolerance = 2e-6 if BACKEND == "jax" or case == "vae" else 0.0
    np.testing.assert_allclose(losses, plain_losses, rtol=tolerance, atol=tolerance)
    assert [v.shape for v in model.weights] == [v.shape for v in plain.weights]
    for a, b in zip(model.weights, plain.weights):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=tolerance, atol=tolerance, err_msg=a.path)
    # The user's own object trained: its class, its layers, its variables.
    twin = _twin(model)
    ids = {id(v) for v in model.weights}
    assert all(id(v) in ids for v in twin.model.weights)
    assert "call" not in model.__dict__  # the routing ends with the fit
    assert any(seg.remat for seg in twin.plan.segments)


def test_recompute_really_happens_in_each_step(installed):
    build, (x, y), loss = CASES["gpt"]
    keras.utils.set_random_seed(5)
    model = build()
    model.compile(optimizer="sgd", loss=loss, run_eagerly=True)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, gradient_checkpointing=True)
    segments = _twin(model).segments
    # 2 steps, each one forward and one recompute per recomputed segment.
    assert segments and [s.forward_calls for s in segments] == [4] * len(segments)


def test_the_trace_cuts_between_blocks_and_inside_nested_subclassed_models(installed):
    model, _ = _fit("gpt", gradient_checkpointing=True)
    plan = _twin(model).plan
    blocks = [layer.name for layer in model.blocks]
    cut_after = [seg.nodes[-1][0] for seg in plan.segments[:-1]]
    assert any(name in blocks for name in cut_after), cut_after
    vae, _ = _fit("vae", gradient_checkpointing=True)
    # The encoder and decoder (subclassed models) are opened: their Dense calls are nodes.
    nodes = [name for seg in _twin(vae).plan.segments for name, _ in seg.nodes]
    assert f"{vae.encoder.name}/{vae.encoder.hidden[0].name}" in nodes, nodes
    assert f"{vae.decoder.name}/{vae.decoder.out.name}" in nodes, nodes


def test_the_kl_term_added_in_call_reaches_the_loss(installed):
    model, _ = _fit("vae", gradient_checkpointing=True)
    twin = _twin(model)
    x = VECTORS[:8]
    keras.utils.set_random_seed(3)
    twin_outputs = twin.model(x, training=True)
    assert isinstance(twin_outputs, list) and len(twin_outputs) == 2  # reconstruction, then the KL term
    keras.utils.set_random_seed(3)
    model(x, training=True)
    (kl,) = model.losses
    np.testing.assert_allclose(to_numpy(twin_outputs[1]), to_numpy(kl), rtol=1e-6)
    assert float(to_numpy(kl)) > 0


class ControlFlow(keras.Model):
    def __init__(self):
        super().__init__()
        self.a, self.b = layers.Dense(4), layers.Dense(4)

    def call(self, x):
        x = self.a(x)
        if ops.sum(x) > 0:  # the line the refusal names
            x = self.b(x)
        return x


class OwnVariable(keras.Model):
    def build(self, shape):
        self.a, self.b = layers.Dense(4), layers.Dense(4)
        self.scale = self.add_weight(shape=(4,), initializer="ones")

    def call(self, x):
        return self.b(self.a(x)) * self.scale


class RandomInCall(keras.Model):
    def __init__(self):
        super().__init__()
        self.a, self.b = layers.Dense(4), layers.Dense(4)

    def call(self, x):
        return self.b(self.a(x) + keras.random.normal(ops.shape(x)))


class LayerOnConstants(keras.Model):
    """The position embedding called on `ops.arange` in the model's `call`:
    traced, it would be a constant, and its variables would not train."""

    def __init__(self):
        super().__init__()
        self.a, self.b = layers.Dense(4), layers.Dense(4)
        self.positions = layers.Embedding(8, 4)

    def call(self, x):
        return self.b(self.a(x) + self.positions(ops.arange(1)))


REFUSED = [
    (ControlFlow, "Python control flow on a tensor's value", "if ops.sum(x) > 0"),
    (OwnVariable, "holds variables or seed generators itself", None),
    (RandomInCall, "draws random numbers outside a layer", None),
    (LayerOnConstants, "do not come from the inputs", None),
]


@pytest.mark.parametrize("cls, construct, line", REFUSED, ids=[c.__name__ for c, _, _ in REFUSED])
def test_a_call_that_cannot_be_traced_exactly_is_refused_with_the_construct(installed, cls, construct, line):
    model = cls()
    model.compile(optimizer="sgd", loss="mse")
    x, y = RNG.normal(size=(16, 4)).astype("float32"), RNG.normal(size=(16, 4)).astype("float32")
    model(x[:8])
    before = [to_numpy(v) for v in model.weights]
    with pytest.raises(graphckpt.UnsupportedModelError, match="traces its `call`") as info:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, gradient_checkpointing=True)
    message = str(info.value)
    assert construct in message and cls.__name__ in message and "Tip:" in message
    if line:
        assert "test_subclassed_fit.py:" in message and line in message
    assert "call" not in model.__dict__ and "add_loss" not in model.__dict__
    assert all(np.array_equal(a, to_numpy(v)) for a, v in zip(before, model.weights))  # nothing trained


def test_auto_trains_an_untraceable_model_plainly_with_a_warning(installed):
    x, y = RNG.normal(size=(16, 4)).astype("float32"), RNG.normal(size=(16, 4)).astype("float32")
    histories = []
    for flag in ({}, {"gradient_checkpointing": "auto"}):
        keras.utils.set_random_seed(1)
        model = LayerOnConstants()
        model.compile(optimizer="sgd", loss="mse")
        if flag:
            with pytest.warns(graphckpt.GraphckptWarning, match="do not come from the inputs.*Plain fit"):
                histories.append(model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, **flag))
        else:
            histories.append(model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False))
    assert histories[1].history["loss"] == histories[0].history["loss"]
    assert "call" not in model.__dict__


def test_checkpoint_model_refuses_a_subclassed_model_and_points_to_the_flag():
    model = sm.Tagger()
    model(PADDED[:2])
    with pytest.raises(graphckpt.UnsupportedModelError, match="gradient_checkpointing=True"):
        graphckpt.checkpoint_model(model)


class TwoInputs(keras.Model):
    """Takes a dict of inputs, as keras_hub's models and many users' do."""

    def __init__(self):
        super().__init__()
        self.text = [layers.Dense(8, activation="tanh") for _ in range(3)]
        self.extra = layers.Dense(8)
        self.head = layers.Dense(1)

    def call(self, inputs):
        x = inputs["text"]
        for dense in self.text:
            x = dense(x)
        return self.head(x + self.extra(inputs["extra"]))


def test_dict_inputs_are_planned_for_the_datas_shapes(installed):
    x = {"text": RNG.normal(size=(16, 6)).astype("float32"), "extra": RNG.normal(size=(16, 3)).astype("float32")}
    y = RNG.normal(size=(16, 1)).astype("float32")
    histories, models = [], []
    for flag in ({}, {"gradient_checkpointing": 2}):
        keras.utils.set_random_seed(2)
        model = TwoInputs()
        model.compile(optimizer="sgd", loss="mse")
        histories.append(model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False, **flag).history["loss"])
        models.append(model)
    np.testing.assert_allclose(histories[1], histories[0], rtol=2e-6 if BACKEND == "jax" else 0.0)
    plan = _twin(models[1]).plan
    assert len(plan.segments) == 2 and plan.batch_size == 8  # planned for the data, not per example


def test_mixed_precision_trains_as_plain_fit(installed):
    """The trace casts the inputs as `Model.__call__` casts them."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain, plain_losses = _fit("gpt")
        model, losses = _fit("gpt", gradient_checkpointing=True)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.compute_dtype == "float16"
    # JAX: XLA fuses the recomputed float16 segments otherwise, one float16
    # ulp (1e-3 relative) on a few elements. TensorFlow and PyTorch: the same bits.
    rtol, atol = (2e-3, 1e-4) if BACKEND == "jax" else (0.0, 0.0)
    np.testing.assert_allclose(losses, plain_losses, rtol=rtol)
    for a, b in zip(model.weights, plain.weights):
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=rtol, atol=atol, err_msg=a.path)


def test_a_training_call_with_a_mask_runs_the_models_own_call_with_a_warning(installed):
    from graphckpt.training.flag import _training_call

    model, _ = _fit("tagger", gradient_checkpointing=True)
    (traced,) = model.__dict__["_graphckpt_traced"].values()
    routed = _training_call(model, _twin(model), traced)
    x, mask = PADDED[:8], (RNG.uniform(size=(8, 10)) < 0.5)
    seeds = [to_numpy(v) for v in model.non_trainable_variables]  # the noise layer's seed state
    with pytest.warns(graphckpt.GraphckptWarning, match=r"\(mask\) runs without gradient checkpointing"):
        got = routed(x, training=True, mask=mask)
    for v, value in zip(model.non_trainable_variables, seeds):
        v.assign(value)
    np.testing.assert_array_equal(to_numpy(got), to_numpy(model.call(x, training=True, mask=mask)))


def test_data_of_another_sequence_length_gets_its_own_trace_and_twin(installed):
    build, (x, y), loss = CASES["gpt"]
    histories = []
    for flag in ({}, {"gradient_checkpointing": 2}):  # the same cuts at both lengths
        keras.utils.set_random_seed(5)
        model = build()
        model.compile(optimizer="sgd", loss=loss)
        keras.utils.set_random_seed(11)
        history = [model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, **flag).history["loss"]]
        history.append(model.fit(x[:, :16], y[:, :16], batch_size=8, epochs=1, shuffle=False, verbose=0, **flag)
                       .history["loss"])
        histories.append(history)
    tolerance = 2e-6 if BACKEND == "jax" else 0.0
    np.testing.assert_allclose(histories[1], histories[0], rtol=tolerance)
    assert len(model.__dict__["_graphckpt_traced"]) == 2 and len(model.__dict__[_CACHE_ATTR].twins) == 2


def test_data_it_cannot_read_without_consuming_is_refused_with_what_to_do(installed):
    model = sm.Tagger(name="tagger_on_a_generator")
    model.compile(optimizer="sgd", loss=SCE)

    def batches():
        while True:
            yield PADDED[:8], TAGS[:8]

    with pytest.raises(graphckpt.UnsupportedModelError) as info:
        model.fit(batches(), steps_per_epoch=1, epochs=1, verbose=0, gradient_checkpointing=True)
    message = str(info.value)
    assert "'tagger_on_a_generator' is subclassed" in message and "generator" in message
    assert "arrays or a `tf.data.Dataset`" in message and "Tip:" in message
    assert not model.built and "call" not in model.__dict__
