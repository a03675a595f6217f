"""The memory model: estimated peak bytes of any plan over one order.

`NodeCosts` (graphckpt.planner.costs) says what each layer call keeps,
makes and costs;
`MemoryModel` turns them into tables over every span `[a, b)` of one
topological order (O(n^2) to build, once per planning call), from which
the searches (`graphckpt.planner.search`, `graphckpt.planner.budget_search`)
and `segment_peaks` / `estimated_peak` / `baseline_peak` read every
segment's peak in O(1). This module never imports Keras; it uses numpy.
"""

from graphckpt.graph.layer_graph import outputs_of, tensors_of
from graphckpt.planner.costs import NodeCosts, SegmentPeak, graph_costs
from graphckpt.planner.data import tensor_consumers, topological_order

__all__ = [
    "NodeCosts",
    "SegmentPeak",
    "MemoryModel",
    "SubSpans",
    "memory_model_for",
    "graph_costs",
    "segment_peaks",
    "recomputed_calls",
    "estimated_peak",
    "baseline_peak",
]


class MemoryModel:
    """The memory model of one order of a graph's layer calls, for one set
    of costs: the quantities of every span `[a, b)`, made once.

    The model (all bytes for one batch), for segments run in reverse during
    the backward pass, segment i spanning positions [a_i, b_i):
        peak = fixed + max_i (sum_{j<i} held_j + inner_i)
        held_j = out(a_j, b_j)                      recomputed segment
               = kept(a_j, b_j) + unsaved_out(a_j, b_j) + both(a_j, b_j)   otherwise
        inner_i = max_{v in seg} (kept(a_i, v+1) + workspace(v) - freed(0, v+1))
                  + out(a_i, b_i)  [+ in(a_i, b_i) when recomputed]
        inner_i = max(inner_i, fwd_i)               where something is freed
        fwd_i = max_{v in seg} ([kept(a_i, v) if kept] + step(v))   its forward pass
        inner_last = max(inner_last, held_last)     the end of the forward pass
    `out(a, b)`: tensors made in [a, b) and used at b or later (as values
    for later consumers, or as gradients coming back from them);
    `both(a, b)`: tensors made before a whose values a call in [a, b)
    reads in its backward (`NodeCosts.reads`) and that are used at b or
    later too: the segment holds the value until its backward, while the
    gradient from the later use comes back earlier (an inline MaxPooling2D
    on a U-Net's skip tensor). Counted for every later segment, so an
    over-estimate after that later use;
    `in(a, b)`: tensors made before a and used in [a, b), which the
    recompute copies (graphckpt's TensorFlow and JAX remats order it after
    the incoming gradient through a data dependency on every input,
    `graphckpt.runtime.remat_tensorflow.tf_tie` and `jax_tie`);
    `freed(0, v+1)`: of the bytes freed after the forward pass
    (`NodeCosts.freed`; none but on PyTorch), those of calls `0 .. v`, not
    allocated again when `v`'s backward runs (their backward comes later,
    or is `v`'s own, whose workspace counts it). The last segment's
    peak also covers the end of the forward pass, when every segment holds
    what it keeps for the backward pass at once (`sum_i held_i`), and where
    something is freed each segment's peak covers its forward pass too
    (`step(v)`: a call's outputs, internal buffers, forward temporaries
    and the inputs nothing else counts): on freed memory the backward pass
    may peak below both.
    Where nothing is freed, `inner_last >= held_last` already, and a call's
    backward workspace (the estimator's calibration) covers its forward.

    The searches read the `(n + 1) x (n + 1)` tables `inner_kept`,
    `inner_remat`, `held_kept`, `held_remat`, `cost_span` and `copied_span`
    (`in`), indexed `[a, b]`. Building them is O(n^2) time and memory: build one per
    planning call and pass it on (the `memory=` argument of the searches).

    Args:
        graph: the layer-call graph.
        costs: `NodeCosts` for it.
        order: the order of its layer calls that plans cut (default:
            `topological_order(graph)`).
    """

    def __init__(self, graph, costs, order=None):
        self.graph = graph
        self.costs = costs
        self.order = topological_order(graph) if order is None else tuple(order)
        self.n = len(self.order)
        self.fixed = costs.fixed
        self._build(graph, self.order, costs)

    def _build(self, graph, order, costs):
        import numpy as np

        n = self.n
        pos = {v: i for i, v in enumerate(order)}
        consumers = tensor_consumers(graph)
        model_outputs = set(outputs_of(graph))
        # produced[p][last_use] bytes; first_use/last_use of tensors made before
        made = np.zeros((n + 1, n + 2))  # [producer position, last use]
        unsaved = np.zeros((n + 1, n + 2))
        in_diff = np.zeros((n + 2, n + 2))  # 2-D difference array of in(a, b)
        both_diff = np.zeros((n + 2, n + 2))  # ... of both(a, b)
        produced = {}
        # A call's forward step: its outputs, internal buffers and forward
        # temporaries, and its inputs where nothing counts them yet: in a
        # recomputed segment, any (one made before the segment is counted
        # twice); in a kept one, an input not kept for backward. Read only
        # where something is freed.
        step_kept = np.array([costs.internal.get(v, 0) + costs.forward_temp.get(v, 0) for v in order], dtype=float)
        step_remat = step_kept.copy()
        for key, info in tensors_of(graph).items():
            uses = sorted({pos[c] for c in consumers.get(key, ()) if c in pos})
            nbytes = costs.tensor_bytes.get(key, 0)
            p = pos.get(info.producer, -1)  # -1: a model input
            step_remat[uses] += nbytes
            if key not in costs.saved:
                step_kept[uses] += nbytes
            last = n if key in model_outputs else (uses[-1] if uses else p)
            if p >= 0:
                step_kept[p] += nbytes
                step_remat[p] += nbytes
                produced.setdefault(info.producer, []).append(key)
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
            # both(a, b): a span [a, b) run as it is holds the value for a
            # call of its own that reads it in its backward, and the
            # gradient comes back from a use at b or later: for a in
            # (previous reader or producer, reader], b in (reader, last].
            prev = p
            for reader in (u for u in uses if key in costs.reads.get(order[u], ())):
                if p >= 0 and reader < last:
                    both_diff[prev + 1, reader + 1] += nbytes
                    both_diff[prev + 1, last + 1] -= nbytes
                    both_diff[reader + 1, reader + 1] -= nbytes
                    both_diff[reader + 1, last + 1] += nbytes
                prev = reader
        kept = np.array([costs.internal.get(v, 0) for v in order], dtype=float)
        for v in order:
            kept[pos[v]] += sum(costs.tensor_bytes.get(t, 0) for t in produced.get(v, ()) if t in costs.saved)
        work = np.array([costs.workspace.get(v, 0) for v in order], dtype=float)
        work -= np.cumsum([costs.freed.get(v, 0) for v in order])  # - freed(0, v+1)
        comp = np.array([costs.compute.get(v, 0.0) for v in order], dtype=float)
        kept_prefix = np.concatenate([[0.0], np.cumsum(kept)])
        compute_prefix = np.concatenate([[0.0], np.cumsum(comp)])
        # out(a, b) = sum_{a <= p < b, last >= b} made[p, last]
        suffix = np.cumsum(made[:, ::-1], axis=1)[:, ::-1]  # suffix[p, b] = sum_{last >= b}
        del made
        cum = np.concatenate([np.zeros((1, n + 2)), np.cumsum(suffix, axis=0)])  # cum[x, b] = sum_{p < x}
        del suffix
        out = np.diagonal(cum[:, : n + 1])[None, :] - cum[: n + 1, : n + 1]  # [a, b]
        del cum
        usuffix = np.cumsum(unsaved[:, ::-1], axis=1)[:, ::-1]
        del unsaved
        ucum = np.concatenate([np.zeros((1, n + 2)), np.cumsum(usuffix, axis=0)])
        del usuffix
        unsaved_out = np.diagonal(ucum[:, : n + 1])[None, :] - ucum[: n + 1, : n + 1]
        del ucum
        in_ = np.cumsum(np.cumsum(in_diff, axis=0), axis=1)[: n + 1, : n + 1]
        del in_diff
        # max_{v in [a, b)} (kept_prefix[v+1] + work[v]) - kept_prefix[a]
        z = kept_prefix[1:] + work
        work_peak = np.zeros((n + 1, n + 1))
        for a in range(n):
            work_peak[a, a + 1 :] = np.maximum.accumulate(z[a:]) - kept_prefix[a]
        frees = any(costs.freed.values())
        # Whether a span's peak as it is (`inner_kept`) bounds every longer
        # span's below: not when something is freed, where a kept span holds
        # its forward pass and a longer recomputed one does not.
        self.monotone = not frees

        # The span tables the searches read, indexed [a, b].
        kept_span = kept_prefix[None, :] - kept_prefix[:, None]
        self.inner_kept = work_peak + out
        del work_peak
        self.inner_remat = self.inner_kept + in_
        self.copied_span = in_
        both = np.cumsum(np.cumsum(both_diff, axis=0), axis=1)[: n + 1, : n + 1]
        del both_diff
        self.held_kept = kept_span + unsaved_out + both
        self.held_remat = out
        # Each segment's forward pass, over what the earlier ones hold: what a
        # kept segment keeps so far, plus one call's step. Where nothing is
        # freed, the backward step's workspace of the same call covers it
        # (the estimator's calibration), with more held around it.
        if frees:
            fwd = kept_prefix[:-1] + step_kept
            for a in range(n):
                np.maximum(self.inner_kept[a, a + 1 :], np.maximum.accumulate(fwd[a:]) - kept_prefix[a],
                           out=self.inner_kept[a, a + 1 :])
                np.maximum(self.inner_remat[a, a + 1 :], np.maximum.accumulate(step_remat[a:]),
                           out=self.inner_remat[a, a + 1 :])
        # The last segment's backward runs right after the forward pass ends.
        np.maximum(self.inner_kept[:, n], self.held_kept[:, n], out=self.inner_kept[:, n])
        np.maximum(self.inner_remat[:, n], self.held_remat[:, n], out=self.inner_remat[:, n])
        self.cost_span = compute_prefix[None, :] - compute_prefix[:, None] - self._pruned(graph, order, pos, comp)
        self.cost_span += costs.segment_cost

    def _pruned(self, graph, order, pos, comp):
        """`[a, b]` -> the cost of the calls of `[a, b)` pruned from its
        recompute. A prunable call is dead in a segment when every call of
        the segment that reads it is dead too (a convolution read only by
        the segment's closing Add): the runtime drops it. Whether the call
        at `i` is dead depends only on `b` (its readers come after it): it
        is for `i < b <= last[i]`, `last[i]` the least over its readers of
        their own `last` (prunable readers) or position (the others), `n`
        for a call nothing reads. (`recomputed_calls` is the same rule for
        one segment.)"""
        import numpy as np

        n = self.n
        prunable = self.costs.prunable
        if not prunable:
            return 0.0
        last = [0] * n
        for i in reversed(range(n)):
            readers = [pos[w] for w in graph.successors(order[i]) if w in pos]
            last[i] = min((last[j] if order[j] in prunable else j for j in readers), default=n)
        diff = np.zeros((n + 2, n + 2))
        for i, v in enumerate(order):
            if v not in prunable or not comp[i]:
                continue
            c = comp[i]
            diff[0, i + 1] += c
            diff[0, last[i] + 1] -= c
            diff[i + 1, i + 1] -= c
            diff[i + 1, last[i] + 1] += c
        return np.cumsum(np.cumsum(diff, axis=0), axis=1)[: n + 1, : n + 1]

    def inner(self, a, b, remat):
        """A segment's own peak during its backward pass (`inner` above)."""
        return float((self.inner_remat if remat else self.inner_kept)[a, b])

    def held(self, a, b, remat):
        """The bytes a segment holds for the later segments' backward."""
        return float((self.held_remat if remat else self.held_kept)[a, b])

    def cost(self, a, b):
        """The forward cost of recomputing the calls of `[a, b)`, pruned
        calls left out."""
        return float(self.cost_span[a, b])

    def segment_peaks(self, plan):
        """The model's per-segment view of `plan`, a plan over `self.order`
        (see the module function `segment_peaks`)."""
        if tuple(plan.order) != self.order:
            raise ValueError("`plan` cuts another order of the layer calls than this memory model's")
        held, out = 0.0, []
        bounds = plan.boundaries
        for seg, a, b in zip(plan.segments, bounds, bounds[1:]):
            if seg.inner:
                inner, cost = self.two_level(a, b, [(len(s.nodes), s.remat) for s in seg.inner])
            else:
                inner, cost = self.inner(a, b, seg.remat), (self.cost(a, b) if seg.remat else 0.0)
            h = self.held(a, b, seg.remat)
            out.append(
                SegmentPeak(
                    index=seg.index,
                    remat=seg.remat,
                    held_before_bytes=int(round(held)),
                    held_bytes=int(round(h)),
                    recompute_peak_bytes=int(round(inner)),
                    peak_bytes=int(round(self.fixed + held + inner)),
                    recompute_cost=cost,
                )
            )
            held += h
        return tuple(out)

    def two_level(self, a, b, inner):
        """`(peak, cost)` of recomputing `[a, b)` cut into inner segments
        (`inner`: `(calls, remat)` each, in order).

        Its recompute keeps only what crosses the inner segments (their
        outputs, as `held` counts them) plus its own inputs, which it
        copies; each inner segment's backward then peaks as a segment of one
        level does, over what the earlier inner segments hold:
            peak = in(a, b) + max_j (sum_{k<j} held_k + inner_j)
            cost = cost(a, b) + sum of the recomputed inner segments' costs
        """
        peak = held = 0.0
        cost = self.cost(a, b)
        c = a
        for calls, remat in inner:
            peak = max(peak, held + self.inner(c, c + calls, remat))
            held += self.held(c, c + calls, remat)
            cost += self.cost(c, c + calls) if remat else 0.0
            c += calls
        if c != b:
            raise ValueError(f"inner segments cover [{a}, {c}), not the segment [{a}, {b})")
        return self.copied(a, b) + peak, cost

    def copied(self, a, b):
        """`in(a, b)`: the inputs a recompute of `[a, b)` copies."""
        return float(self.copied_span[a, b])

    def estimated_peak(self, plan):
        """The model's peak of `plan`, in bytes."""
        return max(s.peak_bytes for s in self.segment_peaks(plan))

    def baseline_peak(self):
        """The model's peak without checkpointing: one segment, not recomputed."""
        return int(round(self.fixed + self.inner(0, self.n, False)))


