"""The estimator: per-layer rules, batch handling, FLOPs, and consistency
with the planner's memory model. No measurement here (see
benchmarks/calibrate.py and docs/estimator.md for estimated vs measured)."""

import dataclasses
import math

import keras
import pytest
from keras import layers

import graphckpt
from graphckpt.estimator import cost_model
from graphckpt.estimator.keras_rules import is_expensive
from graphckpt.estimator.peak import (
    call_estimates,
    estimate,
    node_costs,
    resolve_batch_size,
)
from graphckpt.graph.build import build_graph
from graphckpt.planner import plan_from_boundaries, segment_peaks, topological_order
from tests import models

F = 4  # bytes per float32


def one_call(layer, shape, batch=None):
    """Input -> Dense(linear) -> layer -> Dense(linear): the rule of `layer`
    is read from the middle call."""
    inp = keras.Input(shape, batch_size=batch)
    x = layers.Dense(shape[-1])(inp)
    y = layer(x)
    model = keras.Model(inp, layers.Dense(2)(y))
    calls = {c.node[0]: c for c in call_estimates(build_graph(model), batch)}
    return calls[layer.name], calls


def n_elems(shape):
    out = 1
    for d in shape:
        out *= d
    return out


@pytest.mark.parametrize(
    "activation, kept_tensors",
    [
        ("linear", 1),  # only its output, which the next Dense keeps
        ("tanh", 1),  # tanh's gradient reads its output: the same tensor
        ("relu", 1),
        ("sigmoid", 1),
        ("gelu", 4),  # the output, plus pre-activation and two temporaries
        ("swish", 2),
    ],
)
def test_dense_with_fused_activation(activation, kept_tensors):
    call, _ = one_call(layers.Dense(32, activation=activation), (32,))
    assert call.kept_bytes == kept_tensors * 32 * F
    assert call.flops == 2 * 32 * 32
    assert call.expensive


def test_dense_keeps_its_input_on_the_producer():
    call, calls = one_call(layers.Dense(32), (16,))
    first = next(c for name, c in calls.items() if name not in (call.node[0],) and c.kept_bytes == 16 * F)
    assert first.rule == "matmul"  # the first Dense's output is kept: the middle Dense reads it


def test_dropout_keeps_a_one_byte_mask_and_no_copy_of_its_input():
    call, _ = one_call(layers.Dropout(0.3), (100,))
    assert call.kept_bytes == 100 + 100 * F  # mask + its output (read by the next Dense)
    off, _ = one_call(layers.Dropout(0.0), (100,))
    assert off.kept_bytes == 100 * F


def test_normalization_and_pooling_rules():
    bn, calls = one_call(layers.BatchNormalization(), (8, 8, 4))
    assert bn.kept_bytes == 8 * 8 * 4 * F  # its output, read by the next Dense
    producer = [c for c in calls.values() if c.node[0] != bn.node[0]][0]
    assert producer.kept_bytes >= 8 * 8 * 4 * F  # BN keeps its input
    ln, _ = one_call(layers.LayerNormalization(), (10, 16))
    assert ln.kept_bytes == 2 * 10 * 16 * F  # one internal buffer + its output
    mp, _ = one_call(layers.MaxPooling2D(), (8, 8, 4))
    assert mp.kept_bytes == 4 * 4 * 4 * F and mp.rule == "max pooling"
    ap, _ = one_call(layers.AveragePooling2D(2), (8, 8, 4))
    assert ap.rule == "free"


def test_attention_scores_grow_with_the_square_of_the_sequence():
    def kept(seq):
        inp = keras.Input((seq, 16))
        mha = layers.MultiHeadAttention(2, 8)
        model = keras.Model(inp, mha(inp, inp))
        calls = {c.node[0]: c for c in call_estimates(build_graph(model), 1)}
        return calls[mha.name]

    small, big = kept(16), kept(64)
    assert small.expensive and small.rule == "attention"
    # q, k, v (linear in T) plus 2.2 score buffers of heads x T x T
    assert small.kept_bytes == pytest.approx(3 * 16 * 16 * F + 2.2 * 2 * 16 * 16 * F, rel=0.01)
    assert big.kept_bytes - 4 * (small.kept_bytes - 2.2 * 2 * 16 * 16 * F) == pytest.approx(2.2 * 2 * 64 * 64 * F, rel=0.01)


