"""Real sizes for unknown dimensions: `input_shape=` (graphckpt/graph/shapes.py).

Text models take token ids of shape (None, None): without the real sequence
length, every estimate and plan is for sequences of length 1. These tests
prove that the shapes given are propagated to every tensor (checked against
the shapes a real forward pass gives), that estimates and plans use them,
that the model is not changed, that the checkpointed model still takes any
shape and trains exactly, and that bad shapes and missing shapes are said
clearly.
"""

import warnings

import keras
import numpy as np
import pytest
from keras import layers

import graphckpt
from graphckpt import UnknownDimensionWarning, cli
from graphckpt.graph.build import build_graph
from graphckpt.graph.shapes import parse_input_shape, sized_graph
from tests.helpers import compare_step, to_numpy
from tests.untouched import Snapshot

VOCAB = 50


def text_model(dim=16, heads=2, blocks=2, name="text"):
    """Embedding + pre-norm attention blocks on token ids of shape (None, None)."""
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = layers.Embedding(VOCAB, dim)(tokens)
    for _ in range(blocks):
        h = layers.LayerNormalization()(x)
        h = layers.MultiHeadAttention(heads, dim // heads)(h, h, use_causal_mask=True)
        x = layers.Add()([x, layers.Dropout(0.1)(h)])
        h = layers.Dense(2 * dim, activation="gelu")(layers.LayerNormalization()(x))
        x = layers.Add()([x, layers.Dense(dim)(h)])
    return keras.Model(tokens, layers.Dense(VOCAB)(x), name=name)


def two_input_model(dim=8):
    """token_ids and padding_mask, both (None, None), as keras_hub's backbones."""
    ids = keras.Input((None,), dtype="int32", name="token_ids")
    mask = keras.Input((None,), dtype="int32", name="padding_mask")
    x = layers.Embedding(VOCAB, dim)(ids)
    m = layers.Reshape((-1, 1))(layers.Activation("linear")(keras.ops.cast(mask, "float32")))
    x = layers.Multiply()([x, m])
    for _ in range(3):
        x = layers.Dense(dim, activation="tanh")(x)
    return keras.Model({"token_ids": ids, "padding_mask": mask}, x, name="two_inputs")


def image_model():
    """A convolution stack on images of shape (None, None, None, 3)."""
    inp = keras.Input((None, None, 3), name="image")
    x = inp
    for c in (4, 8, 8):
        x = layers.Conv2D(c, 3, padding="same", activation="relu")(x)
    return keras.Model(inp, layers.GlobalAveragePooling2D()(x), name="image")


def chain_model():
    inp = keras.Input((8,), name="x")
    x = inp
    for _ in range(6):
        x = layers.Dense(8, activation="tanh")(x)
    return keras.Model(inp, x, name="chain")


def tokens(batch, seq, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=(batch, seq)).astype("int32")


def _unknown_warnings(caught):
    return [w for w in caught if issubclass(w.category, UnknownDimensionWarning)]


# ---------------------------------------------------------------- propagation


@pytest.mark.backends
@pytest.mark.parametrize("build, shape", [(text_model, (3, 11)), (image_model, (2, 9, 13, 3))])
def test_propagated_shapes_are_those_of_a_real_forward_pass(build, shape):
    """Every tensor's propagated shape equals what running the model on
    data of that shape gives, tensor by tensor."""
    model = build()
    graph = build_graph(model)
    sized, batch = sized_graph(graph, shape)
    assert batch == shape[0]
    # A functional model over every tensor of the graph: the same layer
    # calls, run on real data.
    keys = [k for k in graph.tensors if k not in graph.inputs]
    producers = {k: graph.nodes[graph.tensors[k].producer]["node"].outputs[k[2]] for k in keys}
    probe = keras.Model(model.input, [producers[k] for k in keys])
    x = tokens(*shape) if build is text_model else np.zeros(shape, "float32")
    real = probe(x)
    for key, value in zip(keys, real):
        assert sized.tensors[key].shape == tuple(to_numpy(value).shape), key
    # Keras itself knows only the symbolic shapes.
    assert any(None in graph.tensors[k].shape[1:] for k in keys)


@pytest.mark.backends
def test_propagation_leaves_the_model_untouched():
    model = text_model()
    x = tokens(2, 5)
    snap = Snapshot(model, x)
    graphckpt.estimate(model, input_shape=(4, 32))
    graphckpt.plan(model, input_shape=(4, 32))
    snap.assert_untouched(model, nodes=True)


def test_a_model_with_known_shapes_gets_the_same_estimate():
    """Where Keras knows every dimension, propagation agrees with it: the
    estimate with `input_shape` is the one with `batch_size`."""
    model = chain_model()
    a = graphckpt.estimate(model, input_shape=(16, 8))
    b = graphckpt.estimate(model, batch_size=16)
    assert a == b
    assert graphckpt.plan(model, input_shape=(16, 8)) == graphckpt.plan(model, batch_size=16)


# ---------------------------------------------------------------- estimates and plans


def test_estimates_are_for_the_sequence_length_given():
    model = text_model()
    with pytest.warns(UnknownDimensionWarning):
        length_one = graphckpt.estimate(model, batch_size=8)
    short = graphckpt.estimate(model, input_shape=(8, 64))
    long = graphckpt.estimate(model, input_shape=(8, 256))
    assert short.batch_size == long.batch_size == 8
    # Activations grow with the length; attention scores with its square.
    assert length_one.baseline_peak_bytes < short.baseline_peak_bytes < long.baseline_peak_bytes
    assert long.baseline_peak_bytes > 4 * short.baseline_peak_bytes
    # None as the batch dimension takes `batch_size`.
    assert graphckpt.estimate(model, input_shape=(None, 256), batch_size=8) == long


def test_plan_and_estimate_agree_at_the_real_shapes():
    model = text_model(blocks=4)
    p = graphckpt.plan(model, input_shape=(8, 128))
    assert p.batch_size == 8 and p.strategy == "auto"
    e = graphckpt.estimate(model, p, input_shape=(8, 128))
    assert e.peak_bytes == p.estimated_peak_bytes and e.baseline_peak_bytes == p.baseline_peak_bytes
    assert p.estimated_peak_bytes < p.baseline_peak_bytes
    # The plan for length 1 is estimated, at the real length, as no better.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnknownDimensionWarning)
        blind = graphckpt.plan(model, batch_size=8)
    assert graphckpt.estimate(model, blind, input_shape=(8, 128)).peak_bytes >= p.estimated_peak_bytes


def test_planned_gives_the_plan_with_the_graphs_it_was_made_on():
    """The inspection API the CLI uses: the same plan as `plan`, the model's
    own graph (unknown dimensions kept) and the graph at the real shapes."""
    from graphckpt.api import planned

    model = text_model(blocks=4)
    result = planned(model, input_shape=(8, 128))
    assert result.plan == graphckpt.plan(model, input_shape=(8, 128))
    assert result.unchanged is None
    hidden = [k for k, info in result.graph.tensors.items() if len(info.shape) == 3]
    assert hidden and all(result.graph.tensors[k].shape[1] is None for k in hidden)
    assert all(result.sized_graph.tensors[k].shape[:2] == (8, 128) for k in hidden)
    with pytest.warns(UserWarning, match="checkpoints nothing"):
        planned(model, input_shape=(8, 128), budget="1TiB").warn_if_unchanged(model.name)


def test_a_budget_in_bytes_takes_the_batch_from_input_shape():
    model = text_model()
    base = graphckpt.plan(model, input_shape=(8, 128)).baseline_peak_bytes
    p = graphckpt.plan(model, input_shape=(8, 128), budget=int(0.8 * base))
    assert p.strategy == "budget" and p.batch_size == 8 and p.estimated_peak_bytes <= 0.8 * base


def test_inputs_by_name_and_in_order_are_the_same():
    model = two_input_model()
    by_name = graphckpt.estimate(model, input_shape={"token_ids": (4, 30), "padding_mask": (4, 30)})
    order = [t.name for t in model.inputs]
    in_order = graphckpt.estimate(model, input_shape=[(4, 30) for _ in order])
    assert by_name == in_order
    assert by_name.baseline_peak_bytes > graphckpt.estimate(model, input_shape=[(4, 3), (4, 3)]).baseline_peak_bytes


def test_nested_models_are_estimated_at_the_shapes_they_are_called_with():
    """A text model used as a layer is flattened: its layer calls are
    estimated at the outer call's real shapes, not at its own (None, None)."""
    inner = text_model(name="inner")
    tok = keras.Input((None,), dtype="int32", name="outer_tokens")
    outer = keras.Model(tok, layers.Dense(2)(inner(tok)), name="outer")
    short = graphckpt.estimate(outer, input_shape=(8, 16))
    long = graphckpt.estimate(outer, input_shape=(8, 128))
    assert short.batch_size == long.batch_size == 8

    def attention(estimate):
        calls = [c for c in estimate.calls if c.class_name == "MultiHeadAttention"]
        assert calls and all(c.node[0].startswith("inner/") for c in calls)
        return sum(c.kept_bytes for c in calls)

    assert attention(long) > 8 * attention(short)  # more than linear: the attention scores


# ---------------------------------------------------------------- the checkpointed model


@pytest.mark.backends
def test_checkpointed_model_takes_any_length_and_trains_exactly():
    """Planned for length 64, the rewrite keeps the symbolic shapes: it
    runs, exactly, at other lengths too."""
    model = text_model(blocks=3)
    ck = graphckpt.checkpoint_model(model, input_shape=(4, 64), segments=3)
    assert ck.plan.batch_size == 4
    assert tuple(ck.input.shape) == (None, None)
    for batch, seq in ((4, 64), (2, 7)):
        compare_step(model, ck, tokens(batch, seq))


# ---------------------------------------------------------------- warnings


def test_unknown_dimensions_warn_once_naming_the_inputs_and_the_fix():
    model = two_input_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphckpt.plan(model, batch_size=8)
        ck = graphckpt.checkpoint_model(model, segments=2)
    found = _unknown_warnings(caught)
    assert len(found) == 2  # one per call, not one per tensor or per input
    message = str(found[0].message)
    assert "'token_ids' (None, None)" in message and "'padding_mask' (None, None)" in message
    assert "input_shape=" in message and "--input-shape" in message
    assert found[0].filename == found[1].filename == __file__  # points at the caller's line
    assert isinstance(ck, graphckpt.CheckpointedModel)
    with pytest.warns(UnknownDimensionWarning) as record:
        graphckpt.estimate(model)
    assert [w.filename for w in record] == [__file__]


def test_no_warning_with_input_shape_or_known_dimensions():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownDimensionWarning)
        graphckpt.plan(text_model(), input_shape=(2, 16))
        graphckpt.plan(chain_model(), batch_size=4)
        graphckpt.estimate(chain_model())


