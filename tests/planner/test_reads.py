"""A segment run as it is holds the value of an earlier tensor that one of
its calls reads in its backward, beside that tensor's gradient from a later
use (`NodeCosts.reads`, `both(a, b)` in `MemoryModel`). No Keras."""

import dataclasses
import random

import numpy as np
import pytest

from graphckpt.planner import (
    MemoryModel,
    graph_costs,
    plan_from_boundaries,
    segment_peaks,
    topological_order,
)
from graphckpt.planner.data import tensor_consumers
from tests.planner.graphs import dag, random_dag, random_reads

SKIP = ("n1", 0, 0)


def _unet_like():
    """x -> n0 -> n1 -> n2 (a pooling: reads n1 in its backward) -> n3 ->
    n4 (a concat of n3 and the skip n1); 10 bytes a tensor."""
    g, names = dag(5, lambda i, earlier: {"n1"} if i == 4 else set(), lambda names: None)
    plain = dataclasses.replace(graph_costs(g), tensor_bytes=dict.fromkeys(g.graph["tensors"], 10), per_example=False)
    return g, plain, dataclasses.replace(plain, reads={"n2": frozenset({SKIP})})


def test_an_inline_reader_between_recomputed_segments_holds_the_value_and_its_gradient():
    """[n0 n1] recomputed, [n2] inline, [n3] recomputed, [n4] inline: while
    n3's segment runs backward, n4's backward has sent n1's gradient back,
    and n2 still holds n1's value for its own. With n2 recomputed with n1
    ([n0 n1 n2] recomputed), n1's value is made again and nothing holds it."""
    g, plain, reading = _unet_like()
    order = topological_order(g)
    inline = plan_from_boundaries(g, order, [0, 2, 3, 4], remat=[True, False, True, False])
    merged = plan_from_boundaries(g, order, [0, 3, 4], remat=[True, True, False])
    before, after = segment_peaks(g, inline, plain), segment_peaks(g, inline, reading)
    assert [p.held_bytes for p in after] == [p.held_bytes + (10 if p.index == 1 else 0) for p in before]
    assert [p.peak_bytes for p in after] == [p.peak_bytes + (10 if p.index >= 2 else 0) for p in before]
    assert segment_peaks(g, merged, reading) == segment_peaks(g, merged, plain)


def _both_by_definition(graph, costs, order):
    """both(a, b) for every span, from its definition: the bytes of each
    tensor made before a (by a call), read in its backward by a call in
    [a, b), and used at b or later (a model output: used at the end)."""
    n, pos = len(order), {v: i for i, v in enumerate(order)}
    consumers, outputs = tensor_consumers(graph), set(graph.graph["outputs"])
    both = np.zeros((n + 1, n + 1))
    for key, info in graph.graph["tensors"].items():
        if info.producer not in pos:
            continue
        uses = sorted(pos[c] for c in consumers.get(key, ()) if c in pos)
        last = n if key in outputs else max(uses, default=pos[info.producer])
        readers = [u for u in uses if key in costs.reads.get(order[u], ())]
        for a in range(pos[info.producer] + 1, n):
            for b in range(a + 1, n + 1):
                if b <= last and any(a <= r < b for r in readers):
                    both[a, b] += costs.tensor_bytes[key]
    return both


@pytest.mark.parametrize("seed", range(30))
def test_the_span_table_counts_both_as_defined(seed):
    """The difference arrays of `MemoryModel` give, for every span run as
    it is, what `_both_by_definition` counts; recomputed spans are
    unchanged by `reads`."""
    rnd = random.Random(seed)
    g, names = random_dag(rnd, rnd.randint(4, 14), chain=seed % 5 == 0)
    plain = dataclasses.replace(graph_costs(g), tensor_bytes={k: rnd.choice([1, 7, 40]) for k in g.graph["tensors"]})
    reading = dataclasses.replace(plain, reads=random_reads(rnd, g))
    order = topological_order(g)
    without, with_reads = MemoryModel(g, plain, order), MemoryModel(g, reading, order)
    np.testing.assert_array_equal(with_reads.held_kept - without.held_kept, _both_by_definition(g, reading, order))
    np.testing.assert_array_equal(with_reads.held_remat, without.held_remat)
    np.testing.assert_array_equal(with_reads.inner_kept, without.inner_kept)
