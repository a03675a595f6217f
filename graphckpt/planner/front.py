"""The exact Pareto search behind `plan_for_budget`.

`least_recompute` is a dynamic program over the cut positions of one order:
state (cut position b, whether the segment ending at b is kept), each state
holding the Pareto front of (held bytes, recompute cost) over the plans of
the prefix [0, b) whose segments all fit a cap. The front of b is the
Pareto front of every earlier front moved by one more segment; what makes
it fast is not looking at most of those candidates, with proofs that each
one skipped would be dropped:

- a stair of candidates known to be good (the sources of the last cut's
  fronts, and those fronts): a run of front points whose lower-left
  corner the stair beats is beaten point by point (`_Stair`, blocks);
- a certificate carried from one cut to the next: when every state moves
  by the same (held, cost) shift to b as it did to b - 1 (chains), a
  candidate beaten at b - 1 by a front source that is still live is beaten
  at b, so only last cut's front sources and the points above the least
  held of a front source no longer live are looked at again. The shift is
  only trusted on whole-number bytes and costs (exact float sums).

The fronts, the plans and their ties come out as the plain dynamic program
makes them (`tests/planner/test_front.py` keeps that program as the
reference). This module never imports Keras; it uses numpy.
"""

import numpy as np

__all__ = ["least_recompute"]

_LEVELS = (32, 4)  # block sizes over each front, coarse to fine


def _segment_starts(spans, cap):
    """a_min[b]: the least start a of a segment [a, b); no segment reaching
    further back than one whose kept peak exceeds `cap` is tried."""
    n = spans.n
    a_min = np.zeros(n + 1, dtype=np.int64)
    if not getattr(spans, "monotone", True):
        return a_min  # a longer span may peak lower (`nested`): try every start
    for b in range(1, n + 1):
        over = np.flatnonzero(spans.inner_kept[:b, b] > cap)
        a_min[b] = over[-1] + 1 if over.size else 0
    return a_min


def _suffix_peaks(spans, forbidden, a_min):
    """G[b, kept]: the least peak of any plan of the suffix [b, n) (the held
    bytes of its own segments plus each one's inner peak)."""
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


def _exact_sums(spans):
    """Whether every byte count and cost is a whole number small enough that
    float sums of them are exact (then shifts compare exactly)."""
    costs = getattr(spans, "costs", None)
    if costs is None:
        return False
    byte_counts = [*costs.tensor_bytes.values(), *costs.internal.values(), *costs.workspace.values(), *costs.freed.values(),
                   *costs.forward_temp.values()]
    for values in (byte_counts, list(costs.compute.values())):
        v = np.abs(np.asarray(values, dtype=float))
        if v.size and not (np.all(np.mod(v, 1.0) == 0) and v.sum() < 2.0**50):
            return False
    return True


def _ranges(lo, hi):
    """The concatenated ranges [lo[i], hi[i])."""
    lens = hi - lo
    total = int(lens.sum())
    if not total:
        return np.empty(0, dtype=np.int64)
    return np.repeat(lo - (np.cumsum(lens) - lens), lens) + np.arange(total)


def _first_failing(lo, hi, ok):
    """Per row i, the least j in [lo[i], hi[i]) with not ok(rows, j), else
    hi[i], for an `ok` true then false along each range."""
    lo, hi = lo.copy(), hi.copy()
    act = np.flatnonzero(lo < hi)
    while act.size:
        mid = (lo[act] + hi[act]) // 2
        good = ok(act, mid)
        lo[act[good]] = mid[good] + 1
        hi[act[~good]] = mid[~good]
        act = act[lo[act] < hi[act]]
    return lo


class _Table:
    """Growable numpy columns of one length."""

    def __init__(self, **dtypes):
        self.n = 0
        self._cols = {k: np.zeros(256, dtype=t) for k, t in dtypes.items()}
        self.__dict__.update(self._cols)

    def append(self, **values):
        m = len(next(iter(values.values())))
        size = len(next(iter(self._cols.values())))
        if self.n + m > size:
            while self.n + m > size:
                size *= 2
            self._cols = {k: np.resize(v, size) for k, v in self._cols.items()}
            self.__dict__.update(self._cols)
        for k, v in values.items():
            self._cols[k][self.n : self.n + m] = v
        self.n += m


