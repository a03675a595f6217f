"""Property: on any valid functional model, the checkpointed model computes
the same function as the original.

For every generated model (see `tests/strategies.py`), for the sqrt plan and
for a random segment count, the checkpointed model has:
- the same output structure and outputs (training=False);
- from the same variable state, the same loss, outputs, gradients and
  updated non-trainable state after one training step (training=True),
  in eager mode or in tf.function (drawn per example);
- the very same variables, a valid plan, and no Segment inside a Segment.

CI runs 25 fixed (derandomized) examples. The slow run draws
`GRAPHCKPT_FUZZ_EXAMPLES` (default 300) fresh ones:

    GRAPHCKPT_FUZZ_EXAMPLES=1000 pytest -m slow tests/test_fuzz.py \
        --hypothesis-show-statistics
"""

import os
import warnings

import keras
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import graphckpt
from graphckpt.graph.build import build_graph
from graphckpt.planner import validate_plan
from graphckpt.runtime.segment import Segment
from tests.helpers import compare_inference, compare_step
from tests.models import sample_inputs
from tests.strategies import build_model, describe, model_specs

SLOW_EXAMPLES = int(os.environ.get("GRAPHCKPT_FUZZ_EXAMPLES", "300"))
_COMMON = dict(
    deadline=None,
    # Building Keras models is slow; the autouse seed fixture is re-applied
    # by hand in each example.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


def _checkpointed(model, segments):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ck = graphckpt.checkpoint_model(model, segments=segments)
    if ck is model:  # fewer than 2 layer calls: returned as is, with a warning
        assert any("nothing worth checkpointing" in str(w.message) for w in caught)
    return ck


def _check_structure(model, ck, segments):
    if ck is model:
        return
    the_plan = graphckpt.plan(model, segments=segments)
    validate_plan(build_graph(model), the_plan)
    segs = [layer for layer in ck.layers if isinstance(layer, Segment)]
    assert len(segs) == sum(s.remat for s in the_plan.segments)
    for seg in segs:
        inner = seg.model._flatten_layers(include_self=False)
        assert not any(isinstance(layer, Segment) for layer in inner), "a Segment inside a Segment"
    ours = {id(v) for v in ck.variables}
    assert ours == {id(v) for v in model.variables}, "checkpointed model has other variables"


def _same_structure(model, ck, x):
    a, b = model(x, training=False), ck(x, training=False)
    keras.tree.assert_same_structure(a, b)
    if isinstance(a, dict):
        assert list(a) == list(b)


def check_model_spec(spec, data):
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    note(f"architecture:\n{describe(spec)}")
    model = build_model(spec)
    x = sample_inputs(model, batch=3)
    n = len(graphckpt.plan(model, segments=1).order)
    k = data.draw(st.integers(1, n), label="segments (random count)")
    graph = data.draw(st.booleans(), label="tf.function")
    for segments in ("sqrt", k):
        note(f"checking segments={segments!r} of {n} layer calls, {'tf.function' if graph else 'eager'}")
        ck = _checkpointed(model, segments)
        _check_structure(model, ck, segments)
        _same_structure(model, ck, x)
        compare_inference(model, ck, x)
        # A variable the original gives no gradient (behind an unused output
        # of a nested model) gets none from the checkpointed model either.
        compare_step(model, ck, x, compiled=graph, unconnected="same")


@settings(max_examples=12, derandomize=True, database=None, **_COMMON)
@given(spec=model_specs(), data=st.data())
def test_checkpointed_model_is_the_same_function(spec, data):
    check_model_spec(spec, data)


@pytest.mark.slow
@settings(max_examples=SLOW_EXAMPLES, **_COMMON)
@given(spec=model_specs(), data=st.data())
def test_checkpointed_model_is_the_same_function_slow(spec, data):
    check_model_spec(spec, data)


# ------------------------------------------------- regressions the fuzzer found


def _long_and_short_branch(short_first):
    """One Dropout and one BatchNormalization, each called in a long branch
    and in a short one. Keras runs the call deeper from the outputs first,
    which is not the order the planner's ASAP order would choose."""
    drop = keras.layers.Dropout(0.5, name="shared_dropout")
    bn = keras.layers.BatchNormalization(name="shared_bn")
    x = keras.Input((4,))
    if short_first:
        short = bn(drop(x))
    y = keras.layers.Dense(4, name="a")(x)
    y = bn(drop(y))
    for i in range(4):
        y = keras.layers.Dense(4, activation="tanh", name=f"long{i}")(y)
    if not short_first:
        short = bn(drop(x))
    return keras.Model(x, [y, keras.layers.Dense(4, name="head")(short)])


def _two_parallel_branches():
    """Two branches through one BatchNormalization, then one Dropout: in a
    segment holding both BN calls, Keras's depth order inside the segment's
    sub-model ran them the other way round."""
    drop = keras.layers.Dropout(0.5, name="shared_dropout")
    bn = keras.layers.BatchNormalization(name="shared_bn")
    x = keras.Input((4,))
    h = drop(x)
    left = keras.layers.Dense(4, name="out_left")(bn(keras.layers.Dense(4, name="left")(h)))
    right = drop(bn(keras.layers.Dense(4, name="right")(h)))
    return keras.Model(x, [right, left, h])


def _unseeded_noise_in_two_branches():
    """Two Lambda layers drawing from Keras's global seed generator
    (`seed=None`): no layer owns that state, yet the draws depend on the
    order of the calls."""

    def noise(name):
        return keras.layers.Lambda(lambda t: t + keras.random.normal(keras.ops.shape(t)), name=name)

    x = keras.Input((4,))
    y = noise("noise_long")(keras.layers.Dense(4, name="b")(keras.layers.Dense(4, name="a")(x)))
    for i in range(4):
        y = keras.layers.Dense(4, activation="tanh", name=f"long{i}")(y)
    return keras.Model(x, [y, keras.layers.Dense(4, name="head")(noise("noise_short")(x))])


# name -> (model, number of state chains)
SHARED_STATE_MODELS = {
    "long branch first": (lambda: _long_and_short_branch(False), 2),
    "short branch first": (lambda: _long_and_short_branch(True), 2),
    "parallel branches": (_two_parallel_branches, 2),
    "global seed generator": (_unseeded_noise_in_two_branches, 1),
}


@pytest.mark.parametrize("name", sorted(SHARED_STATE_MODELS))
def test_calls_sharing_state_run_in_the_original_order(name):
    """Found by the fuzzer: with a shared Dropout or BatchNormalization in
    independent branches, the checkpointed model ran the calls in another
    order (the planner's ASAP order, then Keras's depth order inside each
    segment and between segments), so the calls drew each other's masks and
    the moving statistics came out differently. The same held for Lambda
    layers drawing from the global seed generator."""
    build, chains = SHARED_STATE_MODELS[name]
    model = build()
    x = sample_inputs(model, batch=3)
    n = len(graphckpt.plan(model, segments=1).order)
    graph = build_graph(model)
    assert len(graph.state_chains) == chains
    for k in range(1, n + 1):
        validate_plan(graph, graphckpt.plan(model, segments=k))
        compare_step(model, graphckpt.checkpoint_model(model, segments=k), x)


def _nested_with_unused_output():
    inner_in = keras.Input((4,))
    unused = keras.layers.Dense(4, name="unused_head")(inner_in)
    block = keras.Model(inner_in, [unused, keras.layers.Dense(4, name="used")(inner_in)], name="block")
    x = keras.Input((4,))
    _, h = block(keras.layers.Dense(4)(x))
    for _ in range(3):
        h = keras.layers.Dense(4, activation="tanh")(h)
    return keras.Model(x, h)


def _nested_ignoring_an_input():
    """`ignored` feeds only an input the nested block does not read; with
    enough segments it is cut into an earlier segment than the block."""
    a, b = keras.Input((4,)), keras.Input((4,))
    block = keras.Model([a, b], keras.layers.Dense(4, name="reads_b")(b), name="block")
    x = keras.Input((4,))
    ignored = keras.layers.Dense(4, name="ignored")(keras.layers.Dense(4, name="also_ignored")(x))
    h = keras.layers.Dense(4)(x)
    h = block([ignored, keras.layers.Dense(4)(h)])
    for _ in range(3):
        h = keras.layers.Dense(4, activation="tanh")(h)
    return keras.Model(x, h)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("build", [_nested_with_unused_output, _nested_ignoring_an_input])
def test_variables_the_loss_does_not_reach_get_no_gradient(build, graph):
    """Found by the fuzzer. The original gives `unused_head` (behind an
    unused output of a nested model), or `ignored` (feeding an input a
    nested model does not read), no gradient: None, which optimizers skip.
    TensorFlow's remat gave zeros instead, which an optimizer with weight
    decay applies."""
    model = build()
    x = sample_inputs(model, batch=3)
    n = len(graphckpt.plan(model, segments=1).order)
    for k in range(1, n + 1):
        compare_step(model, graphckpt.checkpoint_model(model, segments=k), x, compiled=graph, unconnected="same")


def _stop_gradient_inside():
    x = keras.Input((4,))
    frozen = keras.layers.Dense(4, name="frozen_by_stop_gradient")(x)
    h = keras.layers.Add()([keras.layers.Dense(4)(x), keras.ops.stop_gradient(frozen)])
    for _ in range(3):
        h = keras.layers.Dense(4, activation="tanh")(h)
    return keras.Model(x, h)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_variable_behind_stop_gradient_gets_no_gradient(graph):
    """Found with the fuzzer's cases above: a variable whose only path to
    the loss goes through stop_gradient inside a segment got zeros from the
    remat (tf.recompute_grad fills unconnected gradients with zeros); the
    original gives None."""
    model = _stop_gradient_inside()
    x = sample_inputs(model, batch=3)
    compare_step(model, graphckpt.checkpoint_model(model, segments=1), x, compiled=graph, unconnected="same")


@pytest.mark.xfail(
    strict=True,
    reason="known gap: when stop_gradient (or another op without gradient) is in a later segment than "
    "the variable, the earlier segment's output gets a zero upstream gradient, not None, so the variable "
    "gets zeros",
)
def test_variable_behind_stop_gradient_in_a_later_segment_gets_no_gradient():
    model = _stop_gradient_inside()
    x = sample_inputs(model, batch=3)
    n = len(graphckpt.plan(model, segments=1).order)
    for k in range(2, n + 1):
        compare_step(model, graphckpt.checkpoint_model(model, segments=k), x, unconnected="same")