class SubSpans:
    """The span tables of `[a, b)` of a `MemoryModel`, positions counted
    from `a`: what the searches read to cut a segment again (two levels).
    Views, not copies."""

    costs = None  # not whole-graph costs: `front` makes no exact-sum shortcut

    def __init__(self, spans, a, b):
        part = (slice(a, b + 1), slice(a, b + 1))
        self.n = b - a
        self.inner_kept, self.inner_remat = spans.inner_kept[part], spans.inner_remat[part]
        self.held_kept, self.held_remat = spans.held_kept[part], spans.held_remat[part]
        self.cost_span, self.copied_span = spans.cost_span[part], spans.copied_span[part]
        self.monotone = spans.monotone


def recomputed_calls(graph, nodes, prunable):
    """The calls of a recomputed segment (`nodes`, in order) that its
    recompute runs: all but the dead ones, prunable calls that no call of
    the segment reads, or only dead ones do (`MemoryModel` prices every
    span by this rule)."""
    inside, dead = set(nodes), set()
    for v in reversed(nodes):  # readers first
        if v in prunable and all(w in dead for w in graph.successors(v) if w in inside):
            dead.add(v)
    return [v for v in nodes if v not in dead]


def memory_model_for(graph, costs, order=None, memory=None):
    """`memory` when it models `graph` and `costs` over `order` (default:
    the topological order), else a new `MemoryModel`."""
    if memory is not None and memory.graph is graph and memory.costs is costs:
        if tuple(topological_order(graph) if order is None else order) == memory.order:
            return memory
    return MemoryModel(graph, costs, order)


def segment_peaks(graph, plan, costs, *, memory=None):
    """The memory model's per-segment view of `plan` (see `MemoryModel`).

    Args:
        graph: the layer-call graph.
        plan: a `Plan` over it (any strategy; `remat` flags honoured).
        costs: `NodeCosts` for the graph.
        memory: a `MemoryModel` of `graph` and `costs` to reuse, if at hand.

    Returns:
        A tuple of `SegmentPeak`, one per segment; the plan's estimated
        peak is the largest `peak_bytes`.
    """
    return memory_model_for(graph, costs, plan.order, memory).segment_peaks(plan)


def estimated_peak(graph, plan, costs, *, memory=None):
    """The memory model's peak of `plan`, in bytes (see `segment_peaks`)."""
    return memory_model_for(graph, costs, plan.order, memory).estimated_peak(plan)


def baseline_peak(graph, costs, *, memory=None):
    """The memory model's peak of the model without checkpointing: one
    segment that is not recomputed."""
    return memory_model_for(graph, costs, None, memory).baseline_peak()
