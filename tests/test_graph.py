"""Graph extraction: one node per layer call, tensors on edges."""

import keras
import networkx as nx
import numpy as np
import pytest
from keras import layers

from graphckpt.graph.build import build_graph, dependencies, kept_whole_note, live_tensors
from graphckpt.graph.layer_graph import INPUT, LayerGraph, outputs_of, state_chains_of, tensors_of
from tests import models


def _layer_nodes(g):
    return [n for n, d in g.nodes(data=True) if d["kind"] == "layer"]


def test_chain_is_a_path_with_shapes():
    model = models.chain(depth=3)
    g = build_graph(model)
    assert nx.is_directed_acyclic_graph(g)
    assert len(_layer_nodes(g)) == 4
    assert [d["kind"] for _, d in g.nodes(data=True)].count("input") == 1
    first = next(n for n in _layer_nodes(g) if g.nodes[n]["layer"] is model.layers[1])
    (pred,) = g.predecessors(first)
    (key,) = g.edges[pred, first]["tensors"]
    info = g.tensors[key]
    assert info.shape == (None, 16) and info.dtype == "float32" and info.nbytes == 64


def test_shared_layer_gives_one_node_per_call():
    model = models.multi_io()
    g = build_graph(model)
    shared = model.get_layer("shared")
    calls = [n for n in _layer_nodes(g) if g.nodes[n]["layer"] is shared]
    assert sorted(calls) == [("shared", 0), ("shared", 1), ("shared", 2)]
    assert len(g.inputs) == 2 and len(g.outputs) == 2


def test_nested_models_are_flattened_into_their_calls():
    model = models.nested()
    g = build_graph(model)
    kinds = {d["class_name"] for n, d in g.nodes(data=True)}
    assert not kinds & {"Functional", "Sequential"}
    block = model.get_layer("block")
    names = [n[0] for n in sorted(_layer_nodes(g), key=lambda n: g.nodes[n]["position"])]
    # Each call of the block is flattened on its own, under its own path;
    # its layers are then shared calls (the very same objects).
    prefixes = [n.split("/")[0] if "/" in n else "" for n in names]
    assert prefixes[:10] == [""] + ["block"] * 3 + ["seq"] * 2 + ["block@1"] * 3 + [""]
    assert [a.split("/")[1] for a in names[1:4]] == [b.split("/")[1] for b in names[6:9]]
    for a, b in zip(names[1:4], names[6:9]):
        (na,) = [n for n in g.nodes if n[0] == a]
        (nb,) = [n for n in g.nodes if n[0] == b]
        assert g.nodes[na]["layer"] is g.nodes[nb]["layer"]
        assert any(g.nodes[na]["layer"] is layer for layer in block.layers)
    # The inner calls read the outer tensors the block was called on.
    first = next(n for n in g.nodes if n[0] == names[1])
    assert [g.tensors[k].producer[0] for k in g.nodes[first]["in_keys"]] == [names[0]]
    assert nx.is_directed_acyclic_graph(g)


def _block(name="block", outputs=1):
    i = keras.Input((4,))
    h = layers.Dense(4)(i)
    outs = [layers.Dense(4)(h) for _ in range(outputs)]
    return keras.Model(i, outs if outputs > 1 else outs[0], name=name)


def _whole(g):
    return [n[0] for n, d in g.nodes(data=True) if d["class_name"] in ("Functional", "Sequential", "Custom")]


def test_nested_calls_that_cannot_be_replayed_call_by_call_stay_whole():
    inp = keras.Input((4,))
    # An unused output: flattening would make its branch dead code.
    two = _block("two", outputs=2)
    a, _ = two(inp)
    # An overridden `call`: replaying the layers would skip it.

    class Custom(keras.Model):
        def call(self, inputs, training=None):
            return super().call(inputs, training=training) * 2.0

    ci = keras.Input((4,))
    custom = Custom(ci, layers.Dense(4)(ci), name="custom")
    b = custom(a)
    # A dtype the nested model would convert on the way in.
    i16 = keras.Input((4,), dtype="float16")
    cast = keras.Model(i16, layers.Dense(4, dtype="float16")(i16), name="cast")
    c = cast(b)
    # An input only passed through to an output nothing reads: the calls
    # making it outside would become dead code.
    pi, pj = keras.Input((4,)), keras.Input((4,))
    passing = keras.Model([pi, pj], [layers.Dense(4)(pi), pj], name="passing")
    d, _ = passing([a, layers.BatchNormalization()(a)])
    out = _block("plain")(layers.Add()([d, layers.Dense(4)(c)]))
    g = build_graph(keras.Model(inp, out))
    assert sorted(_whole(g)) == ["cast", "custom", "passing", "two"]
    assert any(n[0].startswith("plain/") for n in g.nodes)
    # Each is named with its reason, for the warnings (kept_whole_note).
    why = g.kept_whole
    assert sorted(why) == ["cast", "custom", "passing", "two"]
    assert "'dense" in why["two"] and "nothing outside it reads" in why["two"]
    assert "Custom" in why["custom"] and "dtype" in why["cast"] and "inputs" in why["passing"]
    note = kept_whole_note(g)
    assert all(f"'{name}'" in note for name in why)
    assert kept_whole_note(build_graph(keras.Model(inp, _block("alone")(inp)))) == ""