# ---------------------------------------------------------------- bad shapes


@pytest.mark.parametrize(
    "build, bad, words",
    [
        (text_model, (8,), "rank 2"),
        (text_model, (8, 512, 3), "rank 2"),
        (text_model, [(8, 512), (8, 512)], "2 shape(s) for 1 input(s)"),
        (text_model, {"ids": (8, 512)}, "unknown input name(s) ['ids']"),
        (text_model, (8, 512.0), "dimension 1 of input 'tokens' is 512.0"),
        (text_model, (8, "512"), "dimension 1 of input 'tokens' is '512'"),
        (text_model, (8, True), "dimension 1 of input 'tokens' is True"),
        (text_model, (8, 0), "must be a positive int"),
        (text_model, (8, None), "must be a positive int"),
        (text_model, "8,512", "expected a shape tuple"),
        (chain_model, (8, 9), "fixes dimension 1 at 8"),
        (two_input_model, (8, 512), "one shape for 2 inputs"),
        (two_input_model, {"token_ids": (8, 512)}, "no shape for input 'padding_mask'"),
        (two_input_model, [(8, 512), (4, 512)], "batch dimensions differ"),
    ],
)
@pytest.mark.parametrize("entry", ["plan", "checkpoint_model", "estimate"])
def test_a_wrong_input_shape_is_one_clear_error(build, bad, words, entry):
    model = build()
    x = tokens(2, 3) if build is text_model else None
    snap = Snapshot(model, x) if x is not None else None
    with pytest.raises(graphckpt.InvalidArgumentError) as info:
        getattr(graphckpt, entry)(model, input_shape=bad)
    message = str(info.value)
    assert words in message
    assert f"input_shape={bad!r}" in message and "Tip:" in message
    if snap is not None:
        snap.assert_untouched(model, nodes=True)


