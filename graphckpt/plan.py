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
- Works on any DAG: no articulation points are needed. `plan_segments`
  cuts where the estimated peak (the memory model below) is least, so
  segments are short where activations are big and single-tensor cut
  points win where they exist.
- Memory budgets: given per-call costs (`NodeCosts`, made by
  `graphckpt.estimate` from a Keras model, or by hand), `plan_for_budget`
  finds the plan of least recompute whose estimated peak fits a budget, and
  `segment_peaks` / `estimated_peak` evaluate the same memory model on any
  plan. Segments may be marked `remat=False`: their calls run as they are.
  The module uses numpy for the span tables, never Keras.

References:
    Chen, Xu, Zhang, Guestrin. "Training Deep Nets with Sublinear Memory
    Cost", 2016 (sqrt(n) segments; segment inputs kept, interiors recomputed;
    memory-budgeted segmentation).

    Feng, Huang. "Optimal Gradient Checkpoint Search for Arbitrary
    Computation Graphs", CVPR 2021 (dynamic programming over a linearized
    arbitrary graph).
"""

import dataclasses
import functools
import math
import numbers

import networkx as nx

__all__ = [
    "PlannedSegment",
    "Plan",
    "topological_order",
    "plan_from_boundaries",
    "plan_segments",
    "graph_costs",
    "validate_plan",
    "NodeCosts",
    "SegmentPeak",
    "BudgetInfeasible",
    "segment_peaks",
    "estimated_peak",
    "baseline_peak",
    "smallest_peak",
    "plan_for_budget",
]


@dataclasses.dataclass(frozen=True)
class PlannedSegment:
    """One segment: its layer calls in order, and the tensors that cross it.

    `remat` is true for a checkpointed segment (only its inputs are kept for
    backward; its interior is recomputed). A segment with `remat=False` runs
    its layer calls as they are, keeping what they keep: budget plans and
    recompute policies use such segments for calls not worth recomputing.
    """

    index: int
    nodes: tuple
    inputs: tuple
    outputs: tuple
    remat: bool = True


@dataclasses.dataclass(frozen=True)
class Plan:
    """An immutable segmentation of a model's layer calls.

    Attributes:
        segments: `PlannedSegment`s in execution order.
        order: every layer call, in the topological order the segments cut.
        strategy: how it was chosen: `"auto"`, `"sqrt"`, `"fixed"`,
            `"budget"` or `"policy"`.
        estimated_peak_bytes: the estimated peak training-step activation
            memory of the checkpointed model (see `graphckpt.estimate`), or
            None when not estimated.
        baseline_peak_bytes: the same estimate for the original model.
        batch_size: the batch size of both estimates. None means they are
            per example: activation memory only, which scales linearly with
            the batch (parameter-sized gradient buffers left out).
        budget_bytes: the budget a `"budget"` plan was made for.
        policy: the name of the recompute policy used, if any.
    """

    segments: tuple
    order: tuple
    strategy: str
    estimated_peak_bytes: int | None = None
    baseline_peak_bytes: int | None = None
    batch_size: int | None = None
    budget_bytes: int | None = None
    policy: str | None = None

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
            "estimated_peak_bytes": self.estimated_peak_bytes,
            "baseline_peak_bytes": self.baseline_peak_bytes,
            "batch_size": self.batch_size,
            "budget_bytes": self.budget_bytes,
            "policy": self.policy,
            "segments": [
                {
                    "index": s.index,
                    "remat": s.remat,
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

    Calls in one of `graph.graph["state_chains"]` keep their relative order:
    each reads the state (BatchNormalization statistics, a seed generator)
    the call before it updated, so reordering them changes the results.
    """
    constrained = nx.DiGraph(graph.edges)
    constrained.add_nodes_from(graph)
    for chain in graph.graph.get("state_chains", ()):
        constrained.add_edges_from(zip(chain, chain[1:]))
    order = []
    for generation in nx.topological_generations(constrained):
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