def test_a_nested_output_nothing_outside_reads_is_fine_when_calls_inside_read_it():
    """keras_hub's BERT backbone returns `sequence_output` and the
    `pooled_output` computed from it; a classifier takes only the pooled
    one. No call inside becomes dead, so the backbone is flattened (its
    layers are the graph's calls) and trains exactly."""
    import graphckpt
    from tests.helpers import compare_step

    i = keras.Input((4,))
    sequence = layers.Dense(4, activation="tanh")(i)
    pooled = layers.Dense(4, activation="tanh")(sequence)
    backbone = keras.Model(i, {"sequence_output": sequence, "pooled_output": pooled}, name="backbone")
    inp = keras.Input((4,))
    model = keras.Model(inp, layers.Dense(2)(backbone(inp)["pooled_output"]))
    g = build_graph(model)
    assert _whole(g) == []
    assert sum(1 for n in g.nodes if n[0].startswith("backbone/")) == 2
    ck = graphckpt.checkpoint_model(model, segments=2)
    compare_step(model, ck, np.random.default_rng(0).normal(size=(3, 4)).astype("float32"))


def test_a_nested_model_called_with_inputs_as_a_keyword_is_flattened():
    """keras_hub's Gemma3CausalLM calls its backbone as
    `backbone(inputs=inputs)`."""
    i = keras.Input((4,))
    block = keras.Model(i, layers.Dense(4)(layers.Dense(4)(i)), name="block")
    inp = keras.Input((4,))
    g = build_graph(keras.Model(inp, layers.Dense(2)(block(inputs=inp))))
    assert _whole(g) == []
    assert sum(1 for n in g.nodes if n[0].startswith("block/")) == 2


def test_a_nested_model_whose_layer_names_clash_stays_whole():
    inp = keras.Input((4,))
    first, second = _block("first"), _block("second")
    # Two backbones loaded from files have the same inner layer names.
    second.layers[1].name = first.layers[1].name
    model = keras.Model(inp, second(first(inp)))
    g = build_graph(model)
    assert _whole(g) == ["second"]
    layers_by_name = {}
    for _, d in g.nodes(data=True):
        layers_by_name.setdefault(d["layer"].name, set()).add(id(d["layer"]))
    assert all(len(v) == 1 for v in layers_by_name.values())
    import graphckpt

    graphckpt.checkpoint_model(model, segments=2)  # Keras accepts every segment's names


def test_explicit_training_of_a_nested_call_reaches_its_layers():
    inner = _block("frozen")
    inp = keras.Input((4,))
    out = layers.Dense(1)(inner(inp, training=False))
    g = build_graph(keras.Model(inp, out))
    flat = [d for n, d in g.nodes(data=True) if n[0].startswith("frozen/")]
    assert flat and all(d["training"] is False for d in flat)
    assert all(d["training"] is None for n, d in g.nodes(data=True) if not n[0].startswith("frozen/"))


def test_same_tensor_twice_is_one_edge_entry():
    inp = keras.Input((4,))
    x = layers.Dense(4)(inp)
    out = layers.Multiply()([x, x])
    g = build_graph(keras.Model(inp, out))
    (edge,) = [d for u, v, d in g.edges(data=True) if g.nodes[v]["class_name"] == "Multiply"]
    assert len(edge["tensors"]) == 1


def test_sequential_graph_and_multi_output_layer():
    seq = keras.Sequential([keras.Input((3,)), layers.Dense(4), layers.Dense(2)])
    assert len(_layer_nodes(build_graph(seq))) == 2

    inp = keras.Input((6,))
    a, b = layers.Lambda(lambda t: [t[:, :3], t[:, 3:]])(inp)
    out = layers.Add()([layers.Dense(2)(a), layers.Dense(2)(b)])
    g = build_graph(keras.Model(inp, out))
    split = next(n for n in g.nodes if g.nodes[n]["class_name"] == "Lambda")
    assert {k[2] for k in g.tensors if k[:2] == split} == {0, 1}
    assert g.out_degree(split) == 2