def _kept_by(layer, shape, *args):
    inp = keras.Input(shape)
    model = keras.Model(inp, layer(inp, *args) if args else layer(inp))
    calls = {c.node[0]: c for c in call_estimates(build_graph(model), 1)}
    return calls[layer.name]


def test_recurrent_layers_keep_buffers_of_one_output_step_per_step():
    """10 step-sized buffers per LSTM step (measured: benchmarks/rule_probes.py);
    a ConvLSTM's step is filters x its spatial positions, not `units`."""
    lstm = _kept_by(layers.LSTM(8, return_sequences=True), (5, 3))
    assert lstm.kept_bytes == 10 * 5 * 8 * F
    conv = _kept_by(layers.ConvLSTM2D(4, 3, padding="same", return_sequences=True), (5, 6, 6, 2))
    assert conv.kept_bytes == 10 * 5 * (6 * 6 * 4) * F
    # A Bidirectional counts both directions' steps, each of its own units.
    both = _kept_by(layers.Bidirectional(layers.LSTM(8, return_sequences=True)), (5, 3))
    assert both.kept_bytes == 2 * lstm.kept_bytes


def test_additive_attention_keeps_its_t_by_s_by_dim_scores():
    q = keras.Input((6, 4))
    v = keras.Input((10, 4))
    add, dot = layers.AdditiveAttention(), layers.Attention()
    model = keras.Model([q, v], [add([q, v]), dot([q, v])])
    calls = {c.node[0]: c for c in call_estimates(build_graph(model), 1)}
    assert calls[add.name].kept_bytes - calls[dot.name].kept_bytes == 6 * 10 * 4 * F


def test_conv_flops_and_kept_input():
    conv, calls = one_call(layers.Conv2D(8, 3, padding="same", activation="relu"), (10, 10, 4))
    assert conv.flops == 2 * 10 * 10 * 8 * (3 * 3 * 4)
    assert conv.kept_bytes == 10 * 10 * 8 * F  # relu's output (also the next Dense's input)


def test_unknown_layers_are_conservative_and_listed():
    class Mystery(layers.Layer):
        def call(self, x):
            return x * 2.0

    model = keras.Model(*_wrap(Mystery()))
    e = estimate(model, batch_size=2)
    assert e.unknown_layers == ("Mystery",)
    call = next(c for c in e.calls if c.class_name == "Mystery")
    assert call.rule == "unknown" and call.kept_bytes == 2 * 2 * 8 * F  # output + one output-sized buffer


def _wrap(layer):
    inp = keras.Input((8,))
    return inp, layers.Dense(1)(layer(layers.Dense(8)(inp)))


def test_nested_model_is_the_sum_of_its_calls():
    inner_in = keras.Input((8,))
    inner = keras.Model(inner_in, layers.Dense(8, activation="gelu")(layers.Dense(8)(inner_in)), name="inner")
    inp = keras.Input((8,))
    model = keras.Model(inp, layers.Dense(1)(inner(layers.Dense(8)(inp))))
    flat_in = keras.Input((8,))
    flat = keras.Model(flat_in, layers.Dense(1)(layers.Dense(8, activation="gelu")(layers.Dense(8)(layers.Dense(8)(flat_in)))))
    nested = estimate(model, batch_size=16)
    plain = estimate(flat, batch_size=16)
    assert sum(c.kept_bytes for c in nested.calls) == sum(c.kept_bytes for c in plain.calls)
    assert nested.forward_flops == plain.forward_flops
    assert nested.baseline_peak_bytes == pytest.approx(plain.baseline_peak_bytes, rel=0.1)
    assert is_expensive(inner)


