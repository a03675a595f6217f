"""Searches over segment counts: where to cut for the least estimated peak.

`plan_segments` cuts a graph's layer calls into a given number of segments
(`"sqrt"`, an int) where the memory model (`graphckpt.planner.memory`) says
the peak is least, or (`"auto"`) finds the least peak any plan reaches and,
among the plans within 1% of it, the one that recomputes least. Every search
is a dynamic program over the cut positions of one topological order, run
inside one bisection over integer byte caps (`least_fitting_cap`). This
module never imports Keras.

References:
    Chen, Xu, Zhang, Guestrin. "Training Deep Nets with Sublinear Memory
    Cost", 2016 (sqrt(n) segments; segment inputs kept, interiors recomputed).

    Feng, Huang. "Optimal Gradient Checkpoint Search for Arbitrary
    Computation Graphs", CVPR 2021 (dynamic programming over a linearized
    arbitrary graph).
"""

import math
import numbers

from graphckpt.planner.data import plan_from_boundaries, topological_order
from graphckpt.planner.front import least_recompute
from graphckpt.planner.memory import graph_costs, memory_model_for

__all__ = ["SEGMENT_CHOICES", "plan_segments", "least_fitting_cap", "least_held_fits", "least_peak"]


def least_fitting_cap(hi, fits):
    """The least integer cap in `[0, hi]` for which `fits(cap)` holds, given
    that `fits(hi)` does and that `fits` is monotone (a plan that fits a cap
    fits every larger one). Peaks are sums of whole bytes, so bisection over
    integers finds the least peak exactly."""
    lo, hi = 0, int(math.ceil(hi))
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def least_held_fits(spans, cap, forbidden):
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


def least_peak(spans, forbidden):
    """The least estimated peak (without the fixed bytes) of any plan of one
    level: segments recomputed or run as they are, none recomputing a call
    marked in `forbidden` (a prefix count). One segment run as it is (the
    original model) always fits its own peak."""
    return least_fitting_cap(spans.inner_kept[0, spans.n], lambda cap: least_held_fits(spans, cap, forbidden))


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
    memory model of `MemoryModel`); among those, the plan holding fewest bytes.

    Bisection over integer byte caps: plans of the even split always fit
    the estimated peak of the even split."""
    n = spans.n
    even = [round(i * n / k) for i in range(k)]
    held, hi = 0.0, 0.0
    for i, (a, b) in enumerate(zip(even, even[1:] + [n])):
        last = last_kept and i == k - 1
        hi = max(hi, held + spans.inner(a, b, not last))
        held += spans.held(a, b, not last)
    cap = least_fitting_cap(hi, lambda cap: _fewest_held(spans, k, cap, last_kept) is not None)
    return _fewest_held(spans, k, cap, last_kept)


# How far above the least estimated peak the default plan may go to
# recompute less: plans within 1% of it count as equally small, and the
# one among them that recomputes least is chosen.
AUTO_TOLERANCE = 0.01


def _auto_segments(spans, fixed):
    """`(a, b, remat)` of the default plan: the least recompute among the
    plans whose estimated peak is within `AUTO_TOLERANCE` of the least any
    plan of one level reaches (segments recomputed or run as they are, in
    any order; `fixed` is the memory every plan holds).

    Among plans of the least peak, the one that recomputes least: the
    search of `graphckpt.planner.front` (the budget search) at that peak."""
    import numpy as np

    forbidden = np.zeros(spans.n + 1, dtype=np.int64)
    least = least_peak(spans, forbidden)
    cap = least + int(AUTO_TOLERANCE * (least + fixed))  # whole bytes, as the front search prefers
    return least_recompute(spans, cap, forbidden)[1]  # the least peak itself fits


SEGMENT_CHOICES = ("auto", "sqrt")


def plan_segments(graph, segments="auto", costs=None, *, memory=None):
    """Plans the segments over the graph's layer calls.

    Boundaries go where the estimated peak of the checkpointed model is
    least (the memory model of `segment_peaks`: the boundary tensors held
    for the earlier segments plus one segment's recompute), which puts
    short segments where activations are big and cuts where few bytes
    cross.

    Args:
        graph: a layer-call graph (see `graphckpt.graph.build`).
        segments: `"auto"` (default) chooses the number of segments too,
            and which ones to recompute: among the plans whose estimated
            peak is within `AUTO_TOLERANCE` (1%) of the least any plan
            reaches, the one that recomputes least (segments run as they
            are where they fit under that peak: the last one always, since
            its backward pass follows its forward pass at once). On a
            uniform chain that is about sqrt(n) segments; on a transformer
            stack about one block per segment; one segment run as it is
            (no recompute) when no cut lowers the estimate.
            `"sqrt"`: round(sqrt(n)) segments over n layer calls, the last
            one run as it is. A positive int k no larger than n: k
            segments, all recomputed.
        costs: `NodeCosts` for the memory model (default: `graph_costs`).
        memory: a `MemoryModel` of `graph` and `costs` already built, to
            reuse (its tables take O(n^2) to build).

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
    if costs is None:
        costs = memory.costs if memory is not None and memory.graph is graph else graph_costs(graph)
    spans = memory_model_for(graph, costs, order, memory)
    if strategy == "auto":
        segments = _auto_segments(spans, costs.fixed)
        starts, remat = [a for a, _, _ in segments], [r for _, _, r in segments]
    else:
        k = max(1, round(math.sqrt(n))) if strategy == "sqrt" else int(segments)
        last_kept = strategy == "sqrt" and k > 1
        starts = _least_peak_boundaries(spans, k, last_kept)
        remat = [True] * (len(starts) - 1) + [not last_kept]
    return plan_from_boundaries(graph, order, starts, strategy=strategy, remat=remat)