class _Stair:
    """Candidates of one state, sorted as the search sorts them (held, cost,
    rank, pool index), to tell which other candidates the search drops.

    A table over `bins` bins of held bytes in [0, top] answers most queries
    with one lookup (the stair's least cost strictly below a query's bin);
    the rest are searched exactly, ties included."""

    def __init__(self, h, c, r, i, top, bins=4096):
        o = np.lexsort((i, r, c, h))
        self.h, self.c, self.r, self.i = h[o], c[o], r[o], i[o]
        self.least = np.minimum.accumulate(self.c)
        self.table = None
        if self.h.size and 0 < top < np.inf:
            # table[k]: least cost of the points at or below edge k - 1
            j = np.searchsorted(self.h, np.arange(bins + 1) * (top / bins), side="right") - 1
            self.table = np.concatenate([[np.inf], np.where(j >= 0, self.least[np.maximum(j, 0)], np.inf)])
            self.inv, self.last = bins / top, bins + 1

    def beats(self, h, c, r, i):
        """Whether a stair point comes before each (h, c, r, i) in the
        search's order at no higher cost (the search drops those)."""
        size = self.h.size
        if not size:
            return np.zeros(h.shape, dtype=bool)
        if self.table is None:
            return self._beats(h, c, r, i)
        # edge k - 1 lies below h: those points come first
        out = self.table[np.minimum((h * self.inv).astype(np.int64), self.last)] <= c
        rest = np.flatnonzero(~out)
        out[rest] = self._beats(h[rest], c[rest], r[rest], i[rest])
        return out

    def _beats(self, h, c, r, i):
        size = self.h.size
        j = np.searchsorted(self.h, h, side="left")
        out = (j > 0) & (self.least[np.maximum(j - 1, 0)] <= c)
        jj = np.minimum(j, size - 1)
        sc, sr = self.c[jj], self.r[jj]
        tie = (self.h[jj] == h) & ((sc < c) | ((sc == c) & ((sr < r) | ((sr == r) & (self.i[jj] < i)))))
        return out | ((j < size) & tie)


def least_recompute(spans, cap, forbidden):
    """Least-recompute plan with every segment's peak within `cap`.

    Dynamic programming over the cut positions of `spans.order`. State:
    (cut position b, whether the segment ending at b is kept). Each state
    holds the Pareto front of (held bytes, recompute cost) over the plans of
    the prefix [0, b) whose segments all fit `cap`, sorted by held bytes.
    Two kept segments never touch, a recomputed segment holds no call
    marked in `forbidden` (a prefix count), and no segment starts before
    `_segment_starts`. Ties go as in a scan of starts from b - 1 down
    (recomputed before kept predecessors). Points that no completion can
    fit (`_suffix_peaks`) are dropped.

    Returns (cost, [(a, b, remat), ...]), or None when nothing fits.
    """
    n = spans.n
    forbidden = np.asarray(forbidden)
    a_min = _segment_starts(spans, cap)
    G = _suffix_peaks(spans, forbidden, a_min)
    slack = cap + 1e-9 * abs(cap) + 1e-6
    exact = _exact_sums(spans)
    whole = exact and float(cap).is_integer()  # live points: held up to a whole number
    pool = _Table(held=float, cost=float, state=np.int64, back=np.int64)
    pool.append(held=[0.0], cost=[0.0], state=[0], back=[-1])
    # states: one front each (pool[lo:hi]), at position a; blo/bhi: its level-0 blocks
    states = _Table(a=np.int64, pk=bool, lo=np.int64, hi=np.int64, blo=np.int64, bhi=np.int64)
    states.append(a=[0], pk=[False], lo=[0], hi=[1], blo=[0], bhi=[1])
    blocks = [_Table(state=np.int64, start=np.int64, hf=float, cl=float, lo=np.int64, hi=np.int64) for _ in _LEVELS]
    for t in blocks:
        t.append(state=[0], start=[0], hf=[0.0], cl=[0.0], lo=[0], hi=[1])
    first_state = np.zeros(n + 2, dtype=np.int64)  # first state id at each position
    first_state[1] = 1
    final, prev = {}, {False: None, True: None}
    hint = np.zeros(1, dtype=np.int64)
    for b in range(1, n + 1):
        fb = forbidden[:b] == forbidden[b]
        r_lo, r_hi = int(first_state[a_min[b]]), states.n
        S_a, S_pk, S_lo, S_hi = (col[r_lo:r_hi] for col in (states.a, states.pk, states.lo, states.hi))
        out = []
        for kept in (False, True):
            step = _Step(spans, b, kept, cap, slack, G, fb, pool, states, r_lo, S_a, S_pk, S_lo, S_hi, whole)
            p = prev[kept]
            certified = p is not None and exact and forbidden[b] == forbidden[b - 1] and r_lo < p["r_hi"]
            start, end, extra = step.ranges(p, certified)
            stair = step.stair(hint)
            todo = np.flatnonzero(end > start) + r_lo
            idx = _ranges(states.blo[todo], states.bhi[todo])
            for k, size in enumerate(_LEVELS):
                t = blocks[k]
                row = t.state[idx] - r_lo
                idx = idx[(t.start[idx] < end[row]) & (t.start[idx] + size > start[row])]
                h, c, r = step.moved(t.hf[idx], t.cl[idx], t.state[idx])
                idx = idx[~stair.beats(h, c, r, t.start[idx])]
                idx = _ranges(t.lo[idx], t.hi[idx])
            row = pool.state[idx] - r_lo
            idx = np.concatenate([idx[(idx < end[row]) & (idx >= start[row])], extra])
            h, c, r = step.moved(pool.held[idx], pool.cost[idx], pool.state[idx])
            keep = ~stair.beats(h, c, r, idx)
            out.append((kept, h[keep], c[keep], r[keep], idx[keep], step.record(end)))
        hint = []
        for kept, h, c, r, src, rec in out:
            order = np.lexsort((r, c, h))
            c_sorted = c[order]
            best_before = np.minimum.accumulate(np.concatenate([[np.inf], c_sorted[:-1]]))
            sel = order[c_sorted < best_before]
            rec.update(front_src=src[sel], front_state=pool.state[src[sel]], front_h=h[sel])
            prev[kept] = rec
            if sel.size:
                if b == n:
                    final[kept] = (pool.n, sel.size)
                hint += [src[sel], np.arange(pool.n, pool.n + sel.size)]
                _add_front(pool, states, blocks, b, kept, h[sel], c[sel], src[sel])
        hint = np.concatenate(hint) if hint else np.zeros(0, dtype=np.int64)
        first_state[b + 1] = states.n
    if not final:
        return None
    cost, key = min((pool.cost[s0 : s0 + m].min(), k) for k, (s0, m) in sorted(final.items()))
    s0, m = final[key]
    i = s0 + int(np.argmin(pool.cost[s0 : s0 + m]))
    segments = []
    while pool.back[i] >= 0:
        j = pool.back[i]
        si, sj = pool.state[i], pool.state[j]
        segments.append((int(states.a[sj]), int(states.a[si]), not bool(states.pk[si])))
        i = j
    return float(cost), segments[::-1]