def plan_from_boundaries(graph, order, boundaries, strategy="fixed", remat=None):
    """Builds the `Plan` that cuts `order` at `boundaries`.

    Args:
        graph: the layer-call graph.
        order: a topological order of its layer calls.
        boundaries: increasing start positions, beginning with 0; the last
            segment runs to the end of `order`.
        strategy: a label stored on the plan.
        remat: optional sequence of bools, one per segment: False marks a
            segment whose layer calls run as they are (default: all True).
    """
    order = tuple(order)
    remat = [True] * len(boundaries) if remat is None else [bool(r) for r in remat]
    if len(remat) != len(boundaries):
        raise ValueError(f"`remat` needs one flag per segment ({len(boundaries)}). Received: {len(remat)} flags")
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
        segments.append(PlannedSegment(i, nodes, tuple(inputs), tuple(outputs), remat[i]))
    return Plan(segments=tuple(segments), order=order, strategy=strategy)


def graph_costs(graph):
    """`NodeCosts` from the graph alone: each tensor's bytes per example,
    every tensor kept for backward, no other memory, unit compute per call.

    What `plan_segments` plans with when no estimate of the layers is at
    hand (`graphckpt.estimate.node_costs` knows more about each layer)."""
    tensors = graph.graph["tensors"]
    layer_nodes = _layer_nodes(graph)
    return NodeCosts(
        tensor_bytes={k: info.nbytes for k, info in tensors.items()},
        saved=frozenset(tensors),
        internal={},
        workspace={},
        compute={v: 1.0 for v in layer_nodes},
        per_example=True,
    )


def _fewest_held(spans, k, cap, last_kept):
    """Plans of exactly k segments whose peaks all fit `cap`: dynamic
    programming over cut positions keeping, for each (segments so far, cut
    position), the least bytes held for the later segments (later peaks only
    grow with it). The last segment is not recomputed when `last_kept`.

    Returns the start positions of the segments, or None when none fits."""
    import numpy as np

    n = spans.n
    best = np.full((k + 1, n + 1), np.inf)  # [segments, cut position]
    best[0, 0] = 0.0
    back = np.zeros((k + 1, n + 1), dtype=int)
    for b in range(1, n + 1):
        last = last_kept and b == n
        inner = (spans.inner_kept if last else spans.inner_remat)[:b, b]
        held = (spans.held_kept if last else spans.held_remat)[:b, b]
        prev = best[:k, :b]
        vals = np.where(prev + inner[None, :] <= cap, prev + held[None, :], np.inf)
        back[1:, b] = vals.argmin(axis=1)
        best[1:, b] = vals[np.arange(k), back[1:, b]]
    if not np.isfinite(best[k, n]):
        return None
    starts, b = [], n
    for j in range(k, 0, -1):
        b = int(back[j, b])
        starts.append(b)
    return starts[::-1]


def _least_peak_boundaries(spans, k, last_kept):
    """Start positions of the k segments whose estimated peak is least (the
    memory model of `_Spans`); among those, the plan holding fewest bytes.

    Bisection over integer byte caps: plans of the even split always fit
    the estimated peak of the even split."""
    n = spans.n
    even = [round(i * n / k) for i in range(k)]
    held, hi = 0.0, 0.0
    for i, (a, b) in enumerate(zip(even, even[1:] + [n])):
        last = last_kept and i == k - 1
        hi = max(hi, held + spans.inner(a, b, not last))
        held += spans.held(a, b, not last)
    lo, hi = 0, int(math.ceil(hi))
    while lo < hi:
        mid = (lo + hi) // 2
        if _fewest_held(spans, k, mid, last_kept) is None:
            lo = mid + 1
        else:
            hi = mid
    return _fewest_held(spans, k, lo, last_kept)


def _fits_any_count(spans, cap):
    """Whether some plan of recomputed segments followed by one segment run
    as it is (any number of segments) keeps every peak within `cap`.

    Dynamic programming over cut positions keeping, per position, the least
    bytes held for the later segments (later peaks only grow with it)."""
    import numpy as np

    n = spans.n
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    inner, held = spans.inner_remat_t, spans.held_remat_t  # [b, a]: contiguous columns
    for b in range(1, n):
        prev = best[:b]
        vals = np.where(prev + inner[b, :b] <= cap, prev + held[b, :b], np.inf)
        best[b] = vals.min()
    return bool((best[:n] + spans.inner_kept[:n, n] <= cap).any())


