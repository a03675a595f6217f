"""The budget search: the plan of least recompute within a memory budget.

`plan_for_budget` chooses where to cut one topological order of the layer
calls and which segments to recompute so that the memory model's peak
(`graphckpt.planner.memory`) fits a budget and the forward cost recomputed
is least; `smallest_peak` is the least peak any plan reaches. This module
never imports Keras; it uses numpy.
"""

import dataclasses

import numpy as np

from graphckpt import errors
from graphckpt.planner.data import plan_from_boundaries
from graphckpt.planner.memory import memory_model_for
from graphckpt.planner.search import least_fitting_cap

__all__ = ["BudgetInfeasible", "plan_for_budget", "smallest_peak"]


class BudgetInfeasible(errors.InfeasibleBudgetError):
    """No plan's estimated peak fits the budget. `smallest_bytes` is the
    smallest estimated peak any plan reaches.

    A `graphckpt.InfeasibleBudgetError` (so a `GraphckptError` and a
    `ValueError`) that carries the numbers: `graphckpt.plan` re-raises it
    as an `InfeasibleBudgetError` with a message in the user's terms."""

    def __init__(self, message, smallest_bytes, budget_bytes):
        super().__init__(message)
        self.smallest_bytes = smallest_bytes
        self.budget_bytes = budget_bytes



def _segment_starts(spans, cap):
    """a_min[b]: the old scan's stopping point."""
    n = spans.n
    a_min = np.zeros(n + 1, dtype=np.int64)
    for b in range(1, n + 1):
        over = np.flatnonzero(spans.inner_kept[:b, b] > cap)
        a_min[b] = over[-1] + 1 if over.size else 0
    return a_min


def _suffix_peaks(spans, cap, forbidden, a_min):
    """G[b, kept]: least suffix peak from b."""
    n = spans.n
    G = np.full((n + 1, 2), np.inf)
    G[n, :] = -np.inf
    for b in range(n - 1, -1, -1):
        allowed = a_min[b + 1 :] <= b
        r_ok = allowed & (forbidden[b + 1 :] == forbidden[b])
        r = np.where(r_ok, np.maximum(spans.inner_remat[b, b + 1 :], spans.held_remat[b, b + 1 :] + G[b + 1 :, 0]), np.inf)
        k = np.where(allowed, np.maximum(spans.inner_kept[b, b + 1 :], spans.held_kept[b, b + 1 :] + G[b + 1 :, 1]), np.inf)
        rm = r.min()
        G[b, 1] = rm
        G[b, 0] = min(rm, k.min())
    return G


