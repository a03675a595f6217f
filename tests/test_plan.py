"""The pure planner, on small literal graphs and on real models' graphs."""

import math

import networkx as nx
import pytest

from graphckpt.graph.build import TensorInfo, build_graph
from graphckpt.planner import (
    plan_from_boundaries,
    plan_segments,
    topological_order,
    validate_plan,
)
from tests import models


def literal_graph(edges, sizes=None, outputs=None):
    """A graph in graph/layer_graph.py's schema from an edge list of node names.

    Each node makes one tensor named after it; `sizes` gives its bytes
    (default 1). Nodes without predecessors are model inputs.
    """
    sizes = sizes or {}
    g = nx.DiGraph()
    names = []
    for u, v in edges:
        for n in (u, v):
            if n not in names:
                names.append(n)
    for i, n in enumerate(names):
        g.add_node(n, position=i, kind="layer")
    for u, v in edges:
        g.add_edge(u, v, tensors=((u, 0, 0),))
    for n in names:
        if g.in_degree(n) == 0:
            g.nodes[n]["kind"] = "input"
    g.graph["tensors"] = {(n, 0, 0): TensorInfo((n, 0, 0), n, (None,), "float32", sizes.get(n, 1)) for n in names}
    g.graph["inputs"] = [(n, 0, 0) for n in names if g.nodes[n]["kind"] == "input"]
    sinks = [n for n in names if g.out_degree(n) == 0]
    g.graph["outputs"] = [(n, 0, 0) for n in (outputs or sinks)]
    return g


def chain_edges(n):
    return [(f"n{i}", f"n{i + 1}") for i in range(n)]


def residual_edges(blocks):
    """x -> a -> b -> add(x, b) per block: the block ends are the only
    single-tensor cut points."""
    edges, x = [], "in"
    for i in range(blocks):
        a, b, add = f"a{i}", f"b{i}", f"add{i}"
        edges += [(x, a), (a, b), (b, add), (x, add)]
        x = add
    return edges


def unet_edges(levels):
    edges, x, skips = [], "in", []
    for i in range(levels):
        edges.append((x, f"enc{i}"))
        skips.append(f"enc{i}")
        edges.append((f"enc{i}", f"pool{i}"))
        x = f"pool{i}"
    edges.append((x, "mid"))
    x = "mid"
    for i in reversed(range(levels)):
        edges += [(x, f"up{i}"), (f"up{i}", f"cat{i}"), (skips[i], f"cat{i}")]
        x = f"cat{i}"
    return edges


def dense_edges(n):
    """DenseNet-style: every layer takes every earlier output."""
    names = ["in"] + [f"d{i}" for i in range(n)]
    return [(names[j], names[i]) for i in range(1, len(names)) for j in range(i)]


def inception_edges(blocks):
    edges, x = [], "in"
    for i in range(blocks):
        branches = [f"b{i}_{k}" for k in range(4)]
        for k, b in enumerate(branches):
            if k % 2:
                edges += [(x, f"{b}_pre"), (f"{b}_pre", b)]
            else:
                edges.append((x, b))
            edges.append((b, f"cat{i}"))
        x = f"cat{i}"
    return edges


