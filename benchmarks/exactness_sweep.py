"""Exactness sweep: plain `fit` against the fit flag, over Keras features
and model shapes beyond the exactness matrix (tests/test_exact_fit.py).

Each case builds one model twice from the same seeds and trains it with
Adam(1e-2) for 2 epochs, once with plain `fit` and once with
`gradient_checkpointing=3`, then compares the loss history and every
variable of the model. A row reads OK when both differ by at most 1e-5
(keras_hub cases: variables 1e-4), MISMATCH otherwise, or names the error.
A few seconds a case on the CPU; run it on each backend:

    KERAS_BACKEND=torch PYTHONPATH=. .venv/bin/python benchmarks/exactness_sweep.py
    KERAS_BACKEND=jax PYTHONPATH=. .venv/bin/python benchmarks/exactness_sweep.py --only sparse_input,bart

The session of 2026-12-06 found four failures this way (a stateful RNN on
TensorFlow, Keras's global seed generator made inside a segment and
BART's Dropout order on PyTorch, sparse inputs on TensorFlow and JAX); each
is fixed and has a test of its own.
"""

import argparse
import dataclasses

import keras
import numpy as np
from keras import layers, ops

import graphckpt

BACKEND = keras.backend.backend()
RNG = np.random.default_rng(0)


def _normal(*shape):
    return RNG.normal(size=shape).astype("float32")


def _chain(n_in=8, dropout=True, bn=True):
    inp = keras.Input((n_in,))
    x = inp
    for i in range(6):
        x = layers.Dense(16, activation="tanh")(x)
        if dropout and i == 2:
            x = layers.Dropout(0.2)(x)
        if bn and i == 3:
            x = layers.BatchNormalization()(x)
    return keras.Model(inp, layers.Dense(2)(x))


def _quantized(mode):
    def build():
        model = _chain(16, dropout=False, bn=False)
        model.quantize(mode)
        return model

    return build


def _stateful_rnn():
    inp = keras.Input((5, 4), batch_size=8)
    x = layers.LSTM(8, return_sequences=True, stateful=True)(inp)
    x = layers.Dense(8, activation="tanh")(x)
    x = layers.GRU(8, stateful=True)(x)
    return keras.Model(inp, layers.Dense(2)(layers.Dense(8, activation="tanh")(x)))


def _recurrent():
    inp = keras.Input((5, 4))
    x = layers.Bidirectional(layers.LSTM(8, return_sequences=True, dropout=0.2, recurrent_dropout=0.1))(inp)
    x = layers.TimeDistributed(layers.Dense(8, activation="relu"))(x)
    x = layers.Conv1D(8, 3, padding="same")(layers.LayerNormalization()(x))
    x = layers.Dense(8, activation="tanh")(layers.GlobalAveragePooling1D()(x))
    return keras.Model(inp, layers.Dense(2)(x))


def _image_layers():
    inp = keras.Input((16, 16, 3))
    x = layers.RandomFlip()(inp)
    x = layers.Conv2D(8, 3, padding="same")(x)
    x = layers.UnitNormalization()(layers.GroupNormalization(4)(x))
    x = layers.RandomRotation(0.1)(layers.SpatialDropout2D(0.2)(x))
    # No bias before BatchNormalization: its true gradient is zero, and
    # Adam turns that gradient's round-off into steps of the learning rate's
    # size (docs/limitations.md); on JAX it ended 5e-3 from plain `fit`'s.
    x = layers.BatchNormalization(momentum=0.5)(layers.DepthwiseConv2D(3, padding="same", use_bias=False)(x))
    x = layers.RandomContrast(0.2)(layers.RandomZoom(0.1)(layers.Activation("gelu")(x)))
    x = layers.RandomTranslation(0.1, 0.1)(layers.Conv2D(4, 3, padding="same", activation="relu")(x))
    x = layers.Dense(8, activation="tanh")(layers.GlobalMaxPooling2D()(x))
    return keras.Model(inp, layers.Dense(2)(x))


