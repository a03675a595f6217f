"""The exact optimum of graphckpt's memory model, from a MILP solver: the
reference the budget search is tested against (issue 15), in tests and
benchmarks only (scipy's HiGHS, `scipy.optimize.milp`; never a runtime
dependency).

The decision space is the budget search's: the layer calls of one
topological order cut into consecutive segments, each either recomputed or
run as it is (kept). The model (`graphckpt.planner.memory`): in backward
order, segment i's own peak `inner(a, b, remat)` sits on top of what the
earlier segments hold, `held(a, b, remat)`; the estimated peak is
`fixed + max_i (sum_{j < i} held_j + inner_i)`. Two kept segments never
touch (they would be one), and a recomputed segment holds no call that
`keep` forbids recomputing. Recompute cost: the forward cost of the
recomputed segments' calls.

Formulation (a path in the DAG of cut positions, like Checkmate's MILP
over one schedule, but over segments): binary `x[a, b, r]` chooses segment
[a, b) with remat flag r; flow conservation makes the chosen segments a
partition of [0, n). The bytes held before cut position p are then the
linear sum of `held` over the chosen segments ending at or before p, and
the peak is one row per position, with no big-M:

    sum_{b' <= p} held(a', b', r') x[a', b', r'] + sum_b inner(p, b, r) x[p, b, r] <= cap   (p < n)
    sum_a x[a, p, kept] + sum_b x[p, b, kept] <= 1          (kept segments never touch)
    minimize sum cost(a, b) x[a, b, remat]

At a position where a chosen segment starts, the row is that segment's
peak; at any other, it is the held bytes before the segment that spans it,
which that segment's own row already bounds. Segments whose own peak is
over the cap are left out.
"""

import numpy as np

from graphckpt.planner.memory import memory_model_for


def least_recompute(graph, costs, budget_bytes, keep=()):
    """The least recompute cost of any plan fitting `budget_bytes`, or None
    when none fits."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import lil_matrix

    spans = memory_model_for(graph, costs)
    n = spans.n
    cap = budget_bytes - costs.fixed
    keep = set(keep)
    forbidden = np.concatenate([[0], np.cumsum([v in keep for v in spans.order])])
    segs = [
        (a, b, r)
        for a in range(n)
        for b in range(a + 1, n + 1)
        for r in (False, True)
        # A segment whose own peak is over the cap is never chosen.
        if not (r and forbidden[b] != forbidden[a]) and spans.inner(a, b, r) <= cap
    ]
    if not segs:
        return None
    held = np.array([spans.held(a, b, r) for a, b, r in segs])
    inner = np.array([spans.inner(a, b, r) for a, b, r in segs])
    nx_ = len(segs)
    rows = lil_matrix((3 * (n + 1), nx_))
    lo, hi = [], []
    for p in range(n + 1):  # the peak when the segment starting at p runs backward
        if p == n:  # no segment starts at n; what the last one holds is never held
            lo.append(-np.inf), hi.append(np.inf)
            continue
        for i, (a, b, _) in enumerate(segs):
            if b <= p:
                rows[p, i] += held[i]
            if a == p:
                rows[p, i] += inner[i]
        lo.append(-np.inf), hi.append(cap)
    for p in range(n + 1):  # flow: out - in = 1 at 0, -1 at n, 0 between
        for i, (a, b, _) in enumerate(segs):
            if a == p:
                rows[n + 1 + p, i] += 1.0
            if b == p:
                rows[n + 1 + p, i] -= 1.0
        target = 1.0 if p == 0 else (-1.0 if p == n else 0.0)
        lo.append(target), hi.append(target)
    for p in range(n + 1):  # kept segments never touch at p
        for i, (a, b, r) in enumerate(segs):
            if not r and (a == p or b == p):
                rows[2 * (n + 1) + p, i] = 1.0
        lo.append(-np.inf), hi.append(1.0)
    objective = np.array([spans.cost(a, b) if r else 0.0 for a, b, r in segs])
    result = milp(
        objective,
        integrality=np.ones(nx_),
        bounds=Bounds(0, 1),
        constraints=LinearConstraint(rows.tocsr(), lo, hi),
        options={"time_limit": 60, "mip_rel_gap": 0.0},  # exact, not HiGHS's default 1e-4
    )
    if result.status == 2:  # infeasible
        return None
    assert result.status == 0, result.message
    return float(result.fun)


def plan_recompute(plan, costs):
    """The recompute cost of a plan: the forward cost of its recomputed
    segments' calls."""
    return float(sum(costs.compute.get(v, 0.0) for s in plan.segments if s.remat for v in s.nodes))