SHAPES = {
    "chain": chain_edges(30),
    "residual": residual_edges(8),
    "unet": unet_edges(4),
    "dense": dense_edges(10),
    "inception": inception_edges(3),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("segments", ["auto", "sqrt", 1, 2, 3, "all"])
def test_valid_plan_on_any_dag(shape, segments):
    g = literal_graph(SHAPES[shape])
    n = sum(d["kind"] == "layer" for _, d in g.nodes(data=True))
    plan = plan_segments(g, segments=n if segments == "all" else segments)
    validate_plan(g, plan)
    if segments != "auto":  # "auto" chooses the count: see test_auto_*
        expected = round(math.sqrt(n)) if segments == "sqrt" else (n if segments == "all" else segments)
        assert len(plan.segments) == expected
    assert all(plan.segments)


def test_validate_plan_catches_a_wrong_plan():
    g = literal_graph(residual_edges(3))
    plan = plan_segments(g, segments=3)
    broken = plan.segments[1].__class__(1, plan.segments[1].nodes, (), plan.segments[1].outputs)
    bad = plan.__class__((plan.segments[0], broken, plan.segments[2]), plan.order, "fixed")
    with pytest.raises(AssertionError, match="inputs"):
        validate_plan(g, bad)


def test_residual_cuts_land_on_single_tensor_cut_points():
    g = literal_graph(residual_edges(9))
    plan = plan_segments(g, segments=3)
    assert [len(s.inputs) for s in plan.segments] == [1, 1, 1]
    assert [s.nodes[-1] for s in plan.segments] == ["add2", "add5", "add8"]


def test_cheap_cut_preferred_over_a_big_tensor():
    sizes = {f"n{i}": 1000 for i in range(20)}
    sizes["n9"] = 1  # a bottleneck near the middle
    g = literal_graph(chain_edges(19), sizes)
    plan = plan_segments(g, segments=2)
    assert plan.segments[0].nodes[-1] == "n9"


def test_unet_skips_are_inputs_of_the_segments_that_use_them():
    g = literal_graph(unet_edges(3))
    plan = plan_segments(g, segments=3)
    validate_plan(g, plan)
    cat0 = next(s for s in plan.segments if "cat0" in s.nodes)
    if "enc0" not in cat0.nodes:
        assert ("enc0", 0, 0) in cat0.inputs


def test_residual_blocks_run_in_order():
    g = literal_graph(residual_edges(2))
    assert topological_order(g) == ("a0", "b0", "add0", "a1", "b1", "add1")


def test_side_branches_are_scheduled_early():
    """An auxiliary head off an early layer runs right after it, so its input
    does not cross every later cut."""
    edges = chain_edges(10) + [("n1", "aux")]
    g = literal_graph(edges)
    order = topological_order(g)
    assert order.index("aux") < order.index("n4")


def test_calls_made_from_inputs_alone_run_just_before_their_first_reader():
    """A mask made from an input (`graph.from_inputs`) runs where it is
    read: in ASAP order it ran first, and a plan kept its (large) output
    across every cut up to its reader."""
    edges = chain_edges(10) + [("in", "cast"), ("cast", "mask"), ("mask", "n8"), ("n0", "aux")]
    g = literal_graph(edges, sizes={"mask": 100})
    assert topological_order(g).index("mask") < topological_order(g).index("n3")  # ASAP without the field
    g.graph["from_inputs"] = frozenset({"cast", "mask", "aux"})
    order = topological_order(g)
    assert order[order.index("n8") - 2 : order.index("n8")] == ("cast", "mask")
    assert order.index("aux") < order.index("n2")  # no reader: stays where ASAP put it
    assert sorted(order) == sorted(n for n in g if g.nodes[n]["kind"] != "input")
    plan = plan_segments(g, segments=4)
    validate_plan(g, plan)
    reader = next(s for s in plan.segments if "n8" in s.nodes)
    assert "mask" in reader.nodes and all(("mask", 0, 0) not in s.outputs for s in plan.segments)


@pytest.mark.parametrize("bad", [0, -3, 99, 2.5, "abc", True, None])
def test_bad_segment_counts(bad):
    g = literal_graph(chain_edges(10))
    with pytest.raises(ValueError, match="segments"):
        plan_segments(g, segments=bad)


def test_plan_from_boundaries_and_to_dict():
    g = literal_graph(chain_edges(6))
    plan = plan_from_boundaries(g, topological_order(g), [0, 2, 4])
    assert plan.boundaries == (0, 2, 4, 6)
    data = plan.to_dict()
    assert [len(s["nodes"]) for s in data["segments"]] == [2, 2, 2]
    assert data["segments"][1]["inputs"] == [["n2", 0, 0]]


@pytest.mark.parametrize("name", sorted(models.ALL))
def test_plans_on_real_model_graphs_are_valid(name):
    g = build_graph(models.ALL[name]())
    for segments in ("auto", "sqrt", 2):
        validate_plan(g, plan_segments(g, segments=segments))


def test_numpy_int_segment_count_is_an_int():
    import numpy as np

    g = literal_graph(chain_edges(12))
    assert plan_segments(g, segments=np.int64(3)) == plan_segments(g, segments=3)
    with pytest.raises(ValueError, match="segments"):
        plan_segments(g, segments=np.float64(3.0))


def test_sqrt_plan_runs_its_last_segment_inline():
    g = literal_graph(chain_edges(16))
    sqrt = plan_segments(g, segments="sqrt")
    assert [s.remat for s in sqrt.segments] == [True, True, True, False]
    assert all(s.remat for s in plan_segments(g, segments=4).segments)
    assert plan_segments(literal_graph(chain_edges(2)), segments="sqrt").segments[0].remat  # one: recomputed


def test_default_is_auto_and_runs_its_last_segment_inline():
    g = literal_graph(chain_edges(16))
    auto = plan_segments(g)
    assert auto.strategy == "auto" and auto == plan_segments(g, segments="auto")
    assert len(auto.segments) > 1
    assert not auto.segments[-1].remat and auto.segments[0].remat


def test_short_segments_where_activations_are_big():
    """The first half of this chain makes tensors 100x bigger than the second:
    the least estimated peak puts more, shorter segments there."""
    sizes = {f"n{i}": (100 if i <= 12 else 1) for i in range(26)}
    g = literal_graph(chain_edges(25), sizes)
    lengths = [len(s.nodes) for s in plan_segments(g, segments=5).segments]
    assert sum(lengths[:3]) >= 12 and max(lengths[:3]) <= 5  # n1..n12 in three short segments
    assert lengths[-1] >= 10  # the small tail in one long one


def _least_peak_per_count(g, costs):
    """Brute force: for every segment count k, the least estimated peak of
    k segments, the last one run inline (the existing fixed-k search)."""
    from graphckpt.planner import MemoryModel, estimated_peak
    from graphckpt.planner.search import _least_peak_boundaries

    order = topological_order(g)
    spans = MemoryModel(g, costs, order)
    peaks = {}
    for k in range(1, len(order) + 1):
        starts = _least_peak_boundaries(spans, k, True)
        plan = plan_from_boundaries(g, order, starts, remat=[True] * (k - 1) + [False])
        peaks[k] = estimated_peak(g, plan, costs)
    return peaks


def _random_costs(g, seed):
    import random

    from graphckpt.planner import NodeCosts, graph_costs

    rnd = random.Random(seed)
    base = graph_costs(g)
    layer_nodes = [n for n, d in g.nodes(data=True) if d["kind"] == "layer"]
    return NodeCosts(
        tensor_bytes={k: rnd.choice([1, 2, 5, 40, 300]) for k in base.tensor_bytes},
        saved=frozenset(k for k in base.tensor_bytes if rnd.random() < 0.7),
        internal={v: rnd.choice([0, 0, 3, 80]) for v in layer_nodes},
        workspace={v: rnd.choice([0, 10, 50]) for v in layer_nodes},
        compute={v: 1.0 for v in layer_nodes},
        fixed=7,
    )


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_recomputes_least_near_the_least_peak(shape, seed):
    """"auto" is the plan of least recompute among those whose estimated
    peak is within 1% of the least any plan of one level reaches (the
    plain Pareto dynamic program, `tests/planner/references.py`, at that
    cap); so never above that peak, and below the best of every segment
    count of the old search (recomputed segments, then one inline) or
    within 1% of it."""
    from graphckpt.planner import MemoryModel, estimated_peak, segment_peaks, smallest_peak
    from graphckpt.planner.search import AUTO_TOLERANCE
    from tests.planner.references import reference_search

    g = literal_graph(SHAPES[shape])
    costs = _random_costs(g, seed)
    auto = plan_segments(g, segments="auto", costs=costs)
    validate_plan(g, auto)
    least = smallest_peak(g, costs)
    cap = least + int(AUTO_TOLERANCE * least)
    assert least <= estimated_peak(g, auto, costs) <= cap
    spans = MemoryModel(g, costs, topological_order(g))
    best, _ = reference_search(spans, cap - costs.fixed, [0] * (spans.n + 1))
    assert sum(p.recompute_cost for p in segment_peaks(g, auto, costs)) == pytest.approx(best)
    assert least <= min(_least_peak_per_count(g, costs).values())


def test_auto_keeps_segments_whole_where_they_fit_under_the_least_peak():
    """A chain whose first calls make small tensors and the rest big ones:
    the least peak is set by the big ones, and the small head fits under it
    run as it is, so the default recomputes none of it (the old search,
    recomputed segments then one inline, recomputed it all)."""
    from graphckpt.planner import graph_costs

    sizes = {f"n{i}": (1 if i <= 8 else 100) for i in range(25)}
    g = literal_graph(chain_edges(24), sizes)
    auto = plan_segments(g, costs=graph_costs(g))
    head = auto.segments[0]
    assert not head.remat and {"n1", "n2", "n3"} <= set(head.nodes)
    assert any(s.remat for s in auto.segments)


def test_auto_on_a_uniform_chain_is_about_sqrt_n():
    for n in (16, 64, 144):
        k = len(plan_segments(literal_graph(chain_edges(n))).segments)
        assert math.sqrt(n) / 2 <= k <= 2 * math.sqrt(n), (n, k)


def test_auto_keeps_the_model_as_it_is_when_no_cut_helps():
    """Two calls, the last making a huge output: the cut between them holds
    the first call's output during the second one's backward, which the
    original keeps anyway, so the peak ties with the original's and the
    fewest segments win: one, not recomputed."""
    from graphckpt.planner import baseline_peak, estimated_peak, graph_costs

    g = literal_graph(chain_edges(2), {"n0": 1, "n1": 1, "n2": 10_000})
    costs = graph_costs(g)
    two = plan_from_boundaries(g, topological_order(g), [0, 1], remat=[True, False])
    assert estimated_peak(g, two, costs) == baseline_peak(g, costs)  # the tie
    auto = plan_segments(g)
    assert len(auto.segments) == 1 and not auto.segments[0].remat


def test_auto_searches_every_count_on_one_span_table():
    """The search over segment counts reuses one table of span costs
    (building one is O(n^2)), not one per count."""
    import importlib

    plan_module = importlib.import_module("graphckpt.planner.memory")
    made = []
    original = plan_module.MemoryModel.__init__

    def counting(self, *args, **kwargs):
        made.append(1)
        original(self, *args, **kwargs)

    g = literal_graph(chain_edges(300))
    plan_module.MemoryModel.__init__ = counting
    try:
        auto = plan_segments(g)
    finally:
        plan_module.MemoryModel.__init__ = original
    assert made == [1]
    validate_plan(g, auto)
    assert 9 <= len(auto.segments) <= 35  # about sqrt(300) = 17
