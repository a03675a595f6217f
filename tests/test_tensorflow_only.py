"""TensorFlow-only exactness extras; the exactness suite for every backend
is tests/test_backends.py (which also runs on TensorFlow).

Here: what the traced graph holds (the recomputed MatMuls) and the weights
a recompute reads.
"""

import numpy as np
import pytest
import tensorflow as tf

import graphckpt
from graphckpt.runtime.segment import Segment
from tests import models

MODES = pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])


def _ancestors(op, control=True):
    """Name -> op of every op `op` depends on in its graph: through its
    inputs, and through its control inputs unless `control` is false."""
    seen, todo = {}, [op]
    while todo:
        current = todo.pop()
        parents = [t.op for t in current.inputs] + (list(current.control_inputs) if control else [])
        for parent in parents:
            if parent.name not in seen:
                seen[parent.name] = parent
                todo.append(parent)
    return seen


@MODES
def test_recompute_uses_the_weights_the_forward_pass_read(graph):
    """Weights written between the forward pass and the backward pass (an
    optimizer update the executor runs early) do not reach the recompute:
    it uses the forward pass's reads, as the plain model's backward pass
    does. Reading the variables again in the backward pass let TensorFlow's
    executor run a step's weight update before a recompute, now and then,
    under load: a wrong gradient (issue 14)."""
    model = models.chain(depth=6)
    ck = graphckpt.checkpoint_model(model, segments=3)
    x = tf.constant(np.random.default_rng(0).normal(size=(4, 16)).astype("float32"))
    variables = model.trainable_variables
    start = [v.numpy() for v in variables]

    def grads_after_a_write(m):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(m(x, training=True) ** 2)
        for v in variables:
            v.assign(v * 2.0)
        return tape.gradient(loss, variables)

    def run(m):
        for v, value in zip(variables, start):
            v.assign(value)
        step = tf.function(grads_after_a_write) if graph else grads_after_a_write
        return [g.numpy() for g in step(m)]

    want, got = run(model), run(ck)
    assert [s.forward_calls for s in ck.layers if isinstance(s, Segment)][0] == 2  # recomputed
    for v, a, b in zip(variables, got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7, err_msg=f"gradient of {v.path}")


def _count_ops(concrete, op_type):
    graphs = [concrete.graph] + [f.graph for f in concrete.graph._functions.values() if hasattr(f, "graph")]
    count = 0
    for g in graphs:
        count += sum(op.type == op_type for op in g.get_operations())
    return count


def test_recompute_really_happens_in_graph():
    """The traced training step holds more MatMuls: the recomputed forward."""

    def traced(model):
        @tf.function
        def step(x):
            with tf.GradientTape() as tape:
                y = model(x, training=True)
            return tape.gradient(y, model.trainable_variables)

        return step.get_concrete_function(tf.TensorSpec((2, 16)))

    model = models.chain(depth=12)
    ck = graphckpt.checkpoint_model(model, segments=3)
    plain = _count_ops(traced(model), "MatMul")
    ours = _count_ops(traced(ck), "MatMul")
    assert plain == 3 * 13 - 1  # forward + 2 backward per Dense, none for d(loss)/d(x)
    # Plus one recomputed forward per Dense, plus d/dx of the first segment,
    # which tf.recompute_grad computes for every argument.
    assert ours == plain + 13 + 1


