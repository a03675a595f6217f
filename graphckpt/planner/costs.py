"""What the memory model reads about each layer call (`NodeCosts`), and
what it says about each segment of a plan (`SegmentPeak`).
This module never imports Keras."""

import dataclasses

from graphckpt.graph.layer_graph import tensors_of
from graphckpt.planner.data import layer_nodes

__all__ = ["NodeCosts", "SegmentPeak", "graph_costs"]


@dataclasses.dataclass(frozen=True)
class NodeCosts:
    """What the memory model needs about each layer call, for one batch.

    `graphckpt.estimator.peak.node_costs` makes one from a Keras model; tests make
    them by hand. Bytes are absolute for the batch the costs were made for
    (per example when `per_example` is true).

    Attributes:
        tensor_bytes: tensor key -> bytes of that tensor.
        saved: tensor keys the original model keeps for backward (because
            the producer or a consumer needs the value in its gradient).
        internal: layer call -> bytes it keeps for backward besides graph
            tensors: pre-activations, dropout masks, attention scores...
        workspace: layer call -> transient bytes of its backward step
            (input and parameter gradients, temporaries).
        compute: layer call -> cost of running it forward once (the
            estimator's: whole nanoseconds by `graphckpt.estimator.cost_model`; any
            unit will do, and whole numbers let the search trust shifts).
        fixed: bytes every plan pays alike (the loss, the batch's gradients).
        per_example: whether the bytes are per example.
        prunable: layer calls whose recompute costs nothing when no call of
            their segment reads their outputs: their backward needs only
            their inputs, and the backend's graph compiler drops a forward
            op whose result nothing reads (TensorFlow's graph runtime, XLA).
        segment_cost: the cost of recomputing any segment besides its calls'
            (dispatch), so that a segment of pruned calls is not free.
        freed: layer call -> bytes the training step frees between the
            forward and the backward pass and allocates again when that
            call's backward runs. On PyTorch these are the previous step's
            weight gradients: Keras's torch trainer runs the forward pass,
            then `zero_grad()`, then the backward pass. Empty where
            gradients do not outlive a step (TensorFlow, JAX). Give a
            weight shared by several calls to the call latest in the order.
        forward_temp: layer call -> transient bytes of its forward step
            besides its outputs and `internal`, read only where something
            is `freed` (the forward pass is modelled there alone): on
            PyTorch, a kernel layer's bias add and activation run as ops of
            their own, each making a new tensor, so the matmul's or the bias
            add's result lives beside the next one.
        reads: layer call -> the keys of its input tensors whose values its
            backward reads (a MaxPooling2D's input), where a segment run as
            it is holds such a value beside its gradient: the value until
            the segment's backward, the gradient from the backward of a
            later reader. Empty where the backend does not hold both
            (XLA's schedule on JAX, measured) or nobody said.
    """

    tensor_bytes: dict
    saved: frozenset
    internal: dict
    workspace: dict
    compute: dict
    fixed: int = 0
    per_example: bool = False
    prunable: frozenset = frozenset()
    segment_cost: float = 0.0
    freed: dict = dataclasses.field(default_factory=dict)
    forward_temp: dict = dataclasses.field(default_factory=dict)
    reads: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class SegmentPeak:
    """The memory model's view of one segment during the backward pass.

    Attributes:
        index: the segment's index in the plan.
        remat: whether it is recomputed.
        held_before_bytes: bytes held for the segments before it when its
            backward runs (their boundary tensors, or everything a
            non-recomputed segment keeps).
        held_bytes: what this segment holds for the later segments'
            backward: its output tensors (values or their gradients) when
            recomputed; everything its calls keep when not.
        recompute_peak_bytes: the segment's own peak during its backward:
            what its calls keep (recomputed, when `remat`), plus the
            gradients of its outputs and the largest backward workspace;
            where memory is freed before the backward pass
            (`NodeCosts.freed`), its forward pass's when that is more.
        peak_bytes: `fixed + held_before + recompute_peak`, above the memory
            in use when the step starts.
        recompute_cost: forward cost recomputed for it (0 when not `remat`;
            calls pruned from its recompute left out).
    """

    index: int
    remat: bool
    held_before_bytes: int
    held_bytes: int
    recompute_peak_bytes: int
    peak_bytes: int
    recompute_cost: float


def graph_costs(graph):
    """`NodeCosts` from the graph alone: each tensor's bytes per example,
    every tensor kept for backward, no other memory, unit compute per call.

    What `plan_segments` plans with when no estimate of the layers is at
    hand (`graphckpt.estimator.peak.node_costs` knows more about each layer)."""
    tensors = tensors_of(graph)
    calls = layer_nodes(graph)
    return NodeCosts(
        tensor_bytes={k: info.nbytes for k, info in tensors.items()},
        saved=frozenset(tensors),
        internal={},
        workspace={},
        compute={v: 1.0 for v in calls},
        per_example=True,
    )
