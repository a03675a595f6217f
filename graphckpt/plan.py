"""Pure planning over a layer-call graph: where to cut it into segments.

Contract:
- Input: a `networkx.DiGraph` shaped like `graphckpt.graph.build_graph`'s
  output. Only node attributes `kind` and `position`, edge attribute
  `tensors`, and `graph.graph["tensors"]` (each with `producer` and
  `nbytes`) / `["outputs"]` are read. This module never imports Keras.
- Output: an immutable `Plan`. Its segments are contiguous runs of one
  topological order that cover every layer call exactly once; a segment's
  `inputs` are the tensors made before it and used inside it, its `outputs`
  the tensors made inside it and used after it (or returned by the model).
- Works on any DAG: no articulation points are needed. Boundaries where few
  bytes cross are preferred, so single-tensor cut points win where they
  exist.

References:
    Chen, Xu, Zhang, Guestrin. "Training Deep Nets with Sublinear Memory
    Cost", 2016 (sqrt(n) segments; segment inputs kept, interiors recomputed).
"""

import dataclasses
import math

import networkx as nx

__all__ = [
    "PlannedSegment",
    "Plan",
    "topological_order",
    "crossing_bytes",
    "plan_from_boundaries",
    "plan_segments",
    "validate_plan",
]


@dataclasses.dataclass(frozen=True)
class PlannedSegment:
    """One segment: its layer calls in order, and the tensors that cross it."""

    index: int
    nodes: tuple
    inputs: tuple
    outputs: tuple


@dataclasses.dataclass(frozen=True)
class Plan:
    """An immutable segmentation of a model's layer calls.

    Attributes:
        segments: `PlannedSegment`s in execution order.
        order: every layer call, in the topological order the segments cut.
        strategy: how it was chosen, e.g. `"sqrt"` or `"fixed"`.
    """

    segments: tuple
    order: tuple
    strategy: str

    @property
    def num_layer_calls(self):
        return len(self.order)

    @property
    def boundaries(self):
        """Start position of each segment in `order`, plus `len(order)`."""
        starts, pos = [], 0
        for seg in self.segments:
            starts.append(pos)
            pos += len(seg.nodes)
        return tuple(starts) + (pos,)

    def to_dict(self):
        """Plain, JSON-friendly data: lists of keys per segment."""
        return {
            "strategy": self.strategy,
            "segments": [
                {
                    "index": s.index,
                    "nodes": [list(n) for n in s.nodes],
                    "inputs": [list(t) for t in s.inputs],
                    "outputs": [list(t) for t in s.outputs],
                }
                for s in self.segments
            ],
        }


def _layer_nodes(graph):
    return [n for n, d in graph.nodes(data=True) if d["kind"] != "input"]


def topological_order(graph):
    """Layer calls in ASAP order: by longest path from an input, then by
    Keras's own execution position.

    Scheduling each call as early as its inputs allow ends the life of side
    branches (auxiliary heads, early outputs) soon after their input is made,
    so fewer tensors cross later cuts.
    """
    order = []
    for generation in nx.topological_generations(graph):
        generation = sorted(generation, key=lambda n: graph.nodes[n]["position"])
        order.extend(n for n in generation if graph.nodes[n]["kind"] != "input")
    return tuple(order)


def _consumers(graph):
    """tensor key -> list of consuming layer calls."""
    consumers = {}
    for u, v, data in graph.edges(data=True):
        for t in data["tensors"]:
            consumers.setdefault(t, []).append(v)
    return consumers


def crossing_bytes(graph, order):
    """Bytes per example that cross each boundary of `order`.

    Returns a list `c` of length `len(order) + 1`: `c[b]` is the size of the
    tensors made by `order[:b]` and still needed by `order[b:]` or returned
    by the model. Model inputs are held by the caller anyway; they count 0.
    """
    pos = {n: i for i, n in enumerate(order)}
    n = len(order)
    delta = [0] * (n + 2)
    outputs = set(graph.graph["outputs"])
    consumers = _consumers(graph)
    for key, info in graph.graph["tensors"].items():
        if info.producer not in pos:
            continue
        start = pos[info.producer] + 1
        uses = [pos[c] for c in consumers.get(key, ())]
        end = n if key in outputs else max(uses, default=start - 1)
        if end >= start:
            delta[start] += info.nbytes
            delta[end + 1] -= info.nbytes
    running, out = 0, []
    for b in range(n + 1):
        running += delta[b]
        out.append(running)
    return out