@pytest.mark.parametrize("entry", ["plan", "checkpoint_model", "estimate"])
def test_input_shape_and_batch_size_must_agree(entry):
    model = text_model()
    with pytest.raises(graphckpt.InvalidArgumentError, match=r"two batch sizes: 8 .* batch_size=4"):
        getattr(graphckpt, entry)(model, input_shape=(8, 64), batch_size=4)
    # Agreeing is fine.
    getattr(graphckpt, entry)(model, input_shape=(8, 64), batch_size=8)


def test_a_bad_batch_size_is_named_before_it_is_compared():
    with pytest.raises(graphckpt.InvalidArgumentError, match="batch_size"):
        graphckpt.plan(text_model(), input_shape=(8, 64), batch_size="8")


def test_parse_input_shape_fills_the_batch():
    graph = build_graph(two_input_model())
    shapes, batch = parse_input_shape(graph, {"token_ids": (None, 5), "padding_mask": (None, 5)}, 3)
    assert batch == 3 and shapes == [(3, 5), (3, 5)]


# ---------------------------------------------------------------- the fit flag


def _twin_plan(model):
    from graphckpt.training.flag import _CACHE_ATTR

    (twin,) = model.__dict__[_CACHE_ATTR].twins.values()
    return twin.model.plan


def _fitted(data_kwargs, flag=True):
    keras.utils.set_random_seed(5)
    model = text_model(blocks=3)
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(**data_kwargs, epochs=1, shuffle=False, verbose=0, gradient_checkpointing=flag)
    return model, history, _unknown_warnings(caught)