def _fewest_segments(spans, cap):
    """The fewest segments (recomputed ones, then one run as it is) of a plan
    whose peaks all fit `cap`, or None when no plan fits.

    Counts up, one segment at a time, over the least bytes held for each
    (count, cut position), each step vectorized over every cut. It stops
    when a plan fits, or when another segment lowers the held bytes at no
    cut position: then no plan with more segments fits either."""
    import numpy as np

    n = spans.n
    prev = np.full(n + 1, np.inf)  # least held, by cut position, for j segments
    prev[0] = 0.0
    seen = prev.copy()  # the least over every count so far
    for j in range(1, n + 1):
        if (prev[:n] + spans.inner_kept[:n, n] <= cap).any():
            return j  # j - 1 recomputed segments, then the last one
        rows = np.flatnonzero(np.isfinite(prev[:n]))
        base = prev[rows, None]
        vals = np.where(base + spans.inner_remat_masked[rows] <= cap, base + spans.held_remat[rows], np.inf)
        prev = np.full(n + 1, np.inf)
        prev[: n] = vals[:, :n].min(axis=0)
        if not (prev < seen).any():
            return None
        seen = np.minimum(seen, prev)
    return None


def _auto_boundaries(spans):
    """Start positions of the plan whose estimated peak is least over every
    number of segments (recomputed ones, then one run as it is); among
    those, the fewest segments, then the fewest bytes held.

    Bisection over integer byte caps: the plan with one segment run as it
    is (the original model) always fits its own peak."""
    lo, hi = 0, int(math.ceil(spans.inner_kept[0, spans.n]))
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits_any_count(spans, mid):
            hi = mid
        else:
            lo = mid + 1
    k = _fewest_segments(spans, lo)
    return _fewest_held(spans, k, lo, True)


SEGMENT_CHOICES = ("auto", "sqrt")


def plan_segments(graph, segments="auto", costs=None):
    """Plans the segments over the graph's layer calls.

    Boundaries go where the estimated peak of the checkpointed model is
    least (the memory model of `segment_peaks`: the boundary tensors held
    for the earlier segments plus one segment's recompute), which puts
    short segments where activations are big and cuts where few bytes
    cross.

    Args:
        graph: a layer-call graph (see `graphckpt.graph`).
        segments: `"auto"` (default) chooses the number of segments too: the
            least estimated peak over every count (ties: fewer segments),
            the last segment run as it is (its backward pass follows its
            forward pass at once, so recomputing it would save nothing).
            On a uniform chain that is about sqrt(n) segments; on a
            transformer stack about one block per segment; one segment run
            as it is (no recompute) when no cut lowers the estimate.
            `"sqrt"`: round(sqrt(n)) segments over n layer calls, the last
            one run as it is. A positive int k no larger than n: k
            segments, all recomputed.
        costs: `NodeCosts` for the memory model (default: `graph_costs`).

    Returns:
        A `Plan`.

    Raises:
        ValueError: `segments` is not `"auto"`, `"sqrt"` nor an int in [1, n].

    Example:
        >>> plan = plan_segments(graph, segments=4)
        >>> [len(s.nodes) for s in plan.segments]
    """
    order = topological_order(graph)
    n = len(order)
    if segments in SEGMENT_CHOICES:
        strategy = segments
    elif isinstance(segments, numbers.Integral) and not isinstance(segments, bool) and 1 <= segments <= n:
        strategy = "fixed"  # numpy ints too
    else:
        raise ValueError(
            f"`segments` must be 'auto', 'sqrt' or an int from 1 to the number of "
            f"layer calls ({n}). Received: segments={segments!r}"
        )
    spans = _spans_for(graph, order, costs or graph_costs(graph))
    if strategy == "auto":
        starts = _auto_boundaries(spans)
        last_kept = True
    else:
        k = max(1, round(math.sqrt(n))) if strategy == "sqrt" else int(segments)
        last_kept = strategy == "sqrt" and k > 1
        starts = _least_peak_boundaries(spans, k, last_kept)
    remat = [True] * (len(starts) - 1) + [not last_kept]
    return plan_from_boundaries(graph, order, starts, strategy=strategy, remat=remat)


def validate_plan(graph, plan):
    """Raises `AssertionError` if `plan` breaks the module's contract."""
    layer_nodes = set(_layer_nodes(graph))
    covered = [n for s in plan.segments for n in s.nodes]
    assert sorted(covered, key=str) == sorted(layer_nodes, key=str), "cover"
    pos = {n: i for i, n in enumerate(covered)}
    for u, v in graph.edges:
        if u in pos:
            assert pos[u] < pos[v], f"order: {u} after {v}"
    for chain in graph.graph.get("state_chains", ()):
        assert [pos[n] for n in chain] == sorted(pos[n] for n in chain), f"state order: {chain}"
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


