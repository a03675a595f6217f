"""The memory model where the backward pass runs on freed memory
(`NodeCosts.freed`: PyTorch, whose Keras trainer frees the last step's
weight gradients between the forward and the backward pass). No Keras."""

import dataclasses
import random

import pytest

from graphckpt.plan import (
    MemoryModel,
    estimated_peak,
    graph_costs,
    plan_for_budget,
    plan_from_boundaries,
    plan_segments,
    segment_peaks,
    smallest_peak,
    topological_order,
)
from tests.planner.graphs import chain
from tests.test_plan import SHAPES, _random_costs, literal_graph


def _freeing(costs, nbytes):
    return dataclasses.replace(costs, freed={v: nbytes for v in costs.compute})


def test_peaks_by_hand():
    """4 calls of 10-byte tensors, each kept for backward; each call's
    weights free 100 bytes of gradients before the backward pass.

    Without freeing: the baseline holds its 4 tensors and the output's
    gradient (50); one recomputed segment adds its copied input (60).
    Freeing: the backward pass of call v runs 100 * (v + 1) bytes below
    the step's start, so each peak is the end of the forward pass: the
    baseline's 4 tensors (40); one recomputed segment's output (10); a
    recomputed [n0, n1] and a kept [n2, n3]: n1, n2 and n3 (30), the
    recomputed segment's backward far below it (10 + 10 + 20 - 200 + 110 =
    -70: its kept outputs, the gradient of n1 and its copied input, at
    call 0's backward, 100 below the start)."""
    g = chain(4)
    order = topological_order(g)
    plain = graph_costs(g)
    freeing = _freeing(plain, 100)
    one = plan_from_boundaries(g, order, [0])
    two = plan_from_boundaries(g, order, [0, 2], remat=[True, False])
    assert MemoryModel(g, plain).baseline_peak() == 50
    assert estimated_peak(g, one, plain) == 60
    assert MemoryModel(g, freeing).baseline_peak() == 40
    assert estimated_peak(g, one, freeing) == 10
    peaks = segment_peaks(g, two, freeing)
    assert [p.peak_bytes for p in peaks] == [-70, 30]
    assert [p.held_bytes for p in peaks] == [10, 20]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("seed", [0, 1])
def test_no_plan_peaks_below_the_end_of_its_forward_pass(shape, seed):
    """Whatever is freed, every plan's peak is at least what all its
    segments hold at once when the forward pass ends, and nothing freed
    leaves every estimate as it was."""
    g = literal_graph(SHAPES[shape])
    costs = _random_costs(g, seed)
    order = topological_order(g)
    rnd = random.Random(seed)
    n = len(order)
    for _ in range(10):
        starts = [0] + sorted(rnd.sample(range(1, n), rnd.randint(0, min(3, n - 1))))
        remat = [rnd.random() < 0.7 for _ in starts]
        plan = plan_from_boundaries(g, order, starts, remat=remat)
        for freed in (0, 50, 10**6):
            c = _freeing(costs, freed)
            peaks = segment_peaks(g, plan, c)
            assert estimated_peak(g, plan, c) >= c.fixed + sum(p.held_bytes for p in peaks)
        assert estimated_peak(g, plan, _freeing(costs, 0)) == estimated_peak(g, plan, costs)


def test_freed_gradients_let_one_segment_be_the_least_peak():
    """A 32-call chain whose weights' gradients dwarf its activations (as
    32 x Dense(1024) at batch 256 on PyTorch): later segments' recompute
    runs on freed memory, so the least peak is one recomputed segment and
    an inline last call, holding almost nothing when the forward pass ends;
    without freeing the least peak needs several segments. A budget then
    keeps a prefix as it is and recomputes the rest."""
    g = chain(32)
    plain = dataclasses.replace(graph_costs(g), workspace={v: 40 for v in graph_costs(g).compute})
    freeing = _freeing(plain, 40)
    auto = plan_segments(g, segments="auto", costs=freeing)
    assert [(len(s.nodes), s.remat) for s in auto.segments] == [(31, True), (1, False)]
    assert len(plan_segments(g, segments="auto", costs=plain).segments) > 2
    assert smallest_peak(g, freeing) < smallest_peak(g, plain)
    budget = plan_for_budget(g, freeing, 150)
    assert estimated_peak(g, budget, freeing) <= 150
    first = budget.segments[0]
    assert not first.remat and len(first.nodes) > 5
