"""The pure planner, on small literal graphs and on real models' graphs."""

import math

import networkx as nx
import pytest

from graphckpt.graph import TensorInfo, build_graph
from graphckpt.plan import (
    plan_from_boundaries,
    plan_segments,
    topological_order,
    validate_plan,
)
from tests import models


def literal_graph(edges, sizes=None, outputs=None):
    """A graph in graph.py's schema from an edge list of node names.

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
@pytest.mark.parametrize("segments", ["sqrt", 1, 2, 3, "all"])
def test_valid_plan_on_any_dag(shape, segments):
    g = literal_graph(SHAPES[shape])
    n = sum(d["kind"] == "layer" for _, d in g.nodes(data=True))
    plan = plan_segments(g, segments=n if segments == "all" else segments)
    validate_plan(g, plan)
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
    for segments in ("sqrt", 2):
        validate_plan(g, plan_segments(g, segments=segments))


def test_numpy_int_segment_count_is_an_int():
    import numpy as np

    g = literal_graph(chain_edges(12))
    assert plan_segments(g, segments=np.int64(3)) == plan_segments(g, segments=3)
    with pytest.raises(ValueError, match="segments"):
        plan_segments(g, segments=np.float64(3.0))


def test_default_plan_runs_its_last_segment_inline():
    g = literal_graph(chain_edges(16))
    sqrt = plan_segments(g)
    assert [s.remat for s in sqrt.segments] == [True, True, True, False]
    assert all(s.remat for s in plan_segments(g, segments=4).segments)
    assert plan_segments(literal_graph(chain_edges(2))).segments[0].remat  # one segment: recomputed


def test_short_segments_where_activations_are_big():
    """The first half of this chain makes tensors 100x bigger than the second:
    the least estimated peak puts more, shorter segments there."""
    sizes = {f"n{i}": (100 if i <= 12 else 1) for i in range(26)}
    g = literal_graph(chain_edges(25), sizes)
    lengths = [len(s.nodes) for s in plan_segments(g, segments=5).segments]
    assert sum(lengths[:3]) >= 12 and max(lengths[:3]) <= 5  # n1..n12 in three short segments
    assert lengths[-1] >= 10  # the small tail in one long one
