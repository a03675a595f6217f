"""The pure planner: where to cut a layer-call graph into segments.

Contract:
- Input: a `graphckpt.graph.layer_graph.LayerGraph` (`build_graph`'s output), or
  any `networkx.DiGraph` with the same attributes. Only node attributes
  `kind` and `position`, edge attribute `tensors`, and the graph's
  `tensors` (each with `producer` and `nbytes`), `outputs` and
  `state_chains`, read through `graphckpt.graph.layer_graph`'s accessors
  (`tensors_of(graph)`, ...), are read. Nothing here imports Keras.
- Output: an immutable `Plan`. Its segments are contiguous runs of one
  topological order that cover every layer call exactly once; a segment's
  `inputs` are the tensors made before it and used inside it, its `outputs`
  the tensors made inside it and used after it (or returned by the model).
- Works on any DAG: no articulation points are needed. `plan_segments`
  cuts where the estimated peak (the memory model below) is least, so
  segments are short where activations are big and single-tensor cut
  points win where they exist.
- Memory budgets: given per-call costs (`NodeCosts`, made by
  `graphckpt.estimator.peak.node_costs` from a Keras model, or by hand), `plan_for_budget`
  finds the plan of least recompute whose estimated peak fits a budget, and
  `segment_peaks` / `estimated_peak` evaluate the same memory model on any
  plan. Segments may be marked `remat=False`: their calls run as they are.
  The package uses numpy for the span tables, never Keras.

Inside: `data` (the plan) -> `memory` (the memory model) -> `search` ->
`front` -> `two_level` -> `budget_search`; this module re-exports their public
names, and `graphckpt.plan(model, ...)` is the Keras-facing entry point.

References:
    Chen, Xu, Zhang, Guestrin. "Training Deep Nets with Sublinear Memory
    Cost", 2016 (sqrt(n) segments; segment inputs kept, interiors recomputed;
    memory-budgeted segmentation).

    Feng, Huang. "Optimal Gradient Checkpoint Search for Arbitrary
    Computation Graphs", CVPR 2021 (dynamic programming over a linearized
    arbitrary graph).
"""

from graphckpt.planner.budget_search import BudgetInfeasible, plan_for_budget, smallest_peak
from graphckpt.planner.data import (
    Plan,
    PlannedSegment,
    plan_from_boundaries,
    topological_order,
    validate_plan,
)
from graphckpt.planner.memory import (
    MemoryModel,
    NodeCosts,
    SegmentPeak,
    baseline_peak,
    estimated_peak,
    graph_costs,
    recomputed_calls,
    segment_peaks,
)
from graphckpt.planner.search import SEGMENT_CHOICES, plan_segments

__all__ = [
    "PlannedSegment",
    "Plan",
    "topological_order",
    "plan_from_boundaries",
    "plan_segments",
    "graph_costs",
    "validate_plan",
    "NodeCosts",
    "MemoryModel",
    "SegmentPeak",
    "BudgetInfeasible",
    "segment_peaks",
    "recomputed_calls",
    "estimated_peak",
    "baseline_peak",
    "smallest_peak",
    "plan_for_budget",
    "SEGMENT_CHOICES",
]