def test_fit_flag_plans_from_the_arrays_it_trains_on(installed):
    x, y = tokens(12, 40), np.zeros((12, 40, VOCAB), "float32")
    model, history, unknown = _fitted(dict(x=x, y=y, batch_size=4))
    assert unknown == []
    expected = graphckpt.plan(model, input_shape=(4, 40))
    assert _twin_plan(model).segments == expected.segments
    assert expected.estimated_peak_bytes > graphckpt.estimate(model, expected, input_shape=(4, 1)).peak_bytes
    # The same training as plain fit.
    keras.utils.set_random_seed(5)
    plain = text_model(blocks=3)
    plain.compile(optimizer="sgd", loss="mse")
    h0 = plain.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], h0.history["loss"], rtol=1e-5)


def test_fit_flag_plans_from_a_dataset_element_spec(installed):
    import tensorflow as tf

    x, y = tokens(12, 24), np.zeros((12, 24, VOCAB), "float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(6, drop_remainder=True)
    model, _, unknown = _fitted(dict(x=ds))
    assert unknown == []
    assert _twin_plan(model).segments == graphckpt.plan(model, input_shape=(6, 24)).segments


def test_fit_flag_with_a_generator_falls_back_and_warns(installed):
    def batches():
        while True:
            yield tokens(4, 16), np.zeros((4, 16, VOCAB), "float32")

    _, _, unknown = _fitted(dict(x=batches(), steps_per_epoch=2))
    assert len(unknown) == 1 and "fit flag" in str(unknown[0].message)


# ---------------------------------------------------------------- the CLI


def test_cli_parses_input_shapes():
    assert cli.parse_input_shapes(["8,512"]) == (8, 512)
    assert cli.parse_input_shapes(["8,512", "8, 512"]) == [(8, 512), (8, 512)]
    assert cli.parse_input_shapes(["token_ids=8,512", "padding_mask=8,512"]) == {
        "token_ids": (8, 512),
        "padding_mask": (8, 512),
    }
    assert cli.parse_input_shapes(["None,512"]) == (None, 512)
    assert cli.parse_input_shapes(None) is None
    for bad in (["8x512"], ["8,abc"], ["a=8,1", "8,1"], ["a=1,2", "a=1,2"], [""]):
        with pytest.raises(cli.CliError) as info:
            cli.parse_input_shapes(bad)
        assert info.value.code == 2


def test_cli_inspect_with_input_shape(capsys, tmp_path):
    path = tmp_path / "text.keras"
    text_model().save(path)
    code = cli.main(["inspect", str(path), "--input-shape", "8,128", "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    import json

    info = json.loads(out)
    assert info["batch_size"] == 8
    shapes = [b["shape"] for s in info["segments"] for b in s["boundary"]]
    assert [8, 128, 16] in shapes  # real shapes, batch included
    expected = graphckpt.plan(keras.saving.load_model(path), input_shape=(8, 128))
    assert info["totals"]["plan_bytes"] == expected.estimated_peak_bytes
    assert "warning" not in err

    code = cli.main(["inspect", str(path), "--batch-size", "8"])
    _, err = capsys.readouterr()
    assert code == 0
    (line,) = [l for l in err.splitlines() if l.startswith("graphckpt: warning:")]  # one line, once
    assert "'tokens' (None, None)" in line and "--input-shape" in line

    code = cli.main(["inspect", str(path), "--input-shape", "8,128", "--batch-size", "4"])
    _, err = capsys.readouterr()
    assert code == 2 and "two batch sizes" in err
    code = cli.main(["inspect", str(path), "--input-shape", "8,12,3"])
    _, err = capsys.readouterr()
    assert code == 2 and "rank 2" in err


def test_measure_builds_random_batches_of_the_input_shape():
    """What `graphckpt measure --input-shape` trains on: inputs of the given
    shape, targets of the shape the model outputs for them."""
    from graphckpt.measure.child import _random_batch

    model = text_model()
    x, y = _random_batch(model, 4, 0, (4, 33))
    assert x.shape == (4, 33) and y.shape == (4, 33, VOCAB)
    x, y = _random_batch(model, 4, 0)  # without: length 1, as before
    assert x.shape == (4, 1)
    ck = graphckpt.checkpoint_model(model, input_shape=(4, 33), segments=2)
    x, y = _random_batch(ck, 4, 0, [[4, 33]])  # JSON spells tuples as lists
    assert y.shape == (4, 33, VOCAB)


# ---------------------------------------------------------------- keras_hub


def test_gpt2_backbone_plans_and_trains_exactly_at_real_shapes():
    keras_hub = pytest.importorskip("keras_hub")
    model = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=2, hidden_dim=32, intermediate_dim=64, max_sequence_length=64
    )
    shape = {"token_ids": (2, 64), "padding_mask": (2, 64)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownDimensionWarning)  # every shape found
        real = graphckpt.estimate(model, input_shape=shape)
        ck = graphckpt.checkpoint_model(model, input_shape=shape, segments=2)
    short = graphckpt.estimate(model, input_shape={"token_ids": (2, 8), "padding_mask": (2, 8)})
    assert real.baseline_peak_bytes > 2 * short.baseline_peak_bytes
    sized, _ = sized_graph(build_graph(model), shape)
    assert [sized.tensors[k].shape for k in sized.outputs] == [(2, 64, 32)]
    x = {"token_ids": tokens(2, 64), "padding_mask": np.ones((2, 64), "int32")}
    compare_step(model, ck, x)


def test_the_former_home_of_the_warning_is_a_deprecated_alias():
    """`graphckpt.shapes.UnknownDimensionWarning` (documented before the
    modules moved into packages) still names the same class, with a
    DeprecationWarning that says what to use."""
    import importlib
    import sys

    sys.modules.pop("graphckpt.shapes", None)
    with pytest.warns(DeprecationWarning, match="graphckpt.UnknownDimensionWarning"):
        alias = importlib.import_module("graphckpt.shapes")
    assert alias.UnknownDimensionWarning is graphckpt.UnknownDimensionWarning
    assert issubclass(graphckpt.UnknownDimensionWarning, graphckpt.GraphckptWarning)
