"""What a new user meets in the first hour (issue 39): a compiled model
given to `checkpoint_model`, what `Plan.summary()`, `ck.summary()` and
`dir(graphckpt)` show, and how graphckpt's warnings are told apart."""

import warnings

import keras
import numpy as np
import pytest
from keras import layers

import graphckpt
from tests import models

X = np.random.default_rng(0).normal(size=(16, 8)).astype("float32")
Y = np.random.default_rng(1).normal(size=(16, 2)).astype("float32")  # models.chain ends in a Dense(2)


def test_a_compiled_model_gives_a_compiled_checkpointed_model():
    """`fit` on the result used to fail with Keras's "You must call
    `compile()`": the compile arguments carry over, the optimizer object
    itself included, so training goes on with its state."""
    model = models.chain(depth=8, width=8)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(X, Y, epochs=1, verbose=0)  # the optimizer has state now
    steps = int(model.optimizer.iterations)
    ck = graphckpt.checkpoint_model(model, segments=3)
    assert ck.compiled and ck.optimizer is model.optimizer and ck.loss == "mse"
    history = ck.fit(X, Y, epochs=1, verbose=0)
    assert set(history.history) == {"loss", "mae"}
    assert int(model.optimizer.iterations) == steps + 1
    # Not compiled in, not compiled out.
    assert not graphckpt.checkpoint_model(models.chain(depth=8, width=8), segments=3).compiled


def test_plan_summary_counts_in_words():
    inp = keras.Input((8,))
    x = inp
    for i in range(4):
        x = layers.Dense(8, name=f"d{i}")(x)
    p = graphckpt.plan(keras.Model(inp, x), segments=3, batch_size=2)  # 4 calls: one segment of 1 call
    text = p.summary()
    assert "1 calls" not in text and "1 tensors" not in text
    one_call = [line for line in text.splitlines() if " 1 call," in line]
    assert one_call, text
    for line in one_call:  # one name, not `d0 .. d0`
        assert ".." not in line, line


def test_dir_lists_the_public_names_not_the_modules_it_imports():
    names = dir(graphckpt)
    assert not {"importlib", "sys", "types"} & set(names)
    assert set(graphckpt.__all__) <= set(names)
    assert {"fit", "GraphckptWarning"} <= set(graphckpt.__all__)


def test_checkpointed_summary_explains_its_output_name_layer():
    model = models.chain(depth=6, width=8)
    ck = graphckpt.checkpoint_model(model, segments=2)  # all recomputed: the output is made in a segment
    output_names = [layer.name for layer in ck.layers if type(layer).__name__ == "OutputName"]
    assert output_names
    lines = []
    ck.summary(print_fn=lines.append)
    text = "\n".join(lines)
    assert f"{output_names[0]} (OutputName): the output '{output_names[0]}'" in text
    assert "it computes nothing" in text


@pytest.mark.parametrize("fraction, expected", [(0.76, "about 76% of its time"), (1.02, "about 1.02x its time")])
def test_recompute_time_above_one_forward_pass_reads_as_a_multiple(fraction, expected):
    """"87% of the forward FLOPs, about 102% of its time" read as a
    contradiction: each recomputed segment's overhead comes on top."""
    from graphckpt.cli.report import recompute_phrase

    phrase = recompute_phrase({"recompute_fraction": 0.87, "recompute_time_fraction": fraction})
    assert phrase.startswith("87% of the forward FLOPs, ")
    assert expected in phrase and "102%" not in phrase


def test_graphckpt_warnings_are_graphckpt_warnings():
    """Users (and the CLI) tell graphckpt's warnings from others' by class."""
    tokens = keras.Input((None,), dtype="int32", name="token_ids")
    lm = keras.Model(tokens, layers.Dense(4)(layers.Embedding(50, 8)(tokens)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphckpt.plan(lm, batch_size=2)  # unknown sequence length
        inp = keras.Input((3,))
        graphckpt.checkpoint_model(keras.Model(inp, layers.Dense(1)(inp)))  # one call: returned unchanged
    assert caught and all(issubclass(w.category, graphckpt.GraphckptWarning) for w in caught), [
        (w.category, str(w.message)[:60]) for w in caught
    ]
    assert issubclass(graphckpt.GraphckptWarning, UserWarning)