def test_batch_size_scaling_and_resolution():
    model = models.chain(depth=10, width=64)
    one = node_costs(build_graph(model), None)
    many = node_costs(build_graph(model), 32)
    assert one.per_example and not many.per_example
    for key, nbytes in one.tensor_bytes.items():
        assert many.tensor_bytes[key] == 32 * nbytes
    # activation terms scale with the batch; parameter gradients do not
    e1, e32 = estimate(model), estimate(model, batch_size=32)
    assert e1.batch_size is None and e32.batch_size == 32
    if not cost_model.backend_frees_gradients():  # on PyTorch they are freed first: tests/test_freed_gradients.py
        assert 32 * e1.baseline_peak_bytes < e32.baseline_peak_bytes
    fixed = keras.Model(*_fixed_batch())
    assert resolve_batch_size(fixed) == 5 and estimate(fixed).batch_size == 5
    assert resolve_batch_size(fixed, 7) == 7
    with pytest.raises(ValueError, match="batch_size"):
        resolve_batch_size(model, -2)


def _fixed_batch():
    inp = keras.Input((4,), batch_size=5)
    return inp, layers.Dense(2)(inp)


def test_plan_estimate_is_the_planner_model():
    model = models.unet()
    p = graphckpt.plan(model, batch_size=8)
    e = estimate(model, p, batch_size=8)
    g = build_graph(model)
    assert e.segments == segment_peaks(g, p, node_costs(g, 8))
    assert e.peak_bytes == p.estimated_peak_bytes == max(s.peak_bytes for s in e.segments)
    assert e.baseline_peak_bytes == p.baseline_peak_bytes
    held = 0
    for s in e.segments:
        assert s.held_before_bytes == held
        assert s.peak_bytes == e.fixed_bytes + s.held_before_bytes + s.recompute_peak_bytes
        held += s.held_bytes
    # The default plan recomputes every call once, except in its last segment.
    assert [s.remat for s in p.segments] == [True] * (len(p.segments) - 1) + [False]
    last = set(p.segments[-1].nodes)
    assert e.recompute_flops == pytest.approx(sum(c.flops for c in e.calls if c.node not in last))
    assert 0 < e.recompute_flops < e.forward_flops
    assert e.smallest_peak_bytes <= e.peak_bytes < e.baseline_peak_bytes


def test_deep_chain_sqrt_estimate_is_sublinear():
    ratios = []
    for depth in (16, 64):
        model = models.chain(depth=depth, width=256)
        e = estimate(model, graphckpt.plan(model, segments="sqrt"), batch_size=None)
        ratios.append(e.ratio)
    assert ratios[1] < ratios[0] < 1  # deeper chains save a larger fraction


def test_policy_classification():
    assert is_expensive(layers.Dense(3)) and is_expensive(layers.Conv2D(2, 3)) and is_expensive(layers.LSTM(2))
    assert is_expensive(layers.MultiHeadAttention(2, 4))
    for cheap in (layers.ReLU(), layers.BatchNormalization(), layers.Dropout(0.1), layers.Add(), layers.LayerNormalization()):
        assert not is_expensive(cheap)
    assert graphckpt.policies.save_expensive(layers.Dense(3))
    named = graphckpt.policies.save_these_layers("keep_me", "ReLU")
    assert named(layers.Dense(3, name="keep_me")) and named(layers.ReLU()) and not named(layers.Dense(3))
    assert named == graphckpt.policies.save_these_layers("keep_me", "ReLU")  # frozen: hashes, compares
    assert hash(named)