def test_tf_tie_keeps_every_value_and_waits_for_the_gradients():
    """The tie that orders a segment's recompute after its incoming
    gradients (`graphckpt.runtime.remat_tensorflow.tf_tie`): values bit for bit (-0.0, NaN,
    inf, integers), and the tied tensor computed from the gradients, so
    that neither the executor nor XLA runs the recompute in the forward
    pass."""
    import tensorflow as tf

    from graphckpt.runtime.remat_tensorflow import tf_tie

    x = tf.constant([-0.0, 0.0, float("nan"), float("inf"), -1.5])
    ids = tf.constant([3, 0, 7])
    grads = [tf.constant([[0.0, 2.0]]), None, tf.constant([1], tf.int32), tf.constant([-0.0])]
    tied_x, tied_ids = tf_tie([x, ids], grads)
    np.testing.assert_array_equal(tf.bitcast(tied_x, tf.int32).numpy(), tf.bitcast(x, tf.int32).numpy())
    np.testing.assert_array_equal(tied_ids.numpy(), ids.numpy())
    assert tf_tie([x], [None, tf.constant([1])])[0] is x  # no floating gradient: nothing to tie to
    # A gradient with no elements (an output with a zero dimension), its
    # size known only at run time: still a tie, and the values kept.
    run_time_size = tf.function(lambda x, g: tf_tie([x], [g])[0])
    empty = tf.zeros([0, 4])
    np.testing.assert_array_equal(run_time_size.get_concrete_function(
        tf.TensorSpec([5]), tf.TensorSpec([None, 4]))(x, empty).numpy().view(np.int32), x.numpy().view(np.int32))

    @tf.function
    def tied(x, g):
        return tf_tie([x], [g])[0]

    graph = tied.get_concrete_function(tf.TensorSpec([5]), tf.TensorSpec([2, 2])).graph
    seen = _ancestors(graph.outputs[0].op, control=False)
    assert {t.op.name for t in graph.inputs} <= seen.keys()  # both x and the gradient reach the output


def test_a_recompute_reads_nothing_before_the_gradient_exists():
    """What a segment closes over (its seed snapshot, its integer inputs)
    is tied to the incoming gradients in the recompute, as its float inputs
    are: otherwise the executor computes every segment's dropout masks and
    embedding lookups as soon as the backward pass begins and holds them
    until their segment's turn (GPT-2 with dropout: about 17 MiB more per
    segment). In the traced step, each random draw and each lookup comes
    twice, once in the forward pass and once in the recompute, and the
    recompute's has the tie (`tf_tie`'s Bitcast of a gradient) among its
    ancestors."""
    import keras

    ids = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(20, 8)(ids)
    for _ in range(2):
        x = keras.layers.Dense(8, activation="tanh")(x)
        x = keras.layers.Dropout(0.5, seed=1)(x)
    model = keras.Model(ids, keras.layers.Dense(1)(x))
    ck = graphckpt.checkpoint_model(model, segments=2)  # both recomputed

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            y = ck(ids, training=True)
        return tape.gradient(y, ck.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec((4, 6), tf.int32)).graph

    def tied(op):  # a data dependency on the gradients
        return any(a.type == "Bitcast" for a in _ancestors(op, control=False).values())

    for kind in ("StatelessRandomUniformV2", "ResourceGather", "GatherV2"):
        ops = [op for op in graph.get_operations() if op.type == kind]
        if not ops:
            continue
        recomputed = [op for op in ops if tied(op)]
        assert 2 * len(recomputed) == len(ops), (kind, len(recomputed), len(ops))
    kinds = {op.type for op in graph.get_operations()}
    assert "StatelessRandomUniformV2" in kinds and kinds & {"ResourceGather", "GatherV2"}


def test_tanh_gelu_rule_counts_what_tensorflow_keeps():
    """keras_hub's GPT-2 and BERT blocks use `gelu_approximate` (the tanh
    form), whose gradient reads four buffers of the Dense output's size
    (Tanh, Pow, Mul, AddV2): counted exactly in the traced gradient graph,
    as tests/test_rule_saved_bytes.py counts the registered classes. The
    rule for an unknown activation (its output and one buffer) counted
    two, and a GPT-2 baseline came out 25% under its measured peak."""
    import keras

    from tests import layer_probes

    def gelu_approximate(x):  # keras_hub's name for it
        return keras.activations.gelu(x, approximate=True)

    spec = ("seq", lambda: keras.layers.Dense(256, activation=gelu_approximate))
    measured = layer_probes.measured_per_example(spec, np.random.default_rng(0))
    estimated, io = layer_probes.estimated_per_example(spec)
    assert abs(estimated - measured) <= 0.2 * io + 0.2 * measured, (estimated, measured, io)