def test_the_graph_is_a_layer_graph_with_typed_fields():
    g = build_graph(models.multi_io())
    assert isinstance(g, LayerGraph)
    assert g.name == g.graph["name"] and isinstance(g.name, str)
    assert set(g.inputs) | set(g.outputs) <= set(g.tensors)
    assert dict(g.kept_whole) == {} and dict(g.not_opened) == {} and g.kept_closed == ()
    assert not g.open_layers and not g.at_known_shapes and not g.shapes_resolved
    assert {d["kind"] for _, d in g.nodes(data=True) if d["kind"] == INPUT} == {INPUT}
    # A copy and a subgraph view are LayerGraphs with the same fields.
    for other in (g.copy(), g.subgraph(list(g.nodes)[:3])):
        assert isinstance(other, LayerGraph) and other.tensors is g.tensors and other.outputs == g.outputs
    sized = g.with_tensors(dict(g.tensors))
    assert sized.shapes_resolved and not g.shapes_resolved and sized.tensors == g.tensors
    g.mark_shapes_resolved()
    assert g.shapes_resolved
    try:
        g.tensors = {}
    except AttributeError:
        pass
    else:
        raise AssertionError("fields are read-only")
    try:
        g.set_fields(shapes=())
    except TypeError as e:
        assert "shapes" in str(e)
    else:
        raise AssertionError("an unknown field is refused")
    # The planner's accessors read a plain DiGraph with the same keys too.
    plain = nx.DiGraph()
    plain.graph.update(tensors=g.tensors, outputs=g.outputs)
    for graph in (g, plain):
        assert tensors_of(graph) is g.tensors and outputs_of(graph) == g.outputs
    assert state_chains_of(plain) == () and state_chains_of(g) == g.state_chains


def test_liveness_of_a_graph_and_of_its_model_agree():
    # `passing` is kept whole (its second input only reaches an output
    # nothing reads): the BatchNormalization call feeding it is not live.
    inp = keras.Input((4,))
    a = layers.Dense(4, name="a")(inp)
    pi, pj = keras.Input((4,)), keras.Input((4,))
    passing = keras.Model([pi, pj], [layers.Dense(4, name="inner")(pi), pj], name="passing")
    d, _ = passing([a, layers.BatchNormalization(name="bn")(a)])
    model = keras.Model(inp, layers.Dense(2, name="out")(d))
    g = build_graph(model)
    assert list(g.kept_whole) == ["passing"]
    live = live_tensors(g)
    assert {k[0] for k in g.tensors} - {k[0] for k in live} == {"bn"}
    # The same walk over the model's own nodes finds the same tensors.
    tensors, variables = dependencies(model)
    by_key = {k: g.nodes[info.producer]["node"].outputs[k[2]] for k, info in g.tensors.items()}
    assert {k for k, t in by_key.items() if id(t) in tensors} == live
    read = [model.get_layer("a"), passing.get_layer("inner"), model.get_layer("out")]
    assert {id(v) for v in variables} == {id(v) for layer in read for v in layer.variables}


@pytest.mark.backends
def test_a_mask_made_from_an_input_is_computed_in_its_readers_segment():
    """`graph.from_inputs`: calls without weights or state that read only
    model inputs and each other (a padding mask made from token ids). The
    planner runs them just before their reader, so the mask is made inside
    the reader's segment, not kept across the cuts before it; the
    checkpointed model computes the same."""
    import graphckpt
    from graphckpt.planner import topological_order

    ids = keras.Input((6,), dtype="int32", name="ids")
    extra = keras.Input((8,), name="extra")
    h = layers.Embedding(50, 8, name="embed")(ids)
    mask = keras.ops.expand_dims(keras.ops.cast(keras.ops.not_equal(ids, 0), "float32"), -1)
    for i in range(4):
        h = layers.Dense(8, activation="tanh", name=f"d{i}")(h)
    h = keras.ops.multiply(h, mask)
    side = layers.Dense(8, name="side")(layers.Dropout(0.5, seed=1, name="drop")(extra))
    model = keras.Model([ids, extra], [h, side])
    g = build_graph(model)
    found = {g.nodes[n]["class_name"] for n in g.from_inputs}
    assert found == {"NotEqual", "Cast", "ExpandDims"}, found  # not Embedding, Dense (weights) or Dropout (state)
    order = topological_order(g)
    reader = next(n for n in order if g.nodes[n]["class_name"] == "Multiply")
    assert [g.nodes[n]["class_name"] for n in order[order.index(reader) - 3 : order.index(reader)]] == [
        "NotEqual", "Cast", "ExpandDims"
    ]
    ck = graphckpt.checkpoint_model(model, segments=3)
    segment = next(s for s in ck.plan.segments if reader in s.nodes)
    assert set(g.from_inputs) <= set(segment.nodes)
    x = [np.array([[1, 2, 0, 3, 0, 4]] * 2, "int32"), np.ones((2, 8), "float32")]
    for got, want in zip(ck(x, training=False), model(x, training=False)):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(got), keras.ops.convert_to_numpy(want))