# ---------------------------------------------------------------- memory budget


@dataclasses.dataclass(frozen=True)
class NodeCosts:
    """What the memory model needs about each layer call, for one batch.

    `graphckpt.estimate.node_costs` makes one from a Keras model; tests make
    them by hand. Bytes are absolute for the batch the costs were made for
    (per example when `per_example` is true).

    Attributes:
        tensor_bytes: tensor key -> bytes of that tensor.
        saved: tensor keys the original model keeps for backward (because
            the producer or a consumer needs the value in its gradient).
        internal: layer call -> bytes it keeps for backward besides graph
            tensors: pre-activations, dropout masks, attention scores...
        workspace: layer call -> transient bytes of its backward step
            (input and parameter gradients, temporaries).
        compute: layer call -> cost of running it forward once (FLOPs).
        fixed: bytes every plan pays alike (the loss, the batch's gradients).
        per_example: whether the bytes are per example.
    """

    tensor_bytes: dict
    saved: frozenset
    internal: dict
    workspace: dict
    compute: dict
    fixed: int = 0
    per_example: bool = False


@dataclasses.dataclass(frozen=True)
class SegmentPeak:
    """The memory model's view of one segment during the backward pass.

    Attributes:
        index: the segment's index in the plan.
        remat: whether it is recomputed.
        held_before_bytes: bytes held for the segments before it when its
            backward runs (their boundary tensors, or everything a
            non-recomputed segment keeps).
        held_bytes: what this segment holds for the later segments'
            backward: its output tensors (values or their gradients) when
            recomputed; everything its calls keep when not.
        recompute_peak_bytes: the segment's own peak during its backward:
            what its calls keep (recomputed, when `remat`), plus the
            gradients of its outputs and the largest backward workspace.
        peak_bytes: `fixed + held_before + recompute_peak`.
        recompute_cost: forward cost recomputed for it (0 when not `remat`).
    """

    index: int
    remat: bool
    held_before_bytes: int
    held_bytes: int
    recompute_peak_bytes: int
    peak_bytes: int
    recompute_cost: float


class BudgetInfeasible(ValueError):
    """No plan's estimated peak fits the budget. `smallest_bytes` is the
    smallest estimated peak any plan reaches."""

    def __init__(self, message, smallest_bytes, budget_bytes):
        super().__init__(message)
        self.smallest_bytes = smallest_bytes
        self.budget_bytes = budget_bytes


