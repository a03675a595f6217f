"""Recompute pruned by the graph runtime (issue 15 part 1): a recomputed call
whose backward needs only its inputs costs nothing when no call of its
segment reads its outputs. No Keras."""

import dataclasses

import pytest

from graphckpt.planner import (
    MemoryModel,
    graph_costs,
    plan_for_budget,
    recomputed_calls,
    smallest_peak,
    topological_order,
)
from tests.planner.casefile import random_graph
from tests.planner.graphs import chain


def test_a_prunable_call_is_free_only_as_its_segments_last_reader():
    """Chain n0..n3 costing 1, 2, 4, 8; n1 and n3 prunable. A span pays for
    n1 only when n2 (its reader) is inside; n3, the model output, is never
    read, so no span pays for it."""
    g = chain(4)
    costs = dataclasses.replace(
        graph_costs(g), compute={"n0": 1.0, "n1": 2.0, "n2": 4.0, "n3": 8.0}, prunable=frozenset({"n1", "n3"})
    )
    m = MemoryModel(g, costs)
    assert [m.cost(0, b) for b in range(1, 5)] == [1.0, 1.0, 7.0, 7.0]
    assert [m.cost(a, 4) for a in range(4)] == [7.0, 6.0, 4.0, 0.0]
    assert m.cost(1, 2) == 0.0 and m.cost(1, 3) == 6.0
    plain = MemoryModel(g, dataclasses.replace(costs, prunable=frozenset()))
    assert plain.cost(0, 4) == 15.0


def test_a_budget_plan_ends_its_segments_after_the_expensive_calls():
    """[cheap, expensive] x 6, the expensive calls prunable (a convolution
    then its BatchNorm-ReLU): at a budget that needs recompute, the plan of
    least cost ends every recomputed segment at an expensive call, so it
    recomputes only cheap ones; without pruning it cannot."""
    g = chain(12)
    order = topological_order(g)
    expensive = {v for i, v in enumerate(order) if i % 2}
    base = dataclasses.replace(graph_costs(g), compute={v: 10.0 if v in expensive else 1.0 for v in order})
    pruned = dataclasses.replace(base, prunable=frozenset(expensive))
    budget = (smallest_peak(g, base) + plan_for_budget(g, base, 10**9).baseline_peak_bytes) // 2
    plan = plan_for_budget(g, pruned, budget)
    recomputed = [s for s in plan.segments if s.remat]
    assert recomputed and all(s.nodes[-1] in expensive for s in recomputed)
    cost = sum(p.recompute_cost for p in MemoryModel(g, pruned).segment_peaks(plan))
    assert cost == sum(1.0 for s in recomputed for v in s.nodes if v not in expensive) - 0.0
    plain = plan_for_budget(g, base, budget)
    assert sum(p.recompute_cost for p in MemoryModel(g, base).segment_peaks(plain)) > cost


def test_a_call_read_only_by_pruned_calls_is_pruned_too():
    """n0 -> n1 -> n2 -> n3, n1 and n2 prunable (a convolution, then the
    Add closing its block): a segment ending at n2 drops n2 (nothing reads
    it) and so n1 (only n2 reads it); one ending at n3 drops neither, since
    n3 (not prunable) reads n2."""
    g = chain(4)
    costs = dataclasses.replace(
        graph_costs(g), compute={"n0": 1.0, "n1": 2.0, "n2": 4.0, "n3": 8.0}, prunable=frozenset({"n1", "n2"})
    )
    m = MemoryModel(g, costs)
    assert [m.cost(0, b) for b in range(1, 5)] == [1.0, 1.0, 1.0, 15.0]
    assert m.cost(1, 3) == 0.0 and m.cost(2, 4) == 12.0


def test_the_span_tables_price_each_span_by_the_rule_for_one_segment():
    """`MemoryModel` encodes the pruning rule for every span at once;
    `recomputed_calls` states it for one segment. On random DAGs with
    random prunable calls they agree on every span."""
    for seed in range(6):
        g, costs, _ = random_graph(seed, 14)
        order = topological_order(g)
        costs = dataclasses.replace(
            costs, prunable=frozenset(order[i] for i in range(0, len(order), 2)), segment_cost=3.0
        )
        m = MemoryModel(g, costs, order)
        for a in range(len(order)):
            for b in range(a + 1, len(order) + 1):
                kept = recomputed_calls(g, order[a:b], costs.prunable)
                assert m.cost(a, b) == pytest.approx(sum(costs.compute[v] for v in kept) + 3.0), (seed, a, b)
