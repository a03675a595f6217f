"""Two-level plans (issue 15 part 2): recomputed segments cut again, when a
budget is below what any plan of one level reaches. No Keras."""

import pytest

from graphckpt.planner import (
    BudgetInfeasible,
    MemoryModel,
    NodeCosts,
    estimated_peak,
    graph_costs,
    plan_for_budget,
    plan_from_boundaries,
    smallest_peak,
    topological_order,
    validate_plan,
)
from tests.planner import casefile
from tests.planner.graphs import chain


def test_a_segment_cut_again_peaks_as_the_model_says_by_hand():
    """6 calls of 10-byte tensors, each kept for backward (`graph_costs`).
    One level, one recomputed segment: its 6 kept outputs + the gradient of
    its output + its copied input = 80. Cut into [2 recomputed, 2
    recomputed, 2 kept]: the copied input (10), then inner segment j peaks
    over what the earlier ones hold (10 each): 0 + (20 + 10 + 10), 10 +
    40, 20 + (20 + 10) -> 10 + 50 = 60; recomputed: 6 calls, then 2 + 2."""
    g = chain(6)
    order = topological_order(g)
    memory = MemoryModel(g, graph_costs(g))
    one = plan_from_boundaries(g, order, [0])
    two = plan_from_boundaries(g, order, [0], inner=[([0, 2, 4], [True, True, False])])
    validate_plan(g, two)
    assert two.levels == 2 and [len(s.nodes) for s in two.segments[0].inner] == [2, 2, 2]
    (p1,) = memory.segment_peaks(one)
    (p2,) = memory.segment_peaks(two)
    assert (p1.recompute_peak_bytes, p1.recompute_cost) == (80, 6.0)
    assert (p2.recompute_peak_bytes, p2.recompute_cost) == (60, 10.0)
    # One inner segment, kept: the recompute of one level, exactly.
    whole = memory.two_level(0, 6, [(6, False)])
    assert whole == (memory.inner(0, 6, True), memory.cost(0, 6))


def test_inner_segments_cross_what_they_must():
    g = chain(6)
    order = topological_order(g)
    plan = plan_from_boundaries(g, order, [0, 3], inner=[([0, 1], [True, False]), None])
    validate_plan(g, plan)
    first = plan.segments[0]
    assert [s.inputs for s in first.inner] == [(("x", 0, 0),), (("n0", 0, 0),)]
    assert [s.outputs for s in first.inner] == [(("n0", 0, 0),), (("n2", 0, 0),)]
    with pytest.raises(ValueError, match="Inner segments"):
        plan_from_boundaries(g, order, [0, 3], remat=[False, True], inner=[([0, 1], [True, False]), None])


def test_a_budget_below_the_floor_of_one_level_gets_two_levels():
    """A 40-call chain: a budget 15% below the least peak of one level is
    met by cutting segments again, with its estimate within the budget,
    and with more recompute than the plan of one level at its floor."""
    g = chain(40)
    costs = graph_costs(g)
    floor = smallest_peak(g, costs)
    budget = int(0.85 * floor)
    with pytest.raises(BudgetInfeasible):
        plan_for_budget(g, costs, budget, two_level=False)
    plan = plan_for_budget(g, costs, budget)
    validate_plan(g, plan)
    assert plan.levels == 2
    assert plan.estimated_peak_bytes <= budget
    assert plan.estimated_peak_bytes == estimated_peak(g, plan, costs)
    at_floor = plan_for_budget(g, costs, floor)
    assert at_floor.levels == 1
    recomputed = lambda p: sum(s.recompute_cost for s in MemoryModel(g, costs).segment_peaks(p))  # noqa: E731
    assert recomputed(plan) > recomputed(at_floor)


def test_the_smallest_peak_named_fits_and_a_little_less_does_not():
    """Below two levels' floor the error names that floor (within about 2%,
    from above): a budget of it fits, one 3% under it does not."""
    g = chain(40)
    costs = graph_costs(g)
    with pytest.raises(BudgetInfeasible) as info:
        plan_for_budget(g, costs, 1)
    smallest = info.value.smallest_bytes
    assert smallest < smallest_peak(g, costs)
    assert plan_for_budget(g, costs, smallest).estimated_peak_bytes <= smallest
    with pytest.raises(BudgetInfeasible):
        plan_for_budget(g, costs, int(0.97 * smallest))


def test_two_level_plans_of_random_graphs_fit_their_budget():
    """12 random DAGs, budgets 3-20% under the floor of one level: each plan
    found fits its budget and recomputes no call a policy keeps; each
    refusal names a floor above the budget. Where one call's own backward
    sets the floor, no cut lowers it: not every graph gets a plan."""
    planned = 0
    for seed in range(12):
        graph, costs, keep = casefile.random_graph(seed, 16 + seed % 3 * 8)
        keep = keep if seed % 2 else ()
        floor = smallest_peak(graph, costs, keep=keep)
        for fraction in (0.97, 0.9, 0.8):
            budget = int(fraction * floor)
            try:
                plan = plan_for_budget(graph, costs, budget, keep=keep)
            except BudgetInfeasible as e:
                assert e.smallest_bytes > budget
                continue
            planned += 1
            validate_plan(graph, plan)
            assert plan.levels == 2
            assert plan.estimated_peak_bytes <= budget
            for seg in plan.segments:
                assert not (seg.remat and set(keep) & set(seg.nodes)), "a call the policy keeps was recomputed"
    assert planned >= 6


def test_costs_made_by_hand_are_planned_too():
    """Big interiors, small boundaries: a chain whose every third call makes
    a 100-byte tensor and the rest 1000 (and keep internal bytes)."""
    g = chain(30)
    sizes = {k: (100 if i % 3 == 2 else 1000) for i, k in enumerate(g.graph["tensors"])}
    costs = NodeCosts(
        tensor_bytes=sizes,
        saved=frozenset(sizes),
        internal={v: 50 for v in topological_order(g)},
        workspace={v: 200 for v in topological_order(g)},
        compute={v: 1.0 + i for i, v in enumerate(topological_order(g))},
    )
    floor = smallest_peak(g, costs)
    plan = plan_for_budget(g, costs, int(0.9 * floor))
    validate_plan(g, plan)
    assert plan.levels == 2 and plan.estimated_peak_bytes <= int(0.9 * floor)
