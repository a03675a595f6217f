"""Plan data: an immutable segmentation of a graph's layer calls.

A `Plan` cuts one topological order of the layer calls (`topological_order`)
into contiguous `PlannedSegment`s that cover every call exactly once; a
segment's `inputs` are the tensors made before it and used inside it, its
`outputs` the tensors made inside it and used after it (or returned by the
model). `plan_from_boundaries` builds one from cut positions;
`validate_plan` checks that contract. This module never imports Keras.
"""

import dataclasses

import networkx as nx

from graphckpt.graph.layer_graph import (
    INPUT,
    from_inputs_of,
    outputs_of,
    state_chains_of,
    tensors_of,
)

__all__ = ["PlannedSegment", "Plan", "topological_order", "plan_from_boundaries", "validate_plan", "format_bytes"]


@dataclasses.dataclass(frozen=True)
class PlannedSegment:
    """One segment: its layer calls in order, and the tensors that cross it.

    `remat` is true for a checkpointed segment (only its inputs are kept for
    backward; its interior is recomputed). A segment with `remat=False` runs
    its layer calls as they are, keeping what they keep: budget plans and
    recompute policies use such segments for calls not worth recomputing.

    `inner` is empty for a segment of one level. A recomputed segment may be
    cut again (two-level checkpointing, Chen et al. 2016, section 4.4): its
    recompute then keeps only the inputs of its `inner` segments, which
    cover its calls in order and are recomputed again (or, `remat=False`,
    kept) during its backward pass. Their `inputs` and `outputs` are over
    the whole graph, as for any segment; their `index` counts from 0 within.
    """

    index: int
    nodes: tuple
    inputs: tuple
    outputs: tuple
    remat: bool = True
    inner: tuple = ()


@dataclasses.dataclass(frozen=True, repr=False)
class Plan:
    """An immutable segmentation of a model's layer calls.

    `repr(plan)` is one short line (segments, recomputed segments, layer
    calls, estimated peaks); `plan.summary()` has one line per segment, and
    `plan.segments` / `plan.to_dict()` every layer call and tensor.

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
        open_layers: whether composite layers were opened into their calls
            (`graphckpt.plan(..., open_layers=True)`): the plan's calls are
            those of the opened graph.
        opened_at: the input shapes (one per model input) the layers that
            trace only at known shapes were opened at, or None.
        kept_closed: the paths of the composite layer calls kept whole
            because a predicate `open_layers` said so.
        attention_chunks: the number of chunks each
            `MultiHeadAttention` call's core runs in, or None
            (`graphckpt.plan(..., attention_chunks=...)`).
    """

    segments: tuple
    order: tuple
    strategy: str
    estimated_peak_bytes: int | None = None
    baseline_peak_bytes: int | None = None
    batch_size: int | None = None
    budget_bytes: int | None = None
    policy: str | None = None
    open_layers: bool = False
    opened_at: tuple | None = None
    kept_closed: tuple = ()
    attention_chunks: int | None = None

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

    @property
    def num_recomputed(self):
        """How many segments are recomputed (`remat=True`)."""
        return sum(1 for s in self.segments if s.remat)

    @property
    def levels(self):
        """1, or 2 when a segment is cut into inner segments."""
        return 2 if any(s.inner for s in self.segments) else 1

    def __repr__(self):
        parts = [
            f"strategy={self.strategy!r}",
            f"segments={len(self.segments)}",
            f"recomputed={self.num_recomputed}",
            f"layer_calls={self.num_layer_calls}",
        ]
        if self.levels > 1:
            parts.append(f"levels={self.levels}")
        for name in ("estimated_peak_bytes", "baseline_peak_bytes", "budget_bytes"):
            value = getattr(self, name)
            if value is not None:
                parts.append(f"{name[: -len('_bytes')]}={format_bytes(value)}{self._per}")
        if self.policy is not None:
            parts.append(f"policy={self.policy!r}")
        return f"Plan({', '.join(parts)})"

    @property
    def _per(self):
        return " per example" if self.batch_size is None else ""

    def summary(self, nodes=False):
        """A readable description: the plan's line, then one line per
        segment (its calls, first and last, recomputed or run as it is, the
        tensors crossing into and out of it).

        Args:
            nodes: also list every layer call of each segment.

        Returns:
            A multi-line string (plans are data; printing is the caller's).
        """
        batch = "per example" if self.batch_size is None else f"batch {self.batch_size}"
        lines = [
            f"{self!r}",
            f"{_plural(len(self.segments), 'segment')} over {_plural(self.num_layer_calls, 'layer call')} ({batch}):",
        ]
        for seg in self.segments:
            how = "recomputed" if seg.remat else "runs as it is"
            lines.append(
                f"  {seg.index:3d}: {_plural(len(seg.nodes), 'call', 5)}, {how + ':':14s} {_span(seg.nodes)}  "
                f"({_plural(len(seg.inputs), 'tensor')} in, {len(seg.outputs)} out)"
            )
            for sub in seg.inner:
                sub_how = "recomputed again" if sub.remat else "kept"
                lines.append(
                    f"       {seg.index}.{sub.index}: {_plural(len(sub.nodes), 'call', 5)}, {sub_how + ':':17s} {_span(sub.nodes)}"
                )
            if nodes:
                lines.extend(f"         {_name(n)}" for n in seg.nodes)
        return "\n".join(lines)

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
                | ({"inner": [{"nodes": len(i.nodes), "remat": i.remat} for i in s.inner]} if s.inner else {})
                for s in self.segments
            ],
        }