class _Counter(layers.Layer):
    """Non-trainable state assigned in `call`: a count and a running mean."""

    def build(self, shape):
        self.count = self.add_weight(shape=(), initializer="zeros", trainable=False, name="count")
        self.mean = self.add_weight(shape=shape[1:], initializer="zeros", trainable=False, name="mean")

    def call(self, x, training=None):
        if training:
            self.count.assign_add(1.0)
            self.mean.assign(self.mean * 0.9 + ops.mean(x, axis=0) * 0.1)
        return x * (1.0 + 0.01 * self.count)


@ops.custom_gradient
def _clipped_gradient(x):
    def grad(*args, upstream=None):
        return ops.clip(args[0] if upstream is None else upstream, -0.01, 0.01)

    return x, grad


class _ClipGradient(layers.Layer):
    def call(self, x):
        return _clipped_gradient(x)


def _custom_layers():
    inp = keras.Input((8,))
    x = layers.Lambda(lambda t: ops.tanh(t) * 2.0)(layers.Dense(16)(inp))
    x = _Counter()(layers.GaussianNoise(0.3)(x))
    x = layers.ActivityRegularization(l1=0.01)(layers.Dense(16, activation="relu")(x))
    x = _ClipGradient()(layers.AlphaDropout(0.2)(x))
    return keras.Model(inp, layers.Dense(2)(layers.Dense(16, activation="tanh")(x)))


def _seq2seq():
    enc, dec = keras.Input((6, 4)), keras.Input((5, 3))
    _, h, c = layers.LSTM(8, return_state=True)(layers.Dense(8, activation="tanh")(enc))
    h = layers.Dense(8, activation="tanh")(h)
    y = layers.LSTM(8, return_sequences=True)(layers.Dense(8, activation="tanh")(dec), initial_state=[h, c])
    y = layers.TimeDistributed(layers.Dropout(0.3))(layers.Dense(8, activation="tanh")(y))
    return keras.Model([enc, dec], layers.Dense(2)(y))


def _shared_state():
    inp = keras.Input((8,))
    drop, bn = layers.Dropout(0.3), layers.BatchNormalization()
    x = bn(drop(layers.Dense(8, activation="tanh")(inp)))
    for _ in range(3):
        x = layers.Dense(8, activation="tanh")(x)
    x = bn(drop(x))
    for _ in range(3):
        x = layers.Dense(8, activation="tanh")(x)
    return keras.Model(inp, layers.Dense(2)(x))


def _attention():
    # No biases in the attention layers: a key projection's bias has a zero
    # true gradient (softmax ignores a shift shared by all keys), and Adam
    # turns the rounding of a zero into steps of its learning rate (on JAX
    # 4.6e-5 from plain fit's after 2 epochs, every other variable 1e-7).
    inp, mask = keras.Input((6, 8)), keras.Input((6, 6), dtype="bool")
    mha = layers.MultiHeadAttention(2, 4, dropout=0.2, use_bias=False)
    x = mha(layers.Dense(8)(inp), layers.Dense(8)(inp), attention_mask=mask)
    x = layers.Dense(8, activation="tanh")(x)
    x = layers.MultiHeadAttention(2, 4, use_bias=False)(x, x, use_causal_mask=True)
    x = layers.GlobalAveragePooling1D()(layers.Dense(8, activation="tanh")(x))
    return keras.Model([inp, mask], layers.Dense(2)(x))


def _dict_io():
    a, b = keras.Input((8,), name="a"), keras.Input((6,), dtype="int32", name="b")
    e = layers.GRU(8)(layers.Embedding(10, 4, mask_zero=True)(b))
    x = layers.Concatenate()([layers.Dense(8, activation="relu")(a), e])
    for _ in range(4):
        x = layers.Dense(8, activation="tanh")(x)
    cls = layers.Dense(3, activation="softmax", name="cls")(x)
    reg = layers.Dense(1, name="reg")(layers.Dense(8, activation="relu")(x))
    return keras.Model({"a": a, "b": b}, {"cls": cls, "reg": reg})