def _search(spans, cap, forbidden, prune=True):
    """Least-recompute plan with every segment's peak within `cap`.

    Dynamic programming over the cut positions of one order. State: (cut
    position b, whether the segment ending at b is kept). Each state holds
    the Pareto front of (held bytes, recompute cost) over the plans of the
    prefix [0, b) whose segments all fit `cap`. Two kept segments never
    touch, and a recomputed segment holds no call marked in `forbidden`.
    Every front point lives in one flat pool; each step is vectorized over
    the pool points of the reachable starts. Ties go as in a scan of starts
    from b - 1 down (recomputed before kept predecessors). Points that no
    completion can fit (`_suffix_peaks`) are dropped: that changes no
    front point any plan within `cap` passes through.

    Returns (cost, [(a, b, remat), ...]), or None when nothing fits.
    """
    n = spans.n
    forbidden = np.asarray(forbidden)
    a_min = _segment_starts(spans, cap)
    G = _suffix_peaks(spans, cap, forbidden, a_min) if prune else np.full((n + 1, 2), -np.inf)
    slack = cap + 1e-9 * abs(cap) + 1e-6
    # pool of front points: held, cost, position a, kept flag, back (pool index)
    cap_pool = 1024
    P_held, P_cost = np.empty(cap_pool), np.empty(cap_pool)
    P_a, P_back = np.empty(cap_pool, dtype=np.int64), np.empty(cap_pool, dtype=np.int64)
    P_pk = np.empty(cap_pool, dtype=bool)
    P_held[0], P_cost[0], P_a[0], P_pk[0], P_back[0] = 0.0, 0.0, 0, False, -1
    size = 1
    start_at = np.zeros(n + 2, dtype=np.int64)  # first pool index of position a
    start_at[1] = 1
    final = {}
    for b in range(1, n + 1):
        lo = start_at[a_min[b]]
        e_held, e_cost, e_a, e_pk = P_held[lo:size], P_cost[lo:size], P_a[lo:size], P_pk[lo:size]
        out = []
        # remat candidates -> state (b, False)
        col_ir = spans.inner_remat[:b, b]
        ir = col_ir[e_a]
        ok = (forbidden[:b] == forbidden[b])[e_a] & (ir <= cap) & (e_held <= cap - ir)
        idx = np.flatnonzero(ok)
        if idx.size:
            ea = e_a[idx]
            h = e_held[idx] + spans.held_remat[:b, b][ea]
            c = e_cost[idx] + spans.cost_span[:b, b][ea]
            rank = (b - 1 - ea) * 2 + e_pk[idx]
            out.append((False, h, c, rank, idx + lo))
        # kept candidates -> state (b, True)
        ik = spans.inner_kept[:b, b][e_a]
        ok = (~e_pk) & (e_held <= cap - ik)
        idx = np.flatnonzero(ok)
        if idx.size:
            ea = e_a[idx]
            h = e_held[idx] + spans.held_kept[:b, b][ea]
            c = e_cost[idx] + 0.0
            rank = b - 1 - ea
            out.append((True, h, c, rank, idx + lo))
        for kept, h, c, rank, src in out:
            if prune:
                live = h + G[b, int(kept)] <= slack
                if not live.all():
                    h, c, rank, src = h[live], c[live], rank[live], src[live]
                    if not h.size:
                        continue
            order = np.lexsort((rank, c, h))
            c_sorted = c[order]
            best_before = np.minimum.accumulate(np.concatenate([[np.inf], c_sorted[:-1]]))
            keep = order[c_sorted < best_before]
            m = keep.size
            while size + m > P_held.size:
                grow = P_held.size * 2
                P_held, P_cost, P_a, P_pk, P_back = (
                    np.resize(arr, grow) for arr in (P_held, P_cost, P_a, P_pk, P_back)
                )
            new = slice(size, size + m)
            P_held[new], P_cost[new], P_a[new], P_pk[new], P_back[new] = h[keep], c[keep], b, kept, src[keep]
            if b == n:
                final[kept] = (size, m)
            size += m
        start_at[b + 1] = size
    finals = [(P_cost[final[k][0]:final[k][0] + final[k][1]].min(), k) for k in (False, True) if k in final]
    if not finals:
        return None
    cost, key = min(finals, key=lambda f: f[0])
    s0, m = final[key]
    i = s0 + int(np.argmin(P_cost[s0:s0 + m]))
    segments = []
    while P_back[i] >= 0:
        j = P_back[i]
        segments.append((int(P_a[j]), int(P_a[i]), not bool(P_pk[i])))
        i = j
    return float(cost), segments[::-1]


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


def smallest_peak(graph, costs, *, keep=(), memory=None):
    """The smallest estimated peak of any plan (segments recomputed or not,
    over the planner's topological order), in bytes.

    Args:
        graph: the layer-call graph.
        costs: `NodeCosts` for it.
        keep: layer calls that may not be recomputed.
        memory: a `MemoryModel` of `graph` and `costs` to reuse, if at hand.
    """
    spans = memory_model_for(graph, costs, None, memory)
    return _smallest(spans, _forbidden_prefix(spans.order, set(keep))) + costs.fixed


def _smallest(spans, forbidden):
    # One kept segment (the original model) always fits its own peak.
    return least_fitting_cap(spans.inner_kept[0, spans.n], lambda cap: _least_held(spans, cap, forbidden))


def plan_for_budget(graph, costs, budget_bytes, *, keep=(), strategy="budget", memory=None):
    """The plan of least recompute whose estimated peak fits a budget.

    Chooses where to cut the layer calls of one topological order into
    segments, and which segments to recompute, so that the memory model's
    peak (see `MemoryModel`: for each segment, in backward order, the boundary
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
        memory: a `MemoryModel` of `graph` and `costs` to reuse, if at hand
            (its tables take O(n^2) to build).

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
    spans = memory_model_for(graph, costs, None, memory)
    order = spans.order
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
        estimated_peak_bytes=spans.estimated_peak(plan),
        baseline_peak_bytes=spans.baseline_peak(),
        batch_size=None,
        budget_bytes=int(budget_bytes),
    )