class _Block(keras.layers.Layer):
    """A layer of layers, as keras_hub's TransformerDecoder: graphckpt sees
    one call."""

    def __init__(self, dim=16, steps=3, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(2, dim // 2)
        self.norm = keras.layers.LayerNormalization()
        self.dense = keras.layers.Dense(dim, activation="gelu")
        self.steps = steps  # how many of its three sublayer calls it makes

    def call(self, x, training=None):
        x = x + self.attention(x, x, training=training)
        for layer in (self.norm, self.dense)[: self.steps - 1]:
            x = layer(x)
        return x


def test_a_layer_of_layers_is_the_sum_of_its_sublayer_calls():
    tokens = keras.Input((None, 16))
    model = keras.Model(tokens, keras.layers.Dense(1)(_Block()(keras.layers.Dense(16)(tokens))))

    def block(seq):
        (call,) = [c for c in graphckpt.estimate(model, input_shape=(2, seq, 16)).calls if c.class_name == "_Block"]
        return call

    short, long = block(16), block(128)
    assert short.rule == "layers inside" and short.expensive
    # The attention inside keeps heads x T x T scores: more than linear in T.
    assert long.kept_bytes > 10 * short.kept_bytes  # x8 would be linear
    # At least what the sublayers keep as Keras layers of the graph would.
    flat_in = keras.Input((None, 16))
    h = keras.layers.Dense(16)(flat_in)
    h = keras.layers.Add()([h, keras.layers.MultiHeadAttention(2, 8)(h, h)])
    flat = keras.Model(flat_in, keras.layers.Dense(1)(keras.layers.Dense(16, activation="gelu")(keras.layers.LayerNormalization()(h))))
    calls = graphckpt.estimate(flat, input_shape=(2, 128, 16)).calls
    inner = sum(c.kept_bytes for c in calls if c.class_name in ("MultiHeadAttention", "LayerNormalization", "Dense"))
    assert long.kept_bytes >= 0.8 * inner


def test_a_layer_of_layers_backward_frees_what_its_later_sublayers_kept():
    """The sublayers' backward steps run one after another, in reverse, each
    after the later ones freed what they kept: a layer of layers peaks at
    the largest over its sublayers of (what it and the earlier ones keep +
    its workspace), plus its own input and output gradients; not at all it
    keeps + the largest workspace, which over-estimated a GPT-2 block's
    (docs/estimator.md, text models). What the first k sublayers keep is
    the kept bytes of the block cut after its k-th call."""
    def block_call(steps):
        tokens = keras.Input((None, 16))
        model = keras.Model(tokens, keras.layers.Dense(1)(_Block(steps=steps)(keras.layers.Dense(16)(tokens))))
        (call,) = [c for c in graphckpt.estimate(model, input_shape=(2, 128, 16)).calls if c.class_name == "_Block"]
        return call, next(layer for layer in model.layers if isinstance(layer, _Block))

    flat_in = keras.Input((None, 16))
    h = keras.layers.Dense(16)(flat_in)
    h = keras.layers.Add()([h, keras.layers.MultiHeadAttention(2, 8, name="mha")(h, h)])
    h = keras.layers.Dense(16, activation="gelu", name="gelu_dense")(keras.layers.LayerNormalization(name="norm")(h))
    flat = keras.Model(flat_in, keras.layers.Dense(1)(h))
    inner = {c.node[0]: c for c in graphckpt.estimate(flat, input_shape=(2, 128, 16)).calls}

    def weights(layer):  # parameter gradients in flight: 3 x the trainable bytes
        return 3 * sum(math.prod(v.shape) * 4 for v in layer.trainable_weights)

    names = ("mha", "norm", "gelu_dense")  # the block's sublayer calls, in order
    own = [inner[name].workspace_bytes - weights(flat.get_layer(name)) for name in names]
    kept_through = [block_call(steps)[0].kept_bytes for steps in (1, 2, 3)]
    assert kept_through[0] < kept_through[1] < kept_through[2]
    block, block_layer = block_call(3)
    io = 2 * (2 * 128 * 16 * 4)  # the block's input and output gradients, batch 2
    peak = max(k + w for k, w in zip(kept_through, own))
    assert block.workspace_bytes == pytest.approx(peak - kept_through[2] + io + weights(block_layer), rel=0.01)
    # The attention's backward, the largest, runs after the others freed theirs.
    assert own[0] == max(own)
    assert block.workspace_bytes < max(own) + io + weights(block_layer)


def test_grouped_query_attention_is_estimated_with_its_own_heads():
    """GroupQueryAttention names its heads `num_query_heads`/`head_dim`:
    its scores are query heads x T x S, as MultiHeadAttention's with as
    many heads."""
    def kept(attention, seq=64):
        x = keras.Input((None, 32))
        model = keras.Model(x, attention(x, x))
        (call,) = [c for c in graphckpt.estimate(model, input_shape=(2, seq, 32)).calls if c.rule == "attention"]
        return call.kept_bytes

    gqa = kept(keras.layers.GroupQueryAttention(head_dim=8, num_query_heads=4, num_key_value_heads=2))
    mha = kept(keras.layers.MultiHeadAttention(num_heads=4, key_dim=8))
    scores = 4 * 64 * 64 * 4  # heads x T x S float32, per example
    assert gqa > 2 * scores
    assert 0.8 * mha < gqa < mha  # fewer key/value heads: a little less


def test_an_attention_called_by_keyword_is_estimated_as_called_by_position():
    """Keras orders a call's keyword tensors by name: keras_hub's
    `attention(query=x, value=x, attention_mask=mask)` has the mask first.
    The rule reads the query, not the mask (a boolean causal mask had made
    the scores a quarter of their bytes), as a layer of layers does too."""
    seq = 64

    def calls(by_keyword):
        x = keras.Input((seq, 32))
        mask = keras.Input((seq, seq), dtype="bool")
        mha = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8)
        y = mha(query=x, value=x, attention_mask=mask) if by_keyword else mha(x, x, attention_mask=mask)
        model = keras.Model([x, mask], keras.layers.Dense(2)(y))
        return {c.class_name: c for c in graphckpt.estimate(model, input_shape=[(2, seq, 32), (2, seq, seq)]).calls}

    by_position, by_keyword = calls(False)["MultiHeadAttention"], calls(True)["MultiHeadAttention"]
    assert by_keyword.rule == "attention"
    assert by_keyword.kept_bytes == by_position.kept_bytes > 2 * (2 * 4 * seq * seq * F)  # scores, float32
    assert by_keyword.workspace_bytes == by_position.workspace_bytes
    assert by_keyword.flops == by_position.flops

    class CausalBlock(keras.layers.Layer):  # keras_hub's decoders call their attention so
        def __init__(self, by_keyword, **kwargs):
            super().__init__(**kwargs)
            self.by_keyword = by_keyword
            self.mha = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8)

        def call(self, x):
            causal = keras.ops.tril(keras.ops.ones((seq, seq), "bool"))[None]
            if self.by_keyword:
                return self.mha(query=x, value=x, attention_mask=causal)
            return self.mha(x, x, attention_mask=causal)

    def block(by_keyword):
        x = keras.Input((seq, 32))
        model = keras.Model(x, keras.layers.Dense(2)(CausalBlock(by_keyword)(keras.layers.Dense(32)(x))))
        (call,) = [c for c in graphckpt.estimate(model, input_shape=(2, seq, 32)).calls if c.class_name == "CausalBlock"]
        return call

    assert block(True).rule == "layers inside"
    assert block(True).kept_bytes == block(False).kept_bytes


