"""The estimator's time model (issue 15 part 1): matmul-like calls priced by
their FLOPs, the others by the bytes they move, with constants fitted on
this machine (graphckpt/estimator/data/cpu_costs.json)."""

import json

import keras
import pytest
from keras import layers

import graphckpt
from graphckpt.estimator import cost_model


def _conv_bn(size):
    inp = keras.Input((size, size, 8))
    x = layers.Conv2D(8, 3, padding="same", name="conv")(inp)
    x = layers.BatchNormalization(name="bn")(x)
    return keras.Model(inp, layers.ReLU(name="relu")(x))


def _seconds(model):
    return {c.node[0]: c for c in graphckpt.estimate(model, batch_size=4).calls}


def test_the_data_file_prices_every_kind():
    with open(cost_model.DATA) as f:
        data = json.load(f)
    assert set(data["seconds_per_flop"]) == {"attention", "conv", "matmul"}
    assert data["seconds_per_byte"]["BatchNormalization"] > 0 and data["seconds_per_byte"]["other"] > 0
    assert data["command"].endswith("benchmarks/cost_probe.py")
    assert cost_model.params()["seconds_per_call"] == data["seconds_per_call"]


def test_cheap_calls_are_priced_by_the_bytes_they_move():
    """Four times the pixels: four times the FLOPs of the convolution and
    four times the bytes of the BatchNormalization, so each price, less the
    per-call overhead, grows four times; and the BatchNormalization costs a
    share of the convolution that FLOPs (5 per element against 2 x 72 per
    output) would not give it."""
    small, big = _seconds(_conv_bn(8)), _seconds(_conv_bn(16))
    overhead = cost_model.params()["seconds_per_call"]
    for name in ("conv", "bn", "relu"):
        assert big[name].seconds - overhead == pytest.approx(4 * (small[name].seconds - overhead), rel=1e-3)
    bn, conv = big["bn"], big["conv"]
    assert (bn.seconds - overhead) / (conv.seconds - overhead) > 10 * bn.flops / conv.flops


def test_without_the_data_the_price_is_the_flops(monkeypatch):
    monkeypatch.setattr(cost_model, "params", lambda: cost_model._FLOPS_ONLY)
    assert cost_model.segment_seconds() == 0.0
    calls = _seconds(_conv_bn(8))
    assert all(c.seconds == pytest.approx(c.flops * cost_model.NANOSECOND) for c in calls.values())


def test_the_planners_costs_are_whole_nanoseconds():
    """The budget search trusts its shift certificate only on whole-number
    costs (graphckpt/planner/front.py); fractional seconds made a 2000-call
    chain's budget plan take 143 s instead of 4."""
    from graphckpt.estimator.peak import node_costs
    from graphckpt.graph.build import build_graph

    costs = node_costs(build_graph(_conv_bn(16)), 4)
    assert all(float(c).is_integer() and c > 0 for c in costs.compute.values())
    assert float(costs.segment_cost).is_integer() and costs.segment_cost > 0
