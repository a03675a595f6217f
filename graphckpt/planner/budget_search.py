"""The budget search: the plan of least recompute within a memory budget.

`plan_for_budget` chooses where to cut one topological order of the layer
calls and which segments to recompute so that the memory model's peak
(`graphckpt.planner.memory`) fits a budget and the forward cost recomputed
is least; `smallest_peak` is the least peak any plan of one level reaches.
When no plan of one level fits, segments are cut again
(`graphckpt.planner.two_level`). This module never imports Keras; it uses
numpy.
"""

import dataclasses
import math

import numpy as np

from graphckpt import errors
from graphckpt.planner.data import plan_from_boundaries
from graphckpt.planner.front import least_recompute
from graphckpt.planner.memory import memory_model_for
from graphckpt.planner.search import least_peak
from graphckpt.planner.two_level import plan_two_level, smallest_two_level

__all__ = ["BudgetInfeasible", "plan_for_budget", "smallest_peak"]


class BudgetInfeasible(errors.InfeasibleBudgetError):
    """No plan's estimated peak fits the budget. `smallest_bytes` is the
    smallest estimated peak any plan reaches.

    A `graphckpt.InfeasibleBudgetError` (so a `GraphckptError` and a
    `ValueError`) that carries the numbers: `graphckpt.plan` re-raises it
    as an `InfeasibleBudgetError` with a message in the user's terms."""

    def __init__(self, message, smallest_bytes, budget_bytes):
        super().__init__(message)
        self.smallest_bytes = smallest_bytes
        self.budget_bytes = budget_bytes


def _forbidden_prefix(order, keep):
    counts = [0]
    for v in order:
        counts.append(counts[-1] + (1 if v in keep else 0))
    return counts


def smallest_peak(graph, costs, *, keep=(), memory=None):
    """The smallest estimated peak of any plan of one level (segments
    recomputed or not, over the planner's topological order), in bytes,
    exactly. Plans whose segments are cut again may reach lower
    (`plan_for_budget` says how low when a budget fits neither).

    Args:
        graph: the layer-call graph.
        costs: `NodeCosts` for it.
        keep: layer calls that may not be recomputed.
        memory: a `MemoryModel` of `graph` and `costs` to reuse, if at hand.
    """
    spans = memory_model_for(graph, costs, None, memory)
    return least_peak(spans, _forbidden_prefix(spans.order, set(keep))) + costs.fixed


def plan_for_budget(graph, costs, budget_bytes, *, keep=(), strategy="budget", memory=None, two_level=True):
    """The plan of least recompute whose estimated peak fits a budget.

    Chooses where to cut the layer calls of one topological order into
    segments, and which segments to recompute, so that the memory model's
    peak (see `MemoryModel`: for each segment, in backward order, the boundary
    tensors held for the earlier segments plus the segment's own recompute
    peak) stays at or below `budget_bytes`, and the forward cost recomputed
    (the `compute` of the recomputed calls, those pruned from a segment's
    recompute left out, plus `segment_cost` per recomputed segment) is
    least. Segments that are not
    recomputed keep their calls' activations, as the original model does;
    that is how the plan spends spare memory to skip recomputation.

    The search is a dynamic program over cut positions with a Pareto front
    of (bytes held, recompute cost) per state: exact for the model, in
    O(n^2 * front) time at worst, and far less in practice: most
    candidates are shown to be dominated without being looked at
    (`graphckpt.planner.front`). It generalizes Chen et al.'s budgeted segmentation
    (a greedy pass over a chain with a memory budget) to an exact search
    with per-call costs, in the spirit of Feng & Huang's dynamic program over
    a linearized graph.

    Args:
        graph: the layer-call graph (see `graphckpt.graph.build`).
        costs: `NodeCosts` for it, at the batch size the budget is for.
        budget_bytes: the largest estimated peak allowed.
        keep: layer calls never to recompute (a recompute policy).
        strategy: the label stored on the plan.
        memory: a `MemoryModel` of `graph` and `costs` to reuse, if at hand
            (its tables take O(n^2) to build).
        two_level: when no plan of one level fits, look for one whose
            recomputed segments are cut again (`graphckpt.planner.two_level`).

    Returns:
        A `Plan` whose `estimated_peak_bytes` is at most `budget_bytes`.

    Raises:
        BudgetInfeasible: no plan fits; it carries the smallest peak any
            plan reaches.

    References:
        Chen, Xu, Zhang, Guestrin. "Training Deep Nets with Sublinear Memory
        Cost", arXiv:1604.06174, 2016 (section 4.3: memory-budgeted
        segmentation; checkpointed segments keep only their inputs).

        Feng, Huang. "Optimal Gradient Checkpoint Search for Arbitrary
        Computation Graphs", CVPR 2021 (dynamic programming over the
        segments of a topological order of an arbitrary graph).

        Jain et al. "Checkmate: Breaking the Memory Wall with Optimal Tensor
        Rematerialization", MLSys 2020 (least recompute cost under a memory
        budget, there as a MILP).
    """
    spans = memory_model_for(graph, costs, None, memory)
    order = spans.order
    forbidden = np.asarray(_forbidden_prefix(order, set(keep)))
    cap = budget_bytes - costs.fixed
    found = least_recompute(spans, cap, forbidden)
    inner = None
    if found is not None:
        segments = found[1]
    elif two_level and spans.n > 1:
        # No plan of one level fits: cut segments again (`nested`).
        found = plan_two_level(spans, cap, forbidden)
        if found is not None:
            segments, inner = found
    if found is None:
        smallest = least_peak(spans, forbidden)
        if two_level and spans.n > 1:
            smallest = smallest_two_level(spans, forbidden, smallest)
        smallest = int(math.ceil(smallest + costs.fixed))
        raise BudgetInfeasible(
            f"No plan fits a budget of {budget_bytes} bytes: the smallest estimated peak is {smallest} bytes",
            smallest,
            budget_bytes,
        )
    plan = plan_from_boundaries(
        graph, order, [a for a, _, _ in segments], strategy=strategy, remat=[r for _, _, r in segments], inner=inner
    )
    return dataclasses.replace(
        plan,
        estimated_peak_bytes=spans.estimated_peak(plan),
        baseline_peak_bytes=spans.baseline_peak(),
        batch_size=None,
        budget_bytes=int(budget_bytes),
    )
