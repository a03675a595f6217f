"""The estimator's freed gradients (`NodeCosts.freed`): on PyTorch, Keras's
trainer frees the last step's weight gradients between the forward and
the backward pass, and each call's backward makes its own again."""

import keras
import pytest
from keras import layers

import graphckpt
from graphckpt.estimator.peak import node_costs
from graphckpt.graph.build import build_graph, call_names
from tests import models
from tests.helpers import BACKEND

pytestmark = pytest.mark.backends


def _shared_and_frozen():
    inp = keras.Input((8,))
    shared = layers.Dense(8, name="shared")
    frozen = layers.Dense(8, name="frozen")
    frozen.trainable = False
    x = shared(inp)
    x = layers.Dense(8, use_bias=False, name="middle")(x)
    x = shared(x)
    return keras.Model(inp, layers.Dense(3, name="head")(frozen(x)))


def test_each_trainable_weight_is_freed_once_at_its_last_call():
    model = _shared_and_frozen()
    graph = build_graph(model)
    names = call_names(graph)
    freed = {names[k]: b for k, b in node_costs(graph, batch_size=4).freed.items()}
    if BACKEND != "torch":
        assert freed == {}  # gradients made and freed inside the step
        return
    by_layer = {}
    for key in sorted(names, key=lambda k: graph.nodes[k]["position"]):  # call order
        by_layer.setdefault(graph.nodes[key]["layer"].name, []).append(names[key])
    first_shared, last_shared = by_layer["shared"]
    assert freed == {
        last_shared: (8 * 8 + 8) * 4,
        by_layer["middle"][0]: 8 * 8 * 4,
        by_layer["head"][0]: (8 * 3 + 3) * 4,
    }
    assert first_shared not in freed and by_layer["frozen"][0] not in freed
    assert sum(freed.values()) == sum(w.numpy().nbytes for w in model.trainable_weights)


def test_per_example_costs_free_nothing():
    costs = node_costs(build_graph(models.chain()), batch_size=None)
    assert costs.freed == {} and costs.forward_temp == {}


def test_a_kernel_layers_bias_or_activation_is_a_forward_temporary_on_torch():
    """On PyTorch a Dense adds its bias and applies its activation as ops of
    their own: one more output-sized tensor in its forward step (measured:
    benchmarks/archive/torch_forward_step.py). Read only where gradients are freed,
    so made only there."""
    inp = keras.Input((8,))
    x = layers.Dense(6, activation="tanh", name="both")(inp)
    x = layers.Dense(6, use_bias=False, name="neither")(x)
    x = layers.Dense(6, use_bias=False, activation="relu", name="activation")(x)
    x = layers.Activation("tanh", name="no_kernel")(x)
    x = layers.EinsumDense("ab,bc->ac", output_shape=7, name="einsum")(x)
    x = layers.EinsumDense("ab,bc->ac", output_shape=7, bias_axes="c", name="einsum_bias")(x)
    model = keras.Model(inp, layers.Dense(5, name="bias")(x))
    graph = build_graph(model)
    temp = {graph.nodes[k]["layer"].name: b for k, b in node_costs(graph, batch_size=4).forward_temp.items() if b}
    if BACKEND != "torch":
        assert temp == {}
        return
    assert temp == {"both": 4 * 6 * 4, "activation": 4 * 6 * 4, "einsum_bias": 4 * 7 * 4, "bias": 4 * 5 * 4}


@pytest.mark.skipif(BACKEND != "torch", reason="gradients are freed before the backward pass on PyTorch only")
def test_weight_heavy_chain_plans_one_segment_on_torch():
    """32 x Dense(256) at batch 8: the weights' gradients (256 KiB a call)
    dwarf the activations (8 KiB), so the backward pass of every segment
    but the first runs far below the step's start: the least peak is one
    recomputed segment between a first call and the last ones run inline."""
    model = models.chain(depth=32, width=256)
    plan = graphckpt.plan(model, batch_size=8)
    assert [s.remat for s in plan.segments] == [False, True, False]
    assert len(plan.segments[0].nodes) == 1 and len(plan.segments[1].nodes) >= 28