def _sparse_input():
    inp = keras.Input((50,), sparse=True)
    x = layers.Dropout(0.2)(layers.Dense(16, activation="tanh")(inp))
    for _ in range(5):
        x = layers.Dense(16, activation="tanh")(x)
    return keras.Model(inp, layers.Dense(2)(x))


def _sparse_batch():
    import scipy.sparse

    return scipy.sparse.random(32, 50, density=0.1, format="csr", random_state=0, dtype=np.float32)


def _hub(name):
    """A keras_hub task model built from constructor arguments (no preset)."""
    import keras_hub

    def build():
        common = {"vocabulary_size": 64, "num_layers": 2, "hidden_dim": 16, "intermediate_dim": 32, "dropout": 0.1}
        if name == "bart":
            backbone = keras_hub.models.BartBackbone(num_heads=2, max_sequence_length=32, **common)
            return keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None)
        if name == "mistral":
            backbone = keras_hub.models.MistralBackbone(
                num_query_heads=2, num_key_value_heads=1, sliding_window=8, **common
            )
            return keras_hub.models.MistralCausalLM(backbone=backbone, preprocessor=None)
        backbone = keras_hub.models.DistilBertBackbone(num_heads=2, max_sequence_length=32, **common)
        return keras_hub.models.DistilBertTextClassifier(backbone, num_classes=3, preprocessor=None)

    return build


def _tokens(*names):
    return {n: RNG.integers(1, 64, (8, 12)).astype("int32") if "token" in n else np.ones((8, 12), "bool") for n in names}


@dataclasses.dataclass(frozen=True)
class Case:
    build: object
    data: object  # () -> (x, y, fit kwargs)
    compile_kwargs: dict = dataclasses.field(default_factory=dict)
    fit_kwargs: dict = dataclasses.field(default_factory=dict)
    skip: tuple = ()  # backends where plain Keras itself cannot run it
    task: bool = False  # a keras_hub task model: its own loss, Adam only


def _regression(n_in=8):
    return lambda: (_normal(32, n_in), _normal(32, 2), {})


CASES = {
    "steps_per_execution": Case(_chain, _regression(), {"steps_per_execution": 3}, skip=("torch",)),
    "gradient_accumulation": Case(_chain, _regression(), {"optimizer": {"gradient_accumulation_steps": 2}}),
    "ema": Case(_chain, _regression(), {"optimizer": {"use_ema": True, "ema_overwrite_frequency": 2}}),
    "global_clipnorm": Case(_chain, _regression(), {"optimizer": {"global_clipnorm": 0.5}}),
    "clipvalue": Case(_chain, _regression(), {"optimizer": {"clipvalue": 0.01}}),
    # PyTorch: tests/test_torch_compile.py (inductor's own random numbers).
    "jit_compile": Case(_chain, _regression(), {"jit_compile": True}, skip=("torch",)),
    "run_eagerly": Case(_chain, _regression(), {"run_eagerly": True}),
    "early_stopping": Case(_chain, _regression(), fit_kwargs={"validation_split": 0.25, "early_stopping": True}),
    "int8": Case(_quantized("int8"), _regression(16)),
    "float8": Case(_quantized("float8"), _regression(16)),
    "stateful_rnn": Case(_stateful_rnn, lambda: (_normal(32, 5, 4), _normal(32, 2), {}), skip=("torch",)),
    "recurrent": Case(_recurrent, lambda: (_normal(32, 5, 4), _normal(32, 2), {})),
    "image_layers": Case(_image_layers, lambda: (RNG.uniform(size=(32, 16, 16, 3)).astype("float32"), _normal(32, 2), {})),
    "custom_layers": Case(_custom_layers, _regression()),
    "seq2seq": Case(_seq2seq, lambda: ([_normal(32, 6, 4), _normal(32, 5, 3)], _normal(32, 5, 2), {})),
    "shared_state": Case(_shared_state, _regression()),
    "attention": Case(_attention, lambda: ([_normal(32, 6, 8), RNG.uniform(size=(32, 6, 6)) > 0.3], _normal(32, 2), {})),
    "dict_io": Case(
        _dict_io,
        lambda: (
            {"a": _normal(32, 8), "b": RNG.integers(0, 10, (32, 6)).astype("int32")},
            {"cls": RNG.integers(0, 3, (32,)), "reg": _normal(32, 1)},
            {"sample_weight": RNG.uniform(size=(32,)).astype("float32")},
        ),
        {"loss": {"cls": "sparse_categorical_crossentropy", "reg": "mse"}, "loss_weights": {"cls": 0.7, "reg": 0.3},
         "metrics": {"cls": ["accuracy"], "reg": ["mae"]}},
    ),
    "sparse_input": Case(_sparse_input, lambda: (_sparse_batch(), _normal(32, 2), {}), skip=("torch",)),
    "bart": Case(_hub("bart"), lambda: (
        _tokens("encoder_token_ids", "encoder_padding_mask", "decoder_token_ids", "decoder_padding_mask"),
        RNG.integers(1, 64, (8, 12)).astype("int32"), {}), task=True),
    "mistral": Case(_hub("mistral"), lambda: (
        _tokens("token_ids", "padding_mask"), RNG.integers(1, 64, (8, 12)).astype("int32"), {}), task=True),
    "distilbert": Case(_hub("distilbert"), lambda: (
        _tokens("token_ids", "padding_mask"), RNG.integers(0, 3, (8,)).astype("int32"), {}), task=True),
}