class _Spans:
    """Memory-model quantities of every span `[a, b)` of one order.

    The model (all bytes for one batch), for segments run in reverse during
    the backward pass, segment i spanning positions [a_i, b_i):
        peak = fixed + max_i (sum_{j<i} held_j + inner_i)
        held_j = out(a_j, b_j)                      recomputed segment
               = kept(a_j, b_j) + unsaved_out(a_j, b_j)   otherwise
        inner_i = max_{v in seg} (kept(a_i, v+1) + workspace(v))
                  + out(a_i, b_i)  [+ in(a_i, b_i) when recomputed]
    `out(a, b)`: tensors made in [a, b) and used at b or later (as values
    for later consumers, or as gradients coming back from them);
    `in(a, b)`: tensors made before a and used in [a, b), which the
    recompute copies (TensorFlow's `recompute_grad` orders it after the
    incoming gradient through a data dependency on every argument).
    """

    def __init__(self, graph, order, costs):
        import numpy as np

        self.n = n = len(order)
        pos = {v: i for i, v in enumerate(order)}
        consumers = _consumers(graph)
        model_outputs = set(graph.graph["outputs"])
        # produced[p][last_use] bytes; first_use/last_use of tensors made before
        made = np.zeros((n + 1, n + 2))  # [producer position, last use]
        unsaved = np.zeros((n + 1, n + 2))
        in_diff = np.zeros((n + 2, n + 2))  # 2-D difference array of in(a, b)
        produced = {}
        for key, info in graph.graph["tensors"].items():
            uses = sorted({pos[c] for c in consumers.get(key, ()) if c in pos})
            nbytes = costs.tensor_bytes.get(key, 0)
            p = pos.get(info.producer, -1)  # -1: a model input
            if p >= 0:
                produced.setdefault(info.producer, []).append(key)
                last = n if key in model_outputs else (uses[-1] if uses else p)
                if last > p:
                    made[p, last] += nbytes
                    if key not in costs.saved:
                        unsaved[p, last] += nbytes
            # A span [a, b) takes the tensor as an input when a > p and its
            # first use at or after a comes before b: for a in
            # (previous use, use], every b > use.
            prev = p
            for use in uses:
                in_diff[prev + 1, use + 1] += nbytes
                in_diff[use + 1, use + 1] -= nbytes
                prev = use
        self.produced = produced
        kept = np.array([costs.internal.get(v, 0) for v in order], dtype=float)
        for v in order:
            kept[pos[v]] += sum(costs.tensor_bytes.get(t, 0) for t in produced.get(v, ()) if t in costs.saved)
        work = np.array([costs.workspace.get(v, 0) for v in order], dtype=float)
        comp = np.array([costs.compute.get(v, 0.0) for v in order], dtype=float)
        self.kept_prefix = np.concatenate([[0.0], np.cumsum(kept)])
        self.compute_prefix = np.concatenate([[0.0], np.cumsum(comp)])
        self.fixed = costs.fixed
        # out(a, b) = sum_{a <= p < b, last >= b} made[p, last]
        suffix = np.cumsum(made[:, ::-1], axis=1)[:, ::-1]  # suffix[p, b] = sum_{last >= b}
        usuffix = np.cumsum(unsaved[:, ::-1], axis=1)[:, ::-1]
        cum = np.concatenate([np.zeros((1, n + 2)), np.cumsum(suffix, axis=0)])  # cum[x, b] = sum_{p < x}
        ucum = np.concatenate([np.zeros((1, n + 2)), np.cumsum(usuffix, axis=0)])
        self.out = np.diagonal(cum[:, : n + 1])[None, :] - cum[: n + 1, : n + 1]  # [a, b]
        self.unsaved_out = np.diagonal(ucum[:, : n + 1])[None, :] - ucum[: n + 1, : n + 1]
        self.in_ = np.cumsum(np.cumsum(in_diff, axis=0), axis=1)[: n + 1, : n + 1]
        # max_{v in [a, b)} (kept_prefix[v+1] + work[v]) - kept_prefix[a]
        z = self.kept_prefix[1:] + work
        self.work_peak = np.zeros((n + 1, n + 1))
        for a in range(n):
            self.work_peak[a, a + 1 :] = np.maximum.accumulate(z[a:]) - self.kept_prefix[a]

        # The four span matrices the search reads, indexed [a, b].
        kept_span = self.kept_prefix[None, :] - self.kept_prefix[:, None]
        self.inner_kept = self.work_peak + self.out
        self.inner_remat = self.inner_kept + self.in_
        self.held_kept = kept_span + self.unsaved_out
        self.held_remat = self.out
        self.cost_span = self.compute_prefix[None, :] - self.compute_prefix[:, None]

    # For the search over segment counts (`segments="auto"`), made when
    # first read: columns as contiguous rows, and spans [a, b) with a >= b
    # ruled out.
    @functools.cached_property
    def inner_remat_t(self):
        import numpy as np

        return np.ascontiguousarray(self.inner_remat.T)

    @functools.cached_property
    def held_remat_t(self):
        import numpy as np

        return np.ascontiguousarray(self.held_remat.T)

    @functools.cached_property
    def inner_remat_masked(self):
        import numpy as np

        return np.where(np.triu(np.ones((self.n + 1, self.n + 1), dtype=bool), 1), self.inner_remat, np.inf)

    def inner(self, a, b, remat):
        return float((self.inner_remat if remat else self.inner_kept)[a, b])

    def held(self, a, b, remat):
        return float((self.held_remat if remat else self.held_kept)[a, b])

    def cost(self, a, b):
        return float(self.cost_span[a, b])


def _spans_for(graph, order, costs):
    return _Spans(graph, tuple(order), costs)


