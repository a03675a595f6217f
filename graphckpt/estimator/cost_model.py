"""The estimator's time model: what recomputing one layer call costs.

FLOPs alone price a BatchNormalization, a ReLU or an Add at almost nothing
next to a convolution; on a CPU those calls are bound by memory traffic
and take a real share of the step (44% of the forward time of the
benchmark families' layer calls, timed alone, for 1% of their FLOPs), so a
plan that recomputes only them is not free. Each call is priced in estimated seconds:

    matmul-like calls (kind "matmul", "conv", "attention"):
        seconds = flops * seconds_per_flop[kind] + overhead
    the others (kind: the layer class, "other" when not calibrated):
        seconds = bytes * seconds_per_byte[kind] + overhead

with `bytes` what the call reads and writes (its float inputs and its
outputs). The constants are fitted by `benchmarks/cost_probe.py`, which
times every distinct layer call of the benchmark families alone on the
machine it runs on, and kept as data in `graphckpt/estimator/data/cpu_costs.json`.
Only ratios matter to the planner (it compares the recompute of one plan
with another's), so constants fitted on one CPU order plans sensibly on
another.
"""

import functools
import json
import os

from graphckpt.planner import recomputed_calls

__all__ = [
    "DATA",
    "NANOSECOND",
    "PRUNING_BACKENDS",
    "FREEING_BACKENDS",
    "backend_frees_gradients",
    "backend_prunes",
    "call_seconds",
    "io_bytes",
    "kind_of",
    "nanoseconds",
    "params",
    "recompute_flops",
    "seconds",
    "segment_seconds",
]

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "cpu_costs.json")

# Without the data file: FLOPs only, one a nanosecond.
_FLOPS_ONLY = dict(seconds_per_flop={}, seconds_per_byte={}, seconds_per_call=0.0)
# The planner's costs are whole nanoseconds: its search trusts shifts of
# costs only when their float sums are exact (`graphckpt.planner.front`).
NANOSECOND = 1e-9


def kind_of(class_name, rule_name, expensive):
    """The kind a call is priced as: "attention", "conv" or "matmul" for
    matmul-like calls, else its layer class."""
    if rule_name.startswith("attention"):
        return "attention"
    if expensive and "Conv" in class_name:
        return "conv"
    if expensive:
        return "matmul"
    return class_name


def io_bytes(ins, outs, batch_size=None):
    """Bytes a call reads and writes: its float inputs and its outputs, as
    `graphckpt.graph.build.TensorInfo`s (per example), times `batch_size`."""
    per_example = sum(i.nbytes for i in ins if "float" in i.dtype) + sum(o.nbytes for o in outs)
    return per_example * (batch_size or 1)


def seconds(p, kind, flops, nbytes):
    """Estimated seconds of one forward run, by the constants `p`."""
    per_flop, per_byte = p["seconds_per_flop"], p["seconds_per_byte"]
    if not per_flop and not per_byte:
        return flops * NANOSECOND
    if kind in per_flop:
        return flops * per_flop[kind] + p["seconds_per_call"]
    return nbytes * per_byte.get(kind, per_byte["other"]) + p["seconds_per_call"]


@functools.cache
def params():
    """The fitted constants (`graphckpt/estimator/data/cpu_costs.json`)."""
    if not os.path.exists(DATA):
        return _FLOPS_ONLY
    with open(DATA) as f:
        data = json.load(f)
    return {k: data[k] for k in _FLOPS_ONLY}


def nanoseconds(seconds):
    """`seconds` as whole nanoseconds (a float), the planner's cost unit."""
    return float(round(seconds / NANOSECOND))


def segment_seconds():
    """Estimated seconds a recomputed segment costs besides its calls: one
    call's overhead (0 without the data)."""
    return params()["seconds_per_call"]


def call_seconds(class_name, rule, ins, outs, batch_size=None):
    """Estimated seconds of one forward run of a call with rule `rule`
    (a `graphckpt.estimator.rules.LayerRule`) on `ins` -> `outs`, at `batch_size`."""
    kind = kind_of(class_name, rule.name, rule.expensive)
    return seconds(params(), kind, rule.flops * (batch_size or 1), io_bytes(ins, outs, batch_size))


# Backends on which a recomputed call whose outputs only leave its segment,
# and whose backward needs only its inputs, costs nothing to recompute:
# TensorFlow's graph runtime (and XLA) drops an op whose result nothing
# reads (tests/test_pruned_recompute.py counts the matmuls run). On JAX the
# segment's backward keeps its recomputed outputs alive on purpose (bitwise
# equal gradients; `graphckpt.runtime.remat_jax.jax_remat`), and PyTorch's autograd
# runs every recomputed op.
PRUNING_BACKENDS = ("tensorflow",)


def backend_prunes():
    """Whether the current Keras backend drops unread recomputed ops."""
    import keras

    return keras.backend.backend() in PRUNING_BACKENDS


# Backends whose Keras trainer frees the previous step's weight gradients
# between the forward and the backward pass: Keras's torch trainer runs the
# forward pass, then `zero_grad()`, then `loss.backward()`
# (keras/src/backend/torch/trainer.py `train_step`), so the backward pass
# starts on that memory (`graphckpt.planner.NodeCosts.freed`). TensorFlow
# and JAX make a step's gradients inside the step and free them with it.
FREEING_BACKENDS = ("torch",)


# Backends on which an inline call that reads an earlier tensor in its
# backward (a MaxPooling2D on a U-Net's skip tensor) holds that value while
# the tensor's gradient, from a later use, is already alive
# (`graphckpt.planner.NodeCosts.reads`). Measured by
# benchmarks/inline_reader.py: a U-Net with its first MaxPooling2D inline
# between two recomputed segments peaks higher than with the pooling
# recomputed in the segment before: on TensorFlow x0.68 against x0.63 of
# the baseline (lower in each of 4 alternating rounds), on PyTorch x0.54
# against x0.32 (3 rounds, each the same). On JAX, XLA's buffer assignment
# of the same two plans says the opposite (127.5 and 151.5 MiB of
# temporaries): it schedules the step as a whole.
HOLDING_BACKENDS = ("tensorflow", "torch")


def backend_holds_read_values():
    """Whether an inline call's backward-read input is held beside its
    gradient on the current Keras backend (`HOLDING_BACKENDS`)."""
    import keras

    return keras.backend.backend() in HOLDING_BACKENDS


def backend_frees_gradients():
    """Whether the current Keras backend frees the last step's weight
    gradients before the backward pass."""
    import keras

    return keras.backend.backend() in FREEING_BACKENDS


def recompute_flops(graph, plan, calls):
    """The FLOPs a plan recomputes, counted as the memory model counts its
    cost: each recomputed segment (and inner segment) runs its calls once
    more, less those pruned from its recompute (`recomputed_calls`)."""
    by_node = {c.node: c for c in calls}
    prunable = {c.node for c in calls if c.prunable}

    def recomputed(nodes):
        return sum(by_node[v].flops for v in recomputed_calls(graph, nodes, prunable))

    total = 0.0
    for segment in plan.segments:
        if segment.remat:
            total += recomputed(segment.nodes)
            total += sum(recomputed(inner.nodes) for inner in segment.inner if inner.remat)
    return total