def _train(case, x, y, extra_fit, flag):
    keras.utils.set_random_seed(3)
    model = case.build()
    kwargs = dict(case.compile_kwargs)
    optimizer = keras.optimizers.Adam(1e-2, **kwargs.pop("optimizer", {}))
    if case.task:
        model.compile(optimizer=optimizer)  # the task's own loss and metrics
    else:
        model.compile(optimizer=optimizer, **{"loss": "mse", **kwargs})
    fit_kwargs = {**case.fit_kwargs, **extra_fit}
    if fit_kwargs.pop("early_stopping", False):
        fit_kwargs["callbacks"] = [keras.callbacks.EarlyStopping(patience=0, restore_best_weights=True)]
    keras.utils.set_random_seed(11)
    batch = 4 if case.task else 8
    history = model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0, gradient_checkpointing=flag,
                        **fit_kwargs)
    return history.history, [np.asarray(keras.ops.convert_to_numpy(v), "float64") for v in model.variables]


def run(name):
    """One row: (name, loss difference, variable difference, verdict)."""
    global RNG
    RNG = np.random.default_rng(0)  # each case's data alike, alone (--only) or in the sweep
    case = CASES[name]
    if BACKEND in case.skip:
        return name, None, None, f"skipped on {BACKEND}"
    x, y, extra_fit = case.data()
    try:
        (want, want_vars), (got, got_vars) = (_train(case, x, y, extra_fit, flag) for flag in (None, 3))
    except Exception as e:  # noqa: BLE001 - the sweep reports any failure as a row
        return name, None, None, f"ERROR {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    loss = max(abs(a - b) for key in want for a, b in zip(want[key], got[key]))
    var = max(float(np.max(np.abs(a - b))) for a, b in zip(want_vars, got_vars))
    ok = loss <= 1e-5 and var <= (1e-4 if case.task else 1e-5) and want.keys() == got.keys()
    return name, loss, var, "OK" if ok else "MISMATCH"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(CASES)
    graphckpt.install()
    print(f"| case ({BACKEND}) | loss difference | variable difference | verdict |\n|---|---:|---:|---|")
    for name in names:
        name, loss, var, verdict = run(name)
        fmt = lambda v: "" if v is None else f"{v:.1e}"  # noqa: E731
        print(f"| {name} | {fmt(loss)} | {fmt(var)} | {verdict} |", flush=True)


if __name__ == "__main__":
    main()