def test_a_subclass_of_multi_head_attention_gets_its_rule():
    class Cached(keras.layers.MultiHeadAttention):  # as keras_hub's CachedMultiHeadAttention
        pass

    x = keras.Input((None, 32))
    model = keras.Model(x, Cached(num_heads=4, key_dim=8)(x, x))
    (call,) = [c for c in graphckpt.estimate(model, input_shape=(2, 64, 32)).calls if c.class_name == "Cached"]
    assert call.rule == "attention" and call.kept_bytes > 2 * 4 * 64 * 64 * 4  # heads x T x S scores


class _DenseSubclass(layers.Dense):
    pass


class Dense(keras.layers.Layer):  # only the name of Keras's Dense
    def call(self, x):
        return keras.ops.sin(x) * 2.0


def test_rules_are_found_through_the_class_not_its_name():
    """A subclass of Dense is estimated as a Dense; a user class named
    Dense that is not one gets the conservative guess."""
    sub, _ = one_call(_DenseSubclass(16, activation="tanh"), (16,))
    assert sub.rule == "matmul+tanh" and sub.expensive and is_expensive(_DenseSubclass(4))
    impostor, _ = one_call(Dense(), (16,))
    assert impostor.rule == "unknown" and not impostor.expensive and not is_expensive(Dense())


