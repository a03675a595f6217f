"""Reference planners for the planner tests: the plain Pareto dynamic
program the budget search replaced (`reference_search`, the search before
issue 15 part 4), a brute force over every plan (`brute_force`, tiny
graphs), and a plan's peak (`plan_peak`). No Keras."""

import itertools

import numpy as np


def reference_search(spans, cap, forbidden):
    """The plain dynamic program: every candidate of every earlier front,
    moved by one more segment, sorted, and the Pareto front kept."""
    n = spans.n
    forbidden = np.asarray(forbidden)
    a_min = np.zeros(n + 1, dtype=np.int64)
    if getattr(spans, "monotone", True):  # else no start can be pruned by a kept span's peak
        for b in range(1, n + 1):
            over = np.flatnonzero(spans.inner_kept[:b, b] > cap)
            a_min[b] = over[-1] + 1 if over.size else 0
    G = np.full((n + 1, 2), np.inf)
    G[n, :] = -np.inf
    for b in range(n - 1, -1, -1):
        allowed = a_min[b + 1 :] <= b
        r_ok = allowed & (forbidden[b + 1 :] == forbidden[b])
        r = np.where(r_ok, np.maximum(spans.inner_remat[b, b + 1 :], spans.held_remat[b, b + 1 :] + G[b + 1 :, 0]), np.inf)
        k = np.where(allowed, np.maximum(spans.inner_kept[b, b + 1 :], spans.held_kept[b, b + 1 :] + G[b + 1 :, 1]), np.inf)
        G[b, 1] = r.min()
        G[b, 0] = min(r.min(), k.min())
    slack = cap + 1e-9 * abs(cap) + 1e-6
    # pool of front points: held, cost, position, kept flag, back pointer
    held, cost, pos, pk, back = [0.0], [0.0], [0], [False], [-1]
    start_at = [0, 1]  # first pool index of each position
    final = {}
    for b in range(1, n + 1):
        lo = start_at[a_min[b]]
        e_held, e_cost = np.array(held[lo:]), np.array(cost[lo:])
        e_a, e_pk = np.array(pos[lo:], dtype=np.int64), np.array(pk[lo:], dtype=bool)
        out = []
        ir = spans.inner_remat[:b, b][e_a]
        ok = (forbidden[:b] == forbidden[b])[e_a] & (ir <= cap) & (e_held <= cap - ir)
        idx = np.flatnonzero(ok)
        if idx.size:
            ea = e_a[idx]
            h = e_held[idx] + spans.held_remat[:b, b][ea]
            c = e_cost[idx] + spans.cost_span[:b, b][ea]
            out.append((False, h, c, (b - 1 - ea) * 2 + e_pk[idx], idx + lo))
        ik = spans.inner_kept[:b, b][e_a]
        idx = np.flatnonzero((~e_pk) & (e_held <= cap - ik))
        if idx.size:
            ea = e_a[idx]
            h = e_held[idx] + spans.held_kept[:b, b][ea]
            out.append((True, h, e_cost[idx] + 0.0, b - 1 - ea, idx + lo))
        for kept, h, c, rank, src in out:
            live = h + G[b, int(kept)] <= slack
            h, c, rank, src = h[live], c[live], rank[live], src[live]
            if not h.size:
                continue
            order = np.lexsort((rank, c, h))
            c_sorted = c[order]
            best_before = np.minimum.accumulate(np.concatenate([[np.inf], c_sorted[:-1]]))
            keep = order[c_sorted < best_before]
            if b == n:
                final[kept] = (len(held), keep.size)
            held += list(h[keep])
            cost += list(c[keep])
            pos += [b] * keep.size
            pk += [kept] * keep.size
            back += list(src[keep])
        start_at.append(len(held))
    finals = [(min(cost[s : s + m]), k) for k, (s, m) in final.items()]
    if not finals:
        return None
    best, key = min(sorted(finals, key=lambda f: f[1]), key=lambda f: f[0])
    s, m = final[key]
    i = s + int(np.argmin(cost[s : s + m]))
    segments = []
    while back[i] >= 0:
        j = back[i]
        segments.append((int(pos[j]), int(pos[i]), not bool(pk[i])))
        i = j
    return float(best), segments[::-1]


def brute_force(spans, cap, forbidden):
    """The least recompute cost over every plan the search may make."""
    n, best = spans.n, None
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        segs = list(zip(bounds, bounds[1:]))
        for remat in itertools.product((False, True), repeat=len(segs)):
            if any(not x and not y for x, y in zip(remat, remat[1:])):
                continue  # two kept segments never touch
            if any(r and forbidden[a] != forbidden[b] for (a, b), r in zip(segs, remat)):
                continue
            if plan_peak(spans, [(a, b, r) for (a, b), r in zip(segs, remat)]) <= cap:
                c = sum(spans.cost(a, b) for (a, b), r in zip(segs, remat) if r)
                best = c if best is None else min(best, c)
    return best


def plan_peak(spans, segments):
    held, peak = 0.0, -np.inf
    for a, b, remat in segments:
        peak = max(peak, held + spans.inner(a, b, remat))
        held += spans.held(a, b, remat)
    return peak
