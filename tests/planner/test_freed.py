"""The memory model where the backward pass runs on freed memory
(`NodeCosts.freed`: PyTorch, whose Keras trainer frees the last step's
weight gradients between the forward and the backward pass). No Keras."""

import dataclasses
import random

import numpy as np
import pytest

from graphckpt.planner import (
    MemoryModel,
    estimated_peak,
    front,
    graph_costs,
    plan_for_budget,
    plan_from_boundaries,
    plan_segments,
    segment_peaks,
    smallest_peak,
    topological_order,
)
from tests.planner.graphs import chain, random_costs, random_dag
from tests.planner.references import brute_force, plan_peak, reference_search


def _freeing(costs, nbytes):
    return dataclasses.replace(costs, freed={v: nbytes for v in costs.compute})


def test_peaks_by_hand():
    """4 calls of 10-byte tensors, each kept for backward; each call's
    weights free 100 bytes of gradients before the backward pass.

    Without freeing: the baseline holds its 4 tensors and the output's
    gradient (50); one recomputed segment adds its copied input (60).
    Freeing: the backward pass of call v runs 100 * (v + 1) bytes below
    the step's start, so each peak is in the forward pass: the baseline's 4
    tensors at its end (40); one recomputed segment, at each call (its input
    and output: 20); a recomputed [n0, n1] (20), then a kept [n2, n3] over
    n1: n1, n2 and n3 (30)."""
    g = chain(4)
    order = topological_order(g)
    plain = graph_costs(g)
    freeing = _freeing(plain, 100)
    one = plan_from_boundaries(g, order, [0])
    two = plan_from_boundaries(g, order, [0, 2], remat=[True, False])
    assert MemoryModel(g, plain).baseline_peak() == 50
    assert estimated_peak(g, one, plain) == 60
    assert MemoryModel(g, freeing).baseline_peak() == 40
    assert estimated_peak(g, one, freeing) == 20
    peaks = segment_peaks(g, two, freeing)
    assert [p.peak_bytes for p in peaks] == [20, 30]
    assert [p.held_bytes for p in peaks] == [10, 20]


def test_forward_temporaries_count_where_memory_is_freed():
    """The chain of `test_peaks_by_hand` with 5 bytes of forward
    temporaries per call (PyTorch's unfused bias add): each forward step
    holds them beside its output, so every peak in a forward pass rises by
    5 (the baseline's at n3's step: 30 kept + 10 + 5); without freeing the
    backward workspace already covers the forward pass, and nothing
    changes."""
    g = chain(4)
    order = topological_order(g)
    plain = graph_costs(g)
    temp = dict.fromkeys(plain.compute, 5)
    freeing = dataclasses.replace(_freeing(plain, 100), forward_temp=temp)
    one = plan_from_boundaries(g, order, [0])
    two = plan_from_boundaries(g, order, [0, 2], remat=[True, False])
    assert MemoryModel(g, freeing).baseline_peak() == 45
    assert estimated_peak(g, one, freeing) == 25
    assert [p.peak_bytes for p in segment_peaks(g, two, freeing)] == [25, 35]
    with_temp = dataclasses.replace(plain, forward_temp=temp)
    assert MemoryModel(g, with_temp).baseline_peak() == 50 and estimated_peak(g, one, with_temp) == 60


def _case(seed):
    """A random layer-call graph (a chain or a DAG, 10-30 calls; 4-8 every
    fifth seed), random costs, and random bytes freed per call."""
    rnd = random.Random(seed)
    n = rnd.randint(4, 8) if seed % 5 == 0 else rnd.randint(10, 30)
    g, names = random_dag(rnd, n, chain=seed % 3 == 0)
    freed = {v: rnd.choice([0, 0, 50, 300, 10**4]) for v in names}
    costs = random_costs(rnd, g, names, lambda: float(rnd.choice([1, 2, 3, 50])), freed=freed)
    return g, costs, rnd


@pytest.mark.parametrize("seed", range(12))
def test_no_plan_peaks_below_the_end_of_its_forward_pass(seed):
    """Every plan's peak is at least what all its segments hold at once
    when the forward pass ends; with nothing freed (zeros), every estimate
    is as without the field."""
    g, costs, rnd = _case(seed)
    order = topological_order(g)
    n = len(order)
    for _ in range(10):
        starts = [0] + sorted(rnd.sample(range(1, n), rnd.randint(0, min(3, n - 1))))
        plan = plan_from_boundaries(g, order, starts, remat=[rnd.random() < 0.7 for _ in starts])
        peaks = segment_peaks(g, plan, costs)
        assert estimated_peak(g, plan, costs) >= costs.fixed + sum(p.held_bytes for p in peaks)
        zeros = dataclasses.replace(costs, freed=dict.fromkeys(costs.freed, 0))
        assert estimated_peak(g, plan, zeros) == estimated_peak(g, plan, dataclasses.replace(costs, freed={}))


@pytest.mark.parametrize("seed", range(40))
def test_the_budget_search_is_exact_on_freed_memory(seed):
    """Peaks below the step's start (negative spans) do not break the
    budget search: the plans of the plain dynamic program, and on small
    graphs the brute-force least recompute, at caps from the least peak to
    the baseline."""
    g, costs, _ = _case(seed)
    spans = MemoryModel(g, costs)
    forbidden = np.zeros(spans.n + 1, dtype=np.int64)
    least = smallest_peak(g, costs, memory=spans) - costs.fixed
    base = spans.inner_kept[0, spans.n]
    for cap in sorted({least - 1, least, int((least + base) / 2), base}):
        got = front.least_recompute(spans, cap, forbidden)
        assert got == reference_search(spans, cap, forbidden), (seed, cap)
        if got is not None:
            assert plan_peak(spans, got[1]) <= cap
        if spans.n <= 8:
            best = brute_force(spans, cap, forbidden)
            assert (got is None) == (best is None) and (got is None or got[0] == pytest.approx(best))


def test_freed_gradients_let_one_segment_be_the_least_peak():
    """A 32-call chain whose weights' gradients dwarf its activations (as
    32 x Dense(1024) at batch 256 on PyTorch): later segments' recompute
    runs on freed memory, so the least peak is one recomputed segment
    between a first and a last call run as they are, holding almost
    nothing when the forward pass ends; without freeing the least peak
    needs several recomputed segments. A budget then keeps a prefix as it
    is and recomputes the rest."""
    g = chain(32)
    plain = dataclasses.replace(graph_costs(g), workspace={v: 40 for v in graph_costs(g).compute})
    freeing = _freeing(plain, 40)
    auto = plan_segments(g, segments="auto", costs=freeing)
    assert [(len(s.nodes), s.remat) for s in auto.segments] == [(1, False), (30, True), (1, False)]
    assert sum(s.remat for s in plan_segments(g, segments="auto", costs=plain).segments) > 2
    assert smallest_peak(g, freeing) < smallest_peak(g, plain)
    budget = plan_for_budget(g, freeing, 150)
    assert estimated_peak(g, budget, freeing) <= 150
    first = budget.segments[0]
    assert not first.remat and len(first.nodes) > 5