def test_a_registered_rule_is_used_for_the_class_and_its_subclasses():
    class Block(keras.layers.Layer):
        def call(self, x):
            return keras.ops.tanh(x) * 2.0

    class SubBlock(Block):
        pass

    def block_rule(layer, inputs, outputs):
        # Keeps its input and a buffer of three output sizes.
        return graphckpt.LayerRule(saved_inputs=frozenset({0}), internal=3 * outputs[0].nbytes, name="block")

    before, _ = one_call(Block(), (16,))
    assert before.rule == "unknown"
    graphckpt.register_layer_rule(Block, block_rule, expensive=True)
    try:
        for layer in (Block(), SubBlock()):
            call, _ = one_call(layer, (16,), batch=2)
            # Its buffer, and its output, which the last Dense keeps; its
            # input is the first Dense's output, counted there.
            assert call.rule == "block" and call.kept_bytes == (3 + 1) * 2 * 16 * F
            assert call.expensive and is_expensive(layer)
    finally:
        from graphckpt.estimator import rules

        del rules._REGISTRY[Block]


def test_register_layer_rule_refuses_what_is_not_a_layer_class():
    with pytest.raises(TypeError, match="subclass of keras.layers.Layer"):
        graphckpt.register_layer_rule("Dense", lambda *a: None)
    with pytest.raises(TypeError, match="must be a function"):
        graphckpt.register_layer_rule(layers.Dense, 3)


def test_a_subclass_rule_wins_over_its_base_class_rule():
    def free(layer, inputs, outputs):
        return graphckpt.LayerRule(name="mine")

    graphckpt.register_layer_rule(_DenseSubclass, free)
    try:
        call, _ = one_call(_DenseSubclass(16), (16,))
        plain, _ = one_call(layers.Dense(16), (16,))
        assert call.rule == "mine" and plain.rule == "matmul"
    finally:
        from graphckpt.estimator import rules

        del rules._REGISTRY[_DenseSubclass]


_EARLY_RULES = """
from graphckpt.estimator.rules import LayerRule, register_layer_rule
import keras
from keras_hub.src.layers.modeling.rms_normalization import RMSNormalization

def mine(layer, inputs, outputs):
    return LayerRule(name="mine")

register_layer_rule(keras.layers.Dense, mine)
register_layer_rule(RMSNormalization, mine)
from graphckpt.estimator import keras_rules  # registers Keras's rules now

for cls in (keras.layers.Dense, RMSNormalization):  # the second loads keras_hub's
    assert keras_rules.find_rule(cls)[0] is mine, cls
assert keras_rules.find_rule(keras.layers.Conv2D)[0] is not mine
print("ok")
"""


def test_rules_registered_before_the_built_in_ones_load_are_kept():
    """Keras's rules register when the estimator is first imported,
    keras_hub's when its first layer is met: neither replaces a rule the
    user registered earlier (a fresh process: here they are loaded)."""
    import subprocess
    import sys

    pytest.importorskip("keras_hub")
    run = subprocess.run([sys.executable, "-c", _EARLY_RULES], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


@pytest.mark.backends
def test_an_inline_max_pooling_holds_its_skip_input_beside_its_gradient_but_on_jax():
    """A U-Net's MaxPooling2D reads its input (the skip tensor) in its
    backward. Run inline between two recomputed segments, it holds that
    value while the skip's gradient, from the decoder's Concatenate, is
    already back: on TensorFlow and PyTorch the estimate counts the skip
    twice there (`NodeCosts.reads`; measured in
    cost_model.HOLDING_BACKENDS' comment). XLA schedules the step as a
    whole, and JAX's estimate does not."""
    graph = build_graph(models.unet())
    costs = node_costs(graph, batch_size=4)
    order = topological_order(graph)
    pools = [v for v in order if graph.nodes[v]["class_name"] == "MaxPooling2D"]
    holds = keras.backend.backend() in ("tensorflow", "torch")
    assert {v: set(costs.reads.get(v, ())) for v in pools} == {
        v: set(graph.nodes[v]["in_keys"]) if holds else set() for v in pools
    }
    i = order.index(pools[0])
    inline = plan_from_boundaries(graph, order, [0, i, i + 1], remat=[True, False, True])
    plain = dataclasses.replace(costs, reads={})
    skip = sum(costs.tensor_bytes[k] for k in graph.nodes[pools[0]]["in_keys"])
    held = [p.held_bytes for p in segment_peaks(graph, inline, costs)]
    held_plain = [p.held_bytes for p in segment_peaks(graph, inline, plain)]
    assert skip > 0
    assert held == [h + (skip if holds and j == 1 else 0) for j, h in enumerate(held_plain)]
