"""Graph extraction: one node per layer call, tensors on edges."""

import keras
import networkx as nx
from keras import layers

from graphckpt.graph import build_graph
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
    info = g.graph["tensors"][key]
    assert info.shape == (None, 16) and info.dtype == "float32" and info.nbytes == 64


def test_shared_layer_gives_one_node_per_call():
    model = models.multi_io()
    g = build_graph(model)
    shared = model.get_layer("shared")
    calls = [n for n in _layer_nodes(g) if g.nodes[n]["layer"] is shared]
    assert sorted(calls) == [("shared", 0), ("shared", 1), ("shared", 2)]
    assert len(g.graph["inputs"]) == 2 and len(g.graph["outputs"]) == 2


def test_nested_models_are_single_nodes():
    model = models.nested()
    g = build_graph(model)
    block = [n for n in _layer_nodes(g) if g.nodes[n]["class_name"] == "Functional"]
    seq = [n for n in _layer_nodes(g) if g.nodes[n]["class_name"] == "Sequential"]
    assert len(block) == 2 and len(seq) == 1  # the block is called twice
    inner = {id(l) for l in model.get_layer("block").layers}
    assert not any(id(g.nodes[n]["layer"]) in inner for n in g.nodes)


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
    assert {k[2] for k in g.graph["tensors"] if k[:2] == split} == {0, 1}
    assert g.out_degree(split) == 2