def segment_peaks(graph, plan, costs):
    """The memory model's per-segment view of `plan` (see `_Spans`).

    Args:
        graph: the layer-call graph.
        plan: a `Plan` over it (any strategy; `remat` flags honoured).
        costs: `NodeCosts` for the graph.

    Returns:
        A tuple of `SegmentPeak`, one per segment; the plan's estimated
        peak is the largest `peak_bytes`.
    """
    spans = _spans_for(graph, plan.order, costs)
    held, out = 0.0, []
    bounds = plan.boundaries
    for seg, a, b in zip(plan.segments, bounds, bounds[1:]):
        inner = spans.inner(a, b, seg.remat)
        h = spans.held(a, b, seg.remat)
        out.append(
            SegmentPeak(
                index=seg.index,
                remat=seg.remat,
                held_before_bytes=int(round(held)),
                held_bytes=int(round(h)),
                recompute_peak_bytes=int(round(inner)),
                peak_bytes=int(round(costs.fixed + held + inner)),
                recompute_cost=spans.cost(a, b) if seg.remat else 0.0,
            )
        )
        held += h
    return tuple(out)


def estimated_peak(graph, plan, costs):
    """The memory model's peak of `plan`, in bytes (see `segment_peaks`)."""
    return max(s.peak_bytes for s in segment_peaks(graph, plan, costs))


def baseline_peak(graph, costs):
    """The memory model's peak of the model without checkpointing: one
    segment that is not recomputed."""
    order = topological_order(graph)
    spans = _spans_for(graph, order, costs)
    return int(round(costs.fixed + spans.inner(0, len(order), False)))


def _search(spans, cap, forbidden):
    """Least-recompute plan with every segment's peak within `cap`.

    Dynamic programming over the cut positions of one order. State: (cut
    position b, whether the segment ending at b is kept). Each state holds
    the Pareto front of (held bytes, recompute cost) over the plans of the
    prefix [0, b) whose segments all fit `cap`: the later segments' peaks
    depend on a prefix only through its held bytes, so the front loses no
    optimal plan. Two kept segments never touch (they would be one), and a
    recomputed segment holds no call marked in `forbidden` (a prefix count
    over the order).

    Returns (cost, [(a, b, remat), ...]), or None when nothing fits.
    """
    import numpy as np

    n = spans.n
    forbidden = np.asarray(forbidden)
    # front: (held array sorted ascending, cost array, back-pointer list)
    fronts = {(0, False): (np.zeros(1), np.zeros(1), [None])}
    for b in range(1, n + 1):
        new = {True: [], False: []}  # keyed by "the segment ending at b is kept"
        for a in range(b - 1, -1, -1):
            kept_inner = spans.inner_kept[a, b]
            if kept_inner > cap:
                break  # the inner peak only grows as a span reaches back
            may_remat = forbidden[b] == forbidden[a]
            for remat in (True, False) if may_remat else (False,):
                inner = spans.inner_remat[a, b] if remat else kept_inner
                if inner > cap:
                    continue
                h = (spans.held_remat if remat else spans.held_kept)[a, b]
                c = spans.cost_span[a, b] if remat else 0.0
                for prev_kept in (False, True) if remat else (False,):
                    front = fronts.get((a, prev_kept))
                    if front is None:
                        continue
                    held, cost, _ = front
                    k = int(np.searchsorted(held, cap - inner, side="right"))
                    if k:
                        new[not remat].append((held[:k] + h, cost[:k] + c, a, prev_kept, k))
        for kept, parts in new.items():
            if parts:
                fronts[(b, kept)] = _pareto(parts)
    finals = [(fronts[key][1].min(), key) for key in ((n, False), (n, True)) if key in fronts]
    if not finals:
        return None
    cost, key = min(finals, key=lambda f: f[0])
    i = int(np.argmin(fronts[key][1]))
    segments = []
    while key[0] > 0:
        a, prev_kept, j = fronts[key][2][i]
        segments.append((a, key[0], not key[1]))
        key, i = (a, prev_kept), j
    return float(cost), segments[::-1]


def _pareto(parts):
    """Merges candidate (held, cost) arrays into one Pareto front: sorted by
    held bytes, each point cheaper than every point holding less."""
    import numpy as np

    held = np.concatenate([p[0] for p in parts])
    cost = np.concatenate([p[1] for p in parts])
    back = [(a, prev_kept, j) for _, _, a, prev_kept, k in parts for j in range(k)]
    order = np.lexsort((cost, held))
    held, cost = held[order], cost[order]
    best_before = np.minimum.accumulate(np.concatenate([[np.inf], cost[:-1]]))
    keep = cost < best_before
    idx = order[keep]
    return held[keep], cost[keep], [back[i] for i in idx]


