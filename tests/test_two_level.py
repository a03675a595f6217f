"""Two-level plans on every backend (issue 15 part 2): a recomputed segment
cut again trains exactly like the original, its inner segments really are
recomputed once more, and what a plan keeps inside it is not."""

import keras
import numpy as np
import pytest
from keras import layers, ops

import graphckpt
from graphckpt.estimator import cost_model
from graphckpt.estimator.peak import node_costs
from graphckpt.graph.build import build_graph
from graphckpt.planner import plan_from_boundaries, smallest_peak, topological_order, validate_plan
from graphckpt.runtime.checkpointed import checkpointed_model
from graphckpt.runtime.segment import Segment
from graphckpt.training.flag import _CACHE_ATTR
from tests import models
from tests.helpers import BACKEND, compare_step, jax_loss_fn, state_of, train_step

pytestmark = pytest.mark.backends


@pytest.fixture(autouse=True)
def _gradients_not_freed(monkeypatch):
    """Plans made with the memory model of TensorFlow and JAX on every
    backend: on PyTorch, whose backward pass runs on the last step's freed
    gradients (`NodeCosts.freed`), one level already reaches these models'
    floor, and there would be no two-level plan to test."""
    monkeypatch.setattr(cost_model, "FREEING_BACKENDS", ())

MODES = pytest.mark.parametrize(
    "compiled",
    {"tensorflow": [False, True], "jax": [True], "torch": [False]}[BACKEND],
    ids=lambda c: "compiled" if c else "eager",
)

BATCH = 4


def _below_the_floor(model, fraction):
    """`checkpoint_model` with a budget `fraction` of the least estimated
    peak of any plan of one level."""
    graph = build_graph(model)
    floor = smallest_peak(graph, node_costs(graph, BATCH))
    return graphckpt.checkpoint_model(model, budget=int(fraction * floor), batch_size=BATCH)


# builder, and a budget as a fraction of one level's floor that two levels
# reach (their floor: 0.92, 0.79 and 0.84 of it).
BUILDERS = {
    "chain_bn_dropout": (lambda: models.chain(depth=24, dropout=0.2, bn=True), 0.95),
    "resnet": (lambda: models.resnet(blocks=6), 0.9),
    "densenet": (models.densenet, 0.9),
}


@MODES
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_budget_below_one_level_trains_exactly(name, compiled):
    build, fraction = BUILDERS[name]
    model = build()
    ck = _below_the_floor(model, fraction)
    assert ck.plan.levels == 2
    validate_plan(build_graph(model), ck.plan)
    outer = [l for l in ck.layers if isinstance(l, Segment)]
    inner = [l for s in outer for l in s.model.layers if isinstance(l, Segment)]
    assert inner, "no segment was cut again"
    x = models.sample_inputs(model, batch=BATCH)
    compare_step(model, ck, x, compiled=compiled)


class Counting(layers.Dense):
    """A Dense layer that counts the Python runs of its `call`."""

    def __init__(self, units, **kwargs):
        super().__init__(units, activation="tanh", **kwargs)
        self.runs = 0

    def call(self, inputs):
        self.runs += 1
        return super().call(inputs)


def _counting_chain(depth=9):
    inp = keras.Input((8,))
    x = inp
    for i in range(depth):
        x = Counting(8, name=f"c{i}")(x)
    return keras.Model(inp, x)


def _one_step(model, x):
    """One forward and backward pass, traced once on JAX."""
    variables = [v.value for v in model.trainable_variables]
    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            y = model(x, training=True)
        tape.gradient(y, variables)
    elif BACKEND == "torch":
        import torch

        torch.autograd.grad(ops.sum(model(x, training=True)), variables)
    else:
        import jax

        loss = lambda t, n, x: jax_loss_fn(model)(t, n, x)[0]  # noqa: E731
        jax.make_jaxpr(jax.grad(loss))(variables, [v.value for v in model.non_trainable_variables], x)


def test_inner_segments_run_once_more_and_kept_calls_do_not():
    """Outer segment [c0..c5] cut into [c0 c1] and [c2 c3], recomputed again,
    and [c4 c5], kept; then [c6..c8] run as they are. Runs per call in one
    step: 3 (forward, the outer recompute, its own), 2 (forward, the outer
    recompute) and 1."""
    model = _counting_chain()
    graph = build_graph(model)
    plan = plan_from_boundaries(
        graph, topological_order(graph), [0, 6], remat=[True, False], inner=[([0, 2, 4], [True, True, False]), None]
    )
    ck = checkpointed_model(model, graph, plan)
    counting = [model.get_layer(f"c{i}") for i in range(9)]
    assert all(ck_layer is layer for ck_layer, layer in zip(_layers_of(ck), counting))  # the same objects
    for layer in counting:
        layer.runs = 0
    _one_step(ck, np.ones((2, 8), "float32"))
    assert [layer.runs for layer in counting] == [3, 3, 3, 3, 2, 2, 1, 1, 1]


def _layers_of(model):
    """Every Counting layer `model` calls, at any depth, in order."""
    found = []
    for layer in model.layers:
        if isinstance(layer, Segment):
            found += _layers_of(layer.model)
        elif isinstance(layer, Counting):
            found.append(layer)
    return found


def test_a_two_level_model_saves_and_loads(tmp_path):
    """The plan comes back with its inner segments, and a training step of
    the loaded model gives the gradients of the saved one (no Dropout: each
    model draws from its own seed generator)."""
    model = models.chain(depth=24, bn=True)
    ck = _below_the_floor(model, 0.95)
    path = str(tmp_path / "two.keras")
    ck.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.plan.levels == 2
    assert loaded.plan.to_dict()["segments"] == ck.plan.to_dict()["segments"]
    inner = lambda m: [  # noqa: E731
        [l.name for l in s.model.layers if isinstance(l, Segment)] for s in m.layers if isinstance(s, Segment)
    ]
    assert inner(loaded) == inner(ck)
    lines = []
    loaded.summary(print_fn=lambda line, **kwargs: lines.append(line))
    cut = [s for s in loaded.plan.segments if s.inner]
    assert "\n".join(lines).count("cut again (two levels)") == len(cut)
    x = models.sample_inputs(model, batch=BATCH)
    loss_a, grads_a, _ = train_step(ck, ck.trainable_variables, x)
    loss_b, grads_b, _ = train_step(loaded, loaded.trainable_variables, x)
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-6)
    assert len(grads_a) == len(grads_b) == len(model.trainable_variables)
    for a, b in zip(grads_a, grads_b):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_the_fit_flag_with_a_budget_below_one_level_trains_exactly(installed):
    """Adam, Dropout and BatchNorm, 3 epochs: the loss history and the whole
    state (weights, statistics, seeds) of plain `fit`."""
    from tests.test_fit_flag import fit_twice

    def build():
        keras.utils.set_random_seed(1)
        return models.chain(depth=24, dropout=0.2, bn=True)

    graph = build_graph(build())
    budget = int(0.95 * smallest_peak(graph, node_costs(graph, BATCH)))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 16)).astype("float32"), rng.normal(size=(32, 2)).astype("float32")
    fit = dict(x=x, y=y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0)
    (plain, h0), (model, h1) = fit_twice(build, fit, {"optimizer": "adam", "loss": "mse"}, budget=budget)
    (twin,) = model.__dict__[_CACHE_ATTR].twins.values()
    assert twin.model.plan.levels == 2
    np.testing.assert_allclose(h1.history["loss"], h0.history["loss"], rtol=1e-6)
    for a, b in zip(state_of(model), state_of(plain)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
