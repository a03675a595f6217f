"""Selective recompute (issue 15 part 1): a segment that ends right after a
Dense without activation keeps that Dense's output as its boundary, and on
TensorFlow the Dense is not run again in the backward pass (its gradient
needs only its input and kernel, and the graph runtime drops an op whose
result nothing reads), so only the cheap calls before it are recomputed.
The estimator prices plans the same way. Counted on each backend: the
matmuls one training step runs."""

import collections
import glob
import re

import keras
import numpy as np
import pytest
from keras import layers

import graphckpt
from graphckpt.graph.build import build_graph
from graphckpt.planner import plan_from_boundaries, topological_order
from graphckpt.runtime.checkpointed import checkpointed_model
from tests.helpers import BACKEND, compare_step

pytestmark = pytest.mark.backends

WIDTH, BATCH = 32, 8


def _chain():
    inp = keras.Input((WIDTH,))
    x = inp
    for i in range(6):
        x = layers.Activation("tanh", name=f"t{i}")(layers.Dense(WIDTH, name=f"d{i}")(x))
    return keras.Model(inp, layers.Dense(1, name="head")(x))


# Three recomputed segments of 3-4 calls, then the rest run as it is, cut
# one call apart: each recomputed segment ends at a tanh (whose backward
# reads its output), or at a Dense (whose backward does not).
STARTS = {"ends at tanh": [0, 4, 8, 12], "ends at Dense": [0, 3, 7, 11]}


def _plans(model):
    graph = build_graph(model)
    order = topological_order(graph)
    plans = {k: plan_from_boundaries(graph, order, s, remat=[True, True, True, False]) for k, s in STARTS.items()}
    return graph, plans


def _data():
    rng = np.random.default_rng(0)
    return rng.random((BATCH, WIDTH), dtype="float32"), rng.random((BATCH, 1), dtype="float32")


def _matmuls_in_one_step(model, tmp_path):
    """The matmuls one training step runs (forward, backward, recompute)."""
    x, y = _data()
    if BACKEND == "tensorflow":
        import tensorflow as tf
        from tensorflow.tsl.profiler.protobuf import xplane_pb2

        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        model.train_on_batch(x, y)  # traced and warmed up outside the profile
        tf.profiler.experimental.start(str(tmp_path))
        model.train_on_batch(x, y)
        tf.profiler.experimental.stop()
        (path,) = glob.glob(f"{tmp_path}/**/*.xplane.pb", recursive=True)
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        ops = collections.Counter(
            plane.event_metadata[e.metadata_id].name.split(":")[-1]
            for plane in space.planes
            for line in plane.lines
            for e in line.events
        )
        return sum(n for name, n in ops.items() if "MatMul" in name)
    if BACKEND == "jax":
        import jax
        import jax.numpy as jnp

        trainable = [v.value for v in model.trainable_variables]
        rest = [v.value for v in model.non_trainable_variables]

        def loss(trainable):
            out, _ = model.stateless_call(trainable, rest, jnp.asarray(x), training=True)
            return jnp.mean((out - y) ** 2)

        hlo = jax.jit(jax.grad(loss)).lower(trainable).compile().as_text()
        return len(re.findall(r"\bdot\(", hlo))
    from torch.profiler import profile

    with profile() as prof:
        out = model(keras.ops.convert_to_tensor(x), training=True)
        keras.ops.mean((out - keras.ops.convert_to_tensor(y)) ** 2).backward()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::mm", "aten::addmm"))


def test_a_segment_ending_at_a_dense_does_not_run_it_again(tmp_path):
    model = _chain()
    graph, plans = _plans(model)
    base = _matmuls_in_one_step(model, tmp_path / "base")
    extra = {
        name: _matmuls_in_one_step(checkpointed_model(model, graph, plan), tmp_path / name.replace(" ", "_")) - base
        for name, plan in plans.items()
    }
    # Each recomputed segment holds two Dense calls: all six run again when
    # the segments end at a tanh; ending at a Dense, three (one per
    # segment) are pruned on TensorFlow, none elsewhere.
    assert extra["ends at tanh"] == 6
    assert extra["ends at Dense"] == (3 if BACKEND == "tensorflow" else 6)


def test_the_estimator_prices_what_runs():
    """Its recomputed FLOPs: every call of the recomputed segments, less, on
    TensorFlow, the Dense that ends each segment (`d1`, `d3`, `d5`)."""
    model = _chain()
    _, plans = _plans(model)
    est = {k: graphckpt.estimate(model, p, batch_size=BATCH) for k, p in plans.items()}
    calls = {c.node: c for c in est["ends at tanh"].calls}
    assert calls[("d0", 0)].prunable == (BACKEND == "tensorflow") and not calls[("t0", 0)].prunable
    for name, plan in plans.items():
        recomputed = [s.nodes for s in plan.segments if s.remat]
        expected = sum(calls[v].flops for nodes in recomputed for v in nodes)
        if name == "ends at Dense" and BACKEND == "tensorflow":
            assert [nodes[-1][0] for nodes in recomputed] == ["d1", "d3", "d5"]
            expected -= sum(calls[nodes[-1]].flops for nodes in recomputed)
        assert est[name].recompute_flops == pytest.approx(expected)
    if BACKEND == "tensorflow":
        assert est["ends at Dense"].recompute_seconds < est["ends at tanh"].recompute_seconds


@pytest.mark.parametrize("name", list(STARTS))
def test_pruned_plans_train_exactly(name):
    model = _chain()
    graph, plans = _plans(model)
    ck = checkpointed_model(model, graph, plans[name])
    compare_step(model, ck, _data()[0], compiled=BACKEND != "torch")
