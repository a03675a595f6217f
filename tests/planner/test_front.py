"""The budget search (`graphckpt.planner.front.least_recompute`) gives the
plans of the plain Pareto dynamic program it replaced, on many small graphs
and caps: the same least recompute cost, the same segments (ties included),
and every segment's peak within the cap. The plain program is kept here as
the reference (`_reference_search`, the search before issue 15 part 4),
and a brute force over every plan checks the least cost on tiny graphs.
No Keras is imported.
"""

import itertools
import random

import networkx as nx
import numpy as np
import pytest

from graphckpt.graph import TensorInfo
from graphckpt.planner import front
from graphckpt.planner.budget_search import _forbidden_prefix, smallest_peak
from graphckpt.planner.memory import MemoryModel, NodeCosts


def _reference_search(spans, cap, forbidden):
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


def _brute_force(spans, cap, forbidden):
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
            if _peak(spans, [(a, b, r) for (a, b), r in zip(segs, remat)]) <= cap:
                c = sum(spans.cost(a, b) for (a, b), r in zip(segs, remat) if r)
                best = c if best is None else min(best, c)
    return best


def _peak(spans, segments):
    held, peak = 0.0, -np.inf
    for a, b, remat in segments:
        peak = max(peak, held + spans.inner(a, b, remat))
        held += spans.held(a, b, remat)
    return peak


def _graph(rnd, n, chain):
    """A layer-call graph in graph.py's schema: a chain, or a random DAG
    (calls reading 1-3 earlier tensors, a side output sometimes)."""
    g = nx.DiGraph()
    g.add_node("x", kind="input", position=0)
    names = [f"n{i}" for i in range(n)]
    for i, v in enumerate(names):
        g.add_node(v, kind="layer", position=i + 1)
        earlier = ["x"] + names[:i]
        extra = set() if chain else {rnd.choice(earlier) for _ in range(rnd.choice([0, 0, 1, 2]))}
        for u in sorted({earlier[-1]} | extra):
            g.add_edge(u, v, tensors=((u, 0, 0),))
    g.graph["tensors"] = {(v, 0, 0): TensorInfo((v, 0, 0), v, (None, 1), "float32", 4) for v in ["x"] + names}
    g.graph["inputs"] = [("x", 0, 0)]
    side = [] if chain or rnd.random() < 0.7 else [rnd.choice(names[:-1])]
    g.graph["outputs"] = [(v, 0, 0) for v in [names[-1]] + side]
    g.graph["state_chains"] = []
    return g, names


def _case(seed):
    """(spans, forbidden, caps) of one random case. Uniform chains (whole
    numbers: many ties, and the shift certificate applies), random DAGs with
    whole-number or fractional costs, some calls never recomputed."""
    rnd = random.Random(seed)
    kind = seed % 4
    n = rnd.randint(2, 9) if seed % 5 == 0 else rnd.randint(10, 45)
    g, names = _graph(rnd, n, chain=kind == 0)
    keys = list(g.graph["tensors"])
    if kind == 0:
        unit, work, flops = rnd.choice([1, 4, 256]), rnd.choice([0, 3]), float(rnd.choice([1, 7]))
        costs = NodeCosts({k: unit for k in keys}, frozenset(keys), {}, {v: work for v in names}, {v: flops for v in names})
    else:
        frac = kind == 3
        costs = NodeCosts(
            tensor_bytes={k: rnd.choice([1, 2, 5, 40, 300]) for k in keys},
            saved=frozenset(k for k in keys if rnd.random() < 0.7),
            internal={v: rnd.choice([0, 0, 3, 80]) for v in names},
            workspace={v: rnd.choice([0, 10, 50]) for v in names},
            compute={v: rnd.choice([1.0, 2.5, 1e6, 3.3e9]) if frac else float(rnd.choice([1, 2, 3, 50])) for v in names},
            fixed=rnd.choice([0, 7]),
        )
    keep = {v for v in names if rnd.random() < 0.15} if rnd.random() < 0.3 else set()
    spans = MemoryModel(g, costs)
    forbidden = _forbidden_prefix(spans.order, keep)
    least = smallest_peak(g, costs, keep=keep, memory=spans) - costs.fixed
    base = spans.inner_kept[0, n]
    caps = sorted({least - 1, least, int((least + base) / 2), base} | {int(least + rnd.random() * (base - least)) for _ in range(4)})
    return spans, forbidden, caps


@pytest.mark.parametrize("seed", range(160))
def test_same_plans_as_the_plain_search(seed):
    spans, forbidden, caps = _case(seed)
    for cap in caps:
        got = front.least_recompute(spans, cap, forbidden)
        want = _reference_search(spans, cap, forbidden)
        assert got == want, (seed, cap)
        if got is not None:
            cost, segments = got
            assert [a for a, _, _ in segments] == sorted({a for a, _, _ in segments})
            assert segments[0][0] == 0 and segments[-1][1] == spans.n
            assert _peak(spans, segments) <= cap
            assert cost == pytest.approx(sum(spans.cost(a, b) for a, b, r in segments if r))


@pytest.mark.parametrize("seed", [s for s in range(60) if s % 5 == 0])
def test_least_cost_is_the_brute_force_least(seed):
    spans, forbidden, caps = _case(seed)
    for cap in caps:
        got = front.least_recompute(spans, cap, forbidden)
        best = _brute_force(spans, cap, forbidden)
        assert (got is None) == (best is None), (seed, cap)
        if got is not None:
            assert got[0] == pytest.approx(best)


def test_long_uniform_chain_uses_the_shift_certificate():
    """A 300-call uniform chain: the certificate carries most states from one
    cut to the next, and the plan is the plain search's."""
    rnd = random.Random(1)
    g, names = _graph(rnd, 300, chain=True)
    keys = list(g.graph["tensors"])
    costs = NodeCosts({k: 256 for k in keys}, frozenset(keys), {}, {v: 0 for v in names}, {v: 8192.0 for v in names})
    spans = MemoryModel(g, costs)
    forbidden = [0] * (spans.n + 1)
    assert front._exact_sums(spans)
    cap = int(0.5 * spans.inner_kept[0, spans.n])
    assert front.least_recompute(spans, cap, forbidden) == _reference_search(spans, cap, forbidden)