def format_bytes(n):
    """`1536` -> `'1.5 KiB'`."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _plural(n, word, width=0):
    """`'1 call'`, `'   6 calls'`: the count right-aligned in `width`."""
    return f"{n:{width}d} {word}" + ("" if n == 1 else "s")


def _span(nodes):
    """`'dense .. dense_5'`, or one name for a segment of one call."""
    if not nodes:
        return "(empty)"
    return _name(nodes[0]) if len(nodes) == 1 else f"{_name(nodes[0])} .. {_name(nodes[-1])}"


def _name(node):
    """A layer call's key for people: `'dense_3'`, `'dense_3#1'` for a
    second call of a shared layer."""
    if isinstance(node, tuple) and len(node) == 2:
        return str(node[0]) if node[1] == 0 else f"{node[0]}#{node[1]}"
    return str(node)


def layer_nodes(graph):
    return [n for n, d in graph.nodes(data=True) if d["kind"] != INPUT]


def topological_order(graph):
    """Layer calls in ASAP order: by longest path from an input, then by
    Keras's own execution position.

    Scheduling each call as early as its inputs allow ends the life of side
    branches (auxiliary heads, early outputs) soon after their input is made,
    so fewer tensors cross later cuts.

    Calls in one of `state_chains_of(graph)` keep their relative order:
    each reads the state (BatchNormalization statistics, a seed generator)
    the call before it updated, so reordering them changes the results.
    """
    constrained = nx.DiGraph(graph.edges)
    constrained.add_nodes_from(graph)
    for chain in state_chains_of(graph):
        constrained.add_edges_from(zip(chain, chain[1:]))
    order = []
    for generation in nx.topological_generations(constrained):
        generation = sorted(generation, key=lambda n: graph.nodes[n]["position"])
        order.extend(n for n in generation if graph.nodes[n]["kind"] != INPUT)
    return tuple(_where_first_read(order, from_inputs_of(graph), constrained))


def _where_first_read(order, from_inputs, constrained):
    """`order` with each call of `from_inputs` moved to just before its
    first reader (those without a reader stay where they are).

    Such a call (a mask or position ids made from the model's inputs) reads
    only tensors that are held all step anyway: run early, its output
    would cross every cut up to its reader and be kept there; run late, it
    is made, and recomputed, inside its reader's segment. (A keras_hub
    decoder opened at sequence 1280 makes a (batch, 1280, 1280) int32 mask
    of 50 MiB per block: in ASAP order all of them were kept.)
    """
    moved = [n for n in order if n in from_inputs and constrained.out_degree(n)]
    if not moved:
        return order
    stay = set(order) - set(moved)
    rest = [n for n in order if n in stay]
    for n in reversed(moved):  # readers first: each is placed before it
        place = {m: i for i, m in enumerate(rest)}
        rest.insert(min(place[s] for s in constrained.successors(n)), n)
    return rest


def tensor_consumers(graph):
    """tensor key -> list of consuming layer calls."""
    consumers = {}
    for _, v, data in graph.edges(data=True):
        for t in data["tensors"]:
            consumers.setdefault(t, []).append(v)
    return consumers


def plan_from_boundaries(graph, order, boundaries, strategy="fixed", remat=None, inner=None):
    """Builds the `Plan` that cuts `order` at `boundaries`.

    Args:
        graph: the layer-call graph.
        order: a topological order of its layer calls.
        boundaries: increasing start positions, beginning with 0; the last
            segment runs to the end of `order`.
        strategy: a label stored on the plan.
        remat: optional sequence of bools, one per segment: False marks a
            segment whose layer calls run as they are (default: all True).
        inner: optional sequence, one entry per segment: None (one level),
            or the inner segments of a recomputed segment as
            `(starts, remat)`, start positions within the segment
            beginning with 0 and one flag per inner segment.
    """
    order = tuple(order)
    remat = [True] * len(boundaries) if remat is None else [bool(r) for r in remat]
    if len(remat) != len(boundaries):
        raise ValueError(f"`remat` needs one flag per segment ({len(boundaries)}). Received: {len(remat)} flags")
    if inner is not None and any(x is not None for x in inner):
        return _two_level(graph, order, boundaries, strategy, remat, list(inner))
    bounds = list(boundaries) + [len(order)]
    consumers = tensor_consumers(graph)
    tensors = tensors_of(graph)
    model_outputs = set(outputs_of(graph))
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


def _two_level(graph, order, boundaries, strategy, remat, inner):
    """`plan_from_boundaries` with inner segments: every cut, outer and
    inner, gives one flat plan, whose segments are then grouped."""
    if len(inner) != len(boundaries):
        raise ValueError(f"`inner` needs one entry per segment ({len(boundaries)}). Received: {len(inner)}")
    bounds = list(boundaries) + [len(order)]
    starts, flags, owner = [], [], []  # owner: the segment cut again, else None
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if inner[i] is None:
            starts.append(a)
            flags.append(remat[i])
            owner.append(None)
            continue
        sub_starts, sub_remat = inner[i]
        if not remat[i] or list(sub_starts[:1]) != [0] or any(a + s >= b for s in sub_starts):
            raise ValueError(f"Inner segments of segment {i} must start at 0 and stay in a recomputed segment")
        starts += [a + s for s in sub_starts]
        flags += [bool(r) for r in sub_remat]
        owner += [i] * len(sub_starts)
    flat = plan_from_boundaries(graph, order, starts, strategy=strategy, remat=flags)
    subs = {}
    for seg, i in zip(flat.segments, owner):
        if i is not None:
            subs.setdefault(i, []).append(dataclasses.replace(seg, index=len(subs.get(i, ()))))
    whole = plan_from_boundaries(graph, order, boundaries, strategy=strategy, remat=remat)
    segments = tuple(
        dataclasses.replace(seg, inner=tuple(subs[i])) if i in subs else seg for i, seg in enumerate(whole.segments)
    )
    return dataclasses.replace(whole, segments=segments)


def validate_plan(graph, plan):
    """Raises `AssertionError` if `plan` breaks the module's contract."""
    calls = set(layer_nodes(graph))
    covered = [n for s in plan.segments for n in s.nodes]
    assert sorted(covered, key=str) == sorted(calls, key=str), "cover"
    pos = {n: i for i, n in enumerate(covered)}
    for u, v in graph.edges:
        if u in pos:
            assert pos[u] < pos[v], f"order: {u} after {v}"
    for chain in state_chains_of(graph):
        assert [pos[n] for n in chain] == sorted(pos[n] for n in chain), f"state order: {chain}"
    _check_ends(graph, plan.segments)
    for seg in plan.segments:
        if seg.inner:
            assert seg.remat, f"inner segments in segment {seg.index}, which is not recomputed"
            assert tuple(n for sub in seg.inner for n in sub.nodes) == tuple(seg.nodes), f"inner cover {seg.index}"
            assert not any(sub.inner for sub in seg.inner), f"three levels in segment {seg.index}"
            _check_ends(graph, seg.inner)


def _check_ends(graph, segments):
    """Each segment's inputs and outputs are the tensors that cross it."""
    tensors = tensors_of(graph)
    consumers = tensor_consumers(graph)
    outputs = set(outputs_of(graph))
    for seg in segments:
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