def test_a_segments_forward_pass_waits_for_its_inputs():
    """In a graph, what a segment's forward pass closes over (an integer
    input that a causal mask is made from) reaches its ops only after the
    segment's inputs exist, by a control dependency: TensorFlow's executor
    otherwise made every segment's mask at the step's start and held them
    all. Eagerly, nothing is tied."""
    import tensorflow as tf

    from graphckpt.runtime.remat_tensorflow import tf_remat

    ids = tf.constant([[1, 2, 0]])
    seen = {}

    def f(x, tie=list):
        (tied,) = tie([ids])
        seen["tied"] = tied
        return (x * tf.cast(tied, x.dtype),)

    @tf.function
    def forward(x):
        return tf_remat(f, 1)(x)

    x = tf.constant([[1.0, 2.0, 3.0]])
    concrete = forward.get_concrete_function(x)
    inputs = {op.name for op in concrete.graph.get_operations() if op.type == "Placeholder"}
    assert seen["tied"].op.type == "Identity"
    assert inputs & set(_ancestors(seen["tied"].op))  # the segment's input comes first
    assert not inputs & set(_ancestors(seen["tied"].op, control=False))  # by order only: no data
    np.testing.assert_array_equal(forward(x)[0].numpy(), [[1.0, 4.0, 0.0]])
    tf_remat(f, 1)(x)
    assert seen["tied"] is ids


def test_ops_made_from_no_input_wait_for_the_segment_and_for_the_gradients():
    """keras_hub's causal mask is a range broadcast to batch x seq x seq:
    an op with no input at all, ready when the step starts. In a segment's
    forward pass it waits for the segment's inputs, and in its recompute
    for the incoming gradient (control dependencies); without them
    TensorFlow made every segment's mask at the start and held them (the
    LoRA twin at 1280 tokens: 1.16 GiB, 628 MiB with them)."""
    import tensorflow as tf

    from graphckpt.runtime.remat_tensorflow import tf_remat

    made = []

    def f(x, tie=list):
        made.append(tf.range(3, dtype=x.dtype))
        return (x * made[-1],)

    @tf.function
    def step(x, gradient):
        with tf.GradientTape() as tape:
            tape.watch(x)
            (y,) = tf_remat(f, 1)(x)
        return y, tape.gradient(y, x, output_gradients=gradient)

    spec = tf.TensorSpec([1, 3])
    concrete = step.get_concrete_function(spec, spec)
    x, gradient = (t.op.name for t in concrete.graph.inputs[:2])
    forward, recompute = made
    assert x in _ancestors(forward.op)
    assert gradient not in _ancestors(forward.op)
    assert gradient in _ancestors(recompute.op)
    y, g = step(tf.constant([[1.0, 2.0, 3.0]]), tf.constant([[1.0, 1.0, 1.0]]))
    np.testing.assert_array_equal(y.numpy(), [[0.0, 2.0, 6.0]])
    np.testing.assert_array_equal(g.numpy(), [[0.0, 1.0, 2.0]])


def test_closed_over_values_wait_for_the_gradients():
    """`tf_tie_closed`, what a segment's recompute closes over: small
    integers of known size (seed states) by `tf_tie`'s select (the values
    kept), everything else (frozen weights, an integer input of any size)
    by a control dependency, which copies nothing. All reach the output
    only after the gradient."""
    import tensorflow as tf

    from graphckpt.runtime.remat_tensorflow import tf_tie_closed

    @tf.function
    def tied(weights, seed, mask, words, gradient):
        return tf_tie_closed([weights, seed, mask, words], [gradient])

    concrete = tied.get_concrete_function(
        tf.TensorSpec([3, 3]),
        tf.TensorSpec([2], tf.int64),
        tf.TensorSpec([None, 64, 64], tf.int32),
        tf.TensorSpec([2], tf.string),  # no select for strings: a control dependency
        tf.TensorSpec([2]),
    )
    gradient = concrete.graph.inputs[4].op.name
    for out in concrete.graph.outputs:
        assert gradient in _ancestors(out.op)
    selects = [op for op in concrete.graph.get_operations() if op.type == "SelectV2"]
    assert len(selects) == 1 and selects[0].outputs[0].dtype == tf.int64  # only the seed is copied
    w, seed, mask = tf.random.normal([3, 3]), tf.constant([5, 9], tf.int64), tf.ones([2, 64, 64], tf.int32)
    words = tf.constant(["a", "b"])
    for got, want in zip(tied(w, seed, mask, words, tf.ones([2])), (w, seed, mask, words)):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