class _Step:
    """One target state (b, kept): which points of each earlier state are
    live candidates for it, and where they move."""

    def __init__(self, spans, b, kept, cap, slack, G, fb, pool, states, r_lo, S_a, S_pk, S_lo, S_hi, whole):
        self.b, self.kept, self.pool, self.states, self.r_lo, self.whole = b, kept, pool, states, r_lo, whole
        self.S_lo, self.S_hi = S_lo, S_hi
        if kept:
            inner, self.dheld, self.dcost = spans.inner_kept[:b, b], spans.held_kept[:b, b], None
            flag = ~S_pk
        else:
            inner, self.dheld, self.dcost = spans.inner_remat[:b, b], spans.held_remat[:b, b], spans.cost_span[:b, b]
            flag = fb[S_a] & (inner[S_a] <= cap)
        self.lim = cap - inner[S_a]
        self.dh = self.dheld[S_a]
        self.dc = self.dcost[S_a] if self.dcost is not None else np.zeros(S_a.size)
        self.top = np.where(flag, S_hi, S_lo)  # no point of a state not allowed is live
        self.g, self.slack = G[b, int(kept)], slack

    def live(self, rows, j):
        """Whether pool point j of state r_lo + rows is a candidate (the plain
        search's tests, in its float order)."""
        h = self.pool.held[j]
        return (j < self.top[rows]) & (h <= self.lim[rows]) & ((h + self.dh[rows]) + self.g <= self.slack)

    def ranges(self, p, certified):
        """Per state, the points [start, end) to look at, and `extra` points
        (last step's front sources) below start."""
        end = self._ends(p)
        start = self.S_lo.copy()
        extra = np.zeros(0, dtype=np.int64)
        if certified:
            start, extra = self._certified(p, start, end)
        return start, end, extra

    def _ends(self, p):
        """Per state, the end of its live points (a prefix of its front):
        from last step's end, one step either way, else bisection."""
        lo_, top = self.S_lo, self.top
        guess = lo_.copy()
        if p is not None:
            o_lo, o_hi = max(self.r_lo, p["r_lo"]), p["r_hi"]
            if o_lo < o_hi:
                guess[o_lo - self.r_lo : o_hi - self.r_lo] = p["end"][o_lo - p["r_lo"] :]
        guess = np.minimum(guess, top)
        if self.whole:
            # the tests of `live` in whole numbers: held at most t
            t = np.minimum(self.lim, np.floor(self.slack) - self.g - self.dh)
            held = self.pool.held

            def ok(rows, j):
                return held[j] <= t[rows]
        else:
            ok = self.live
        rows = np.arange(lo_.size)
        at = np.maximum(top - 1, lo_)  # any index of the state, for masked tests
        below = (guess == lo_) | ok(rows, np.minimum(np.maximum(guess - 1, lo_), at))
        above = (guess < top) & ok(rows, np.minimum(guess, at))
        lo, hi = guess.copy(), guess.copy()
        up = below & above  # end above the guess
        r = np.flatnonzero(up)
        more = (guess[r] + 1 < top[r]) & ok(r, np.minimum(guess[r] + 1, at[r]))
        lo[r] = np.where(more, guess[r] + 2, guess[r] + 1)
        hi[r] = np.where(more, top[r], guess[r] + 1)
        r = np.flatnonzero(~below)  # end below the guess
        less = (guess[r] - 1 > lo_[r]) & ~ok(r, np.maximum(guess[r] - 2, lo_[r]))
        lo[r] = np.where(less, lo_[r], guess[r] - 1)
        hi[r] = np.where(less, guess[r] - 2, guess[r] - 1)
        return _first_failing(lo, hi, ok)

    def _certified(self, p, start, end):
        o_lo, o_hi = max(self.r_lo, p["r_lo"]), p["r_hi"]
        cur, old = slice(o_lo - self.r_lo, o_hi - self.r_lo), slice(o_lo - p["r_lo"], None)
        ddh, ddc = self.dh[cur] - p["dh"][old], self.dc[cur] - p["dc"][old]
        if not (ddh.size and np.all(ddh == ddh[0]) and np.all(ddc == ddc[0])):
            return start, np.zeros(0, dtype=np.int64)
        fs, fsrc = p["front_state"], p["front_src"]
        alive = fs >= self.r_lo
        alive[alive] = self.live(fs[alive] - self.r_lo, fsrc[alive])
        m = p["front_h"][~alive].min() if not alive.all() else np.inf
        # from the first point at or above m (in last step's held), and every
        # point that was not live then
        was = p["end"][old]
        d_old = p["dh"][old]
        lo = self.S_lo[cur]
        high = (was > lo) & (self.pool.held[np.maximum(was - 1, 0)] + d_old >= m)
        first = was.copy()
        if high.any():
            r = np.flatnonzero(high)
            first[r] = _first_failing(lo[r], was[r], lambda rows, j: self.pool.held[j] + d_old[r[rows]] < m)
        start[cur] = first
        extra = fsrc[alive]
        return start, extra[extra < start[self.pool.state[extra] - self.r_lo]]

    def stair(self, hint):
        """Last step's front sources and front points that are live now."""
        pool = self.pool
        hs = hint[pool.state[hint] >= self.r_lo]
        hs = hs[self.live(pool.state[hs] - self.r_lo, hs)]
        return _Stair(*self.moved(pool.held[hs], pool.cost[hs], pool.state[hs]), hs, self.slack)

    def moved(self, h, c, st):
        """(held, cost, rank) at b of points of states `st`; rank orders ties
        as a scan of starts from b - 1 down."""
        a = self.states.a[st]
        if self.kept:
            return h + self.dheld[a], c + 0.0, self.b - 1 - a
        return h + self.dheld[a], c + self.dcost[a], (self.b - 1 - a) * 2 + self.states.pk[st]

    def record(self, end):
        return {"r_lo": self.r_lo, "r_hi": self.r_lo + self.S_lo.size, "dh": self.dh, "dc": self.dc, "end": end}


def _add_front(pool, states, blocks, b, kept, h, c, src):
    """Stores the front of state (b, kept) and its blocks, finest first (each
    block level points into the next, the finest into the pool)."""
    m, s0, sid = h.size, pool.n, states.n
    pool.append(held=h, cost=c, state=np.full(m, sid), back=src)
    child = None
    for k in range(len(_LEVELS) - 1, -1, -1):
        size = _LEVELS[k]
        st = np.arange(s0, s0 + m, size)
        en = np.minimum(st + size, s0 + m)
        if child is None:
            clo, chi = st, en
        else:
            fine = _LEVELS[k + 1]
            clo, chi = child + (st - s0) // fine, child + (en - s0 + fine - 1) // fine
        child = blocks[k].n
        blocks[k].append(state=np.full(st.size, sid), start=st, hf=pool.held[st], cl=pool.cost[en - 1], lo=clo, hi=chi)
    states.append(a=[b], pk=[kept], lo=[s0], hi=[s0 + m], blo=[child], bhi=[child + st.size])
