"""Two-level plans: recomputed segments cut again, for budgets that no plan
of one level fits.

A segment of one level recomputes its whole interior at once, so its
backward pass holds all of it: the largest segment sets a floor under every
plan's peak (a 72-call ResNet-style CNN: 38% of its baseline). Cut again,
a segment's recompute keeps only what crosses its inner segments, and each
inner segment is recomputed once more when its own backward pass comes:
the peak falls towards O(n^(1/3)) boundaries, for one more forward pass of
the segments so cut (Chen et al. 2016, section 4.4: recursive
checkpointing).

`plan_two_level` finds the plan of least recompute under a cap when
segments may be cut again; `smallest_two_level` is the least peak such
plans reach. Both run only when the plans of one level do not fit
(`graphckpt.planner.budget_search`). This module never imports Keras; it
uses numpy.

How: the least peak of every span cut into inner segments is found at
`GRID` caps evenly spaced up to the budget (so each is rounded up by at
most 1/GRID of the budget); a span is cut again where its one-level
recompute cannot fit the cap (first try), or wherever cutting lowers its
peak (second try); the outer plan is then `front.least_recompute` over
those spans, each cut again counted at twice its forward cost; last, the
inner plan of least recompute that fits each such segment's room.
"""

import numpy as np

from graphckpt.planner.front import least_recompute
from graphckpt.planner.memory import SubSpans
from graphckpt.planner.search import least_held_fits

__all__ = ["plan_two_level", "smallest_two_level", "GRID", "MAX_SPAN"]

GRID = 128  # caps at which each span's two-level peak is found
MAX_SPAN = 128  # the most layer calls of a segment cut again


def _inner_peaks(spans, cap, grid=GRID, max_span=MAX_SPAN):
    """P[a, b]: the least peak of the backward pass of `[a, b)` cut into
    inner segments (recomputed or kept), not counting the inputs the outer
    recompute copies, rounded up to a multiple of cap / grid; inf above cap.

    Per start a and cap, the dynamic program of `search.least_held_fits` (the least
    bytes held by the inner segments so far, per cut position), vectorized
    over the grid of caps."""
    n = spans.n
    caps = cap * np.arange(1, grid + 1) / grid
    P = np.full((n + 1, n + 1), np.inf)
    for a in range(n):
        end = min(n, a + max_span)
        free = np.full((end - a + 1, grid), np.inf)  # last inner segment recomputed (or none yet)
        kept = np.full((end - a + 1, grid), np.inf)  # last inner segment kept
        free[0] = 0.0
        for c in range(a + 1, end + 1):
            m = c - a
            prev_free = free[:m]
            prev_any = np.minimum(prev_free, kept[:m])
            inner_r = prev_any + spans.inner_remat[a:c, c][:, None]
            inner_k = prev_free + spans.inner_kept[a:c, c][:, None]
            free[m] = np.where(inner_r <= caps, prev_any + spans.held_remat[a:c, c][:, None], np.inf).min(0)
            kept[m] = np.where(inner_k <= caps, prev_free + spans.held_kept[a:c, c][:, None], np.inf).min(0)
            fits = np.isfinite(free[m]) | np.isfinite(kept[m])
            if fits.any():
                P[a, c] = caps[int(np.argmax(fits))]
    return P


def _one_call_floor(spans):
    """A bound no plan goes below, of any number of levels: the largest of
    one call's kept bytes plus its backward workspace (every segment that
    holds the call peaks at least there)."""
    calls = np.arange(spans.n)
    return float(np.max(spans.inner_kept[calls, calls + 1] - spans.held_remat[calls, calls + 1]))


class _TwoLevelSpans:
    """The span tables of the outer plan: a recomputed span marked in `cut`
    peaks as it does cut again, and costs two forward passes."""

    costs = None  # no exact-sum shortcut in `front`
    monotone = False  # a longer span cut again may peak lower

    def __init__(self, spans, P, everywhere, cap):
        two = spans.copied_span + P
        if everywhere:
            self.cut = two < spans.inner_remat
        else:
            self.cut = (spans.inner_remat > cap) & np.isfinite(two)
        self.n = spans.n
        self.inner_kept, self.held_kept, self.held_remat = spans.inner_kept, spans.held_kept, spans.held_remat
        self.inner_remat = np.where(self.cut, two, spans.inner_remat)
        self.cost_span = np.where(self.cut, 2 * spans.cost_span, spans.cost_span)


def plan_two_level(spans, cap, forbidden):
    """The outer segments and inner cuts of a plan whose peak fits `cap`,
    with segments cut again where needed, or None when none fits.

    Returns `(segments, inner)`: `segments` as `front.least_recompute`
    gives them (`(a, b, remat)`), `inner` one entry per segment, None or
    `(starts, remat)` within the segment."""
    if cap < _one_call_floor(spans):
        return None
    P = _inner_peaks(spans, cap)
    for everywhere in (False, True):
        view = _TwoLevelSpans(spans, P, everywhere, cap)
        found = least_recompute(view, cap, forbidden)
        if found is not None:
            return _inner_plans(spans, view, found[1], cap)
    return None


def _inner_plans(spans, view, segments, cap):
    held, inner = 0.0, []
    for a, b, remat in segments:
        cut = None
        if remat and view.cut[a, b]:
            room = cap - held - spans.copied(a, b)
            found = least_recompute(SubSpans(spans, a, b), room, np.zeros(b - a + 1, dtype=np.int64))
            if found is None:  # the grid rounds peaks up, so this cannot happen
                raise RuntimeError(f"no inner plan of [{a}, {b}) fits {room} bytes")
            subs = found[1]
            if len(subs) > 1 or subs[0][2]:
                cut = ([s for s, _, _ in subs], [r for _, _, r in subs])
        inner.append(cut)
        held += spans.held(a, b, remat)
    return segments, inner


def smallest_two_level(spans, forbidden, hi, rtol=0.01):
    """About the least peak (within `rtol` and 1/GRID of `hi`, from above) of
    any plan whose segments may be cut again; `hi` is one that fits (the
    least peak of one level). The spans' two-level peaks are found once, at
    caps up to `hi`; the bisection then runs the outer feasibility test
    alone."""
    P = _inner_peaks(spans, hi)
    lo = 0.0
    while hi - lo > rtol * hi:
        mid = (lo + hi) / 2
        if least_held_fits(_TwoLevelSpans(spans, P, True, mid), mid, forbidden):
            hi = mid
        else:
            lo = mid
    return hi