def _least_held(spans, cap, forbidden):
    """Whether some plan fits `cap`: dynamic programming over cut positions
    keeping, per state, only the least held bytes (enough for feasibility,
    since later peaks grow with the held bytes)."""
    import numpy as np

    n = spans.n
    forbidden = np.asarray(forbidden)
    inf = np.inf
    best = np.full((n + 1, 2), inf)  # [b, segment ending at b is kept]
    best[0, 0] = 0.0
    for b in range(1, n + 1):
        free = best[:b, 0]
        any_ = np.minimum(best[:b, 0], best[:b, 1])
        ok_remat = (forbidden[b] == forbidden[:b]) & (any_ + spans.inner_remat[:b, b] <= cap)
        ok_kept = free + spans.inner_kept[:b, b] <= cap
        r = np.where(ok_remat, any_ + spans.held_remat[:b, b], inf)
        k = np.where(ok_kept, free + spans.held_kept[:b, b], inf)
        best[b, 0], best[b, 1] = r.min(), k.min()
    return bool(np.isfinite(best[n]).any())


def _forbidden_prefix(order, keep):
    counts = [0]
    for v in order:
        counts.append(counts[-1] + (1 if v in keep else 0))
    return counts


def smallest_peak(graph, costs, *, keep=()):
    """The smallest estimated peak of any plan (segments recomputed or not,
    over the planner's topological order), in bytes.

    Args:
        graph: the layer-call graph.
        costs: `NodeCosts` for it.
        keep: layer calls that may not be recomputed.
    """
    order = topological_order(graph)
    spans = _spans_for(graph, order, costs)
    return _smallest(spans, _forbidden_prefix(order, set(keep))) + costs.fixed


def _smallest(spans, forbidden):
    # Peaks are sums of whole bytes, so bisection over integers is exact.
    # One kept segment (the original model) always fits its own peak.
    lo, hi = 0, int(math.ceil(spans.inner_kept[0, spans.n]))
    while lo < hi:
        mid = (lo + hi) // 2
        if _least_held(spans, mid, forbidden):
            hi = mid
        else:
            lo = mid + 1
    return lo


def plan_for_budget(graph, costs, budget_bytes, *, keep=(), strategy="budget"):
    """The plan of least recompute whose estimated peak fits a budget.

    Chooses where to cut the layer calls of one topological order into
    segments, and which segments to recompute, so that the memory model's
    peak (see `_Spans`: for each segment, in backward order, the boundary
    tensors held for the earlier segments plus the segment's own recompute
    peak) stays at or below `budget_bytes`, and the forward cost recomputed
    (FLOPs of the recomputed calls) is least. Segments that are not
    recomputed keep their calls' activations, as the original model does;
    that is how the plan spends spare memory to skip recomputation.

    The search is a dynamic program over cut positions with a Pareto front
    of (bytes held, recompute cost) per state: exact for the model, in
    O(n^2 * front) time. It generalizes Chen et al.'s budgeted segmentation
    (a greedy pass over a chain with a memory budget) to an exact search
    with per-call costs, in the spirit of Feng & Huang's dynamic program over
    a linearized graph.

    Args:
        graph: the layer-call graph (see `graphckpt.graph`).
        costs: `NodeCosts` for it, at the batch size the budget is for.
        budget_bytes: the largest estimated peak allowed.
        keep: layer calls never to recompute (a recompute policy).
        strategy: the label stored on the plan.

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
    order = topological_order(graph)
    spans = _spans_for(graph, order, costs)
    forbidden = _forbidden_prefix(order, set(keep))
    found = _search(spans, budget_bytes - costs.fixed, forbidden)
    if found is None:
        smallest = _smallest(spans, forbidden) + costs.fixed
        raise BudgetInfeasible(
            f"No plan fits a budget of {budget_bytes} bytes: the smallest estimated peak is {smallest} bytes",
            smallest,
            budget_bytes,
        )
    _, segments = found
    plan = plan_from_boundaries(
        graph, order, [a for a, _, _ in segments], strategy=strategy, remat=[r for _, _, r in segments]
    )
    return dataclasses.replace(
        plan,
        estimated_peak_bytes=estimated_peak(graph, plan, costs),
        baseline_peak_bytes=baseline_peak(graph, costs),
        batch_size=None,
        budget_bytes=int(budget_bytes),
    )