def plan_from_boundaries(graph, order, boundaries, strategy="fixed"):
    """Builds the `Plan` that cuts `order` at `boundaries`.

    Args:
        graph: the layer-call graph.
        order: a topological order of its layer calls.
        boundaries: increasing start positions, beginning with 0; the last
            segment runs to the end of `order`.
        strategy: a label stored on the plan.
    """
    order = tuple(order)
    bounds = list(boundaries) + [len(order)]
    consumers = _consumers(graph)
    tensors = graph.graph["tensors"]
    model_outputs = set(graph.graph["outputs"])
    segment_of = {}
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for node in order[a:b]:
            segment_of[node] = i
    segments = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        nodes = order[a:b]
        inputs = []
        for node in nodes:
            for pred in graph.predecessors(node):
                for t in graph.edges[pred, node]["tensors"]:
                    if segment_of.get(tensors[t].producer) != i and t not in inputs:
                        inputs.append(t)
        outputs = []
        for node in nodes:
            for t in sorted(k for k, info in tensors.items() if info.producer == node):
                used_later = any(segment_of[c] != i for c in consumers.get(t, ()))
                if used_later or t in model_outputs:
                    outputs.append(t)
        segments.append(PlannedSegment(i, nodes, tuple(inputs), tuple(outputs)))
    return Plan(segments=tuple(segments), order=order, strategy=strategy)


def _best_boundaries(cross, n, k):
    """Dynamic programming: k segments, lengths within [L/2, 3L/2] for
    L = n/k, minimizing the bytes crossing the k-1 cuts; ties go to the
    most even lengths."""
    avg = n / k
    lo = max(1, math.floor(avg / 2))
    hi = max(lo, math.ceil(1.5 * avg))
    inf = (math.inf, math.inf)
    best = [{0: ((0, 0.0), None)}]
    for j in range(1, k + 1):
        row = {}
        first, last = j * lo, n - (k - j) * lo
        for b in range(first, last + 1):
            if j == k and b != n:
                continue
            cut = cross[b] if b < n else 0
            choice = inf, None
            for length in range(lo, hi + 1):
                prev = best[j - 1].get(b - length)
                if prev is None:
                    continue
                (bytes_, dev), _ = prev
                cost = (bytes_ + cut, dev + (length - avg) ** 2)
                if cost < choice[0]:
                    choice = cost, b - length
            if choice[1] is not None:
                row[b] = choice
        best.append(row)
    bounds, b = [], n
    for j in range(k, 0, -1):
        b = best[j][b][1]
        bounds.append(b)
    return sorted(bounds)


def plan_segments(graph, segments="sqrt"):
    """Plans `segments` checkpointed segments over the graph's layer calls.

    Args:
        graph: a layer-call graph (see `graphckpt.graph`).
        segments: `"sqrt"` for round(sqrt(n)) segments over n layer calls,
            or a positive int no larger than n.

    Returns:
        A `Plan`.

    Raises:
        ValueError: `segments` is not `"sqrt"` nor an int in [1, n].

    Example:
        >>> plan = plan_segments(graph, segments=4)
        >>> [len(s.nodes) for s in plan.segments]
    """
    order = topological_order(graph)
    n = len(order)
    if segments == "sqrt":
        k, strategy = max(1, round(math.sqrt(n))), "sqrt"
    elif isinstance(segments, int) and not isinstance(segments, bool) and 1 <= segments <= n:
        k, strategy = segments, "fixed"
    else:
        raise ValueError(
            f"`segments` must be 'sqrt' or an int from 1 to the number of "
            f"layer calls ({n}). Received: segments={segments!r}"
        )
    bounds = _best_boundaries(crossing_bytes(graph, order), n, k)
    return plan_from_boundaries(graph, order, bounds, strategy=strategy)


def validate_plan(graph, plan):
    """Raises `AssertionError` if `plan` breaks the module's contract."""
    layer_nodes = set(_layer_nodes(graph))
    covered = [n for s in plan.segments for n in s.nodes]
    assert sorted(covered, key=str) == sorted(layer_nodes, key=str), "cover"
    pos = {n: i for i, n in enumerate(covered)}
    for u, v in graph.edges:
        if u in pos:
            assert pos[u] < pos[v], f"order: {u} after {v}"
    tensors = graph.graph["tensors"]
    consumers = _consumers(graph)
    outputs = set(graph.graph["outputs"])
    for seg in plan.segments:
        inside = set(seg.nodes)
        want_in = {
            t
            for node in seg.nodes
            for p in graph.predecessors(node)
            for t in graph.edges[p, node]["tensors"]
            if tensors[t].producer not in inside
        }
        want_out = {
            t
            for t, info in tensors.items()
            if info.producer in inside
            and (t in outputs or any(c not in inside for c in consumers.get(t, ())))
        }
        assert set(seg.inputs) == want_in, f"inputs of segment {seg.index}"
        assert set(seg.outputs) == want_out, f"outputs of segment {seg.index}"
