"""The budget search (`graphckpt.planner.front.least_recompute`) gives the
plans of the plain Pareto dynamic program it replaced, on many small graphs
and caps: the same least recompute cost, the same segments (ties included),
and every segment's peak within the cap. The plain program is the
reference (`tests/planner/references.py`, the search before issue 15
part 4), and a brute force over every plan checks the least cost on tiny
graphs. No Keras is imported.
"""

import random

import pytest

from graphckpt.planner import front
from graphckpt.planner.budget_search import _forbidden_prefix, smallest_peak
from graphckpt.planner.memory import MemoryModel, NodeCosts
from tests.planner.graphs import random_dag, random_reads
from tests.planner.references import brute_force, plan_peak, reference_search


def _case(seed):
    """(spans, forbidden, caps) of one random case. Uniform chains (whole
    numbers: many ties, and the shift certificate applies), random DAGs with
    whole-number or fractional costs, some calls never recomputed."""
    rnd = random.Random(seed)
    kind = seed % 4
    n = rnd.randint(2, 9) if seed % 5 == 0 else rnd.randint(10, 45)
    g, names = random_dag(rnd, n, chain=kind == 0)
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
            reads=random_reads(random.Random(-seed), g) if kind == 2 else {},  # own generator: other draws stay
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
        want = reference_search(spans, cap, forbidden)
        assert got == want, (seed, cap)
        if got is not None:
            cost, segments = got
            assert [a for a, _, _ in segments] == sorted({a for a, _, _ in segments})
            assert segments[0][0] == 0 and segments[-1][1] == spans.n
            assert plan_peak(spans, segments) <= cap
            assert cost == pytest.approx(sum(spans.cost(a, b) for a, b, r in segments if r))


@pytest.mark.parametrize("seed", [s for s in range(60) if s % 5 == 0])
def test_least_cost_is_the_brute_force_least(seed):
    spans, forbidden, caps = _case(seed)
    for cap in caps:
        got = front.least_recompute(spans, cap, forbidden)
        best = brute_force(spans, cap, forbidden)
        assert (got is None) == (best is None), (seed, cap)
        if got is not None:
            assert got[0] == pytest.approx(best)


def test_long_uniform_chain_uses_the_shift_certificate():
    """A 300-call uniform chain: the certificate carries most states from one
    cut to the next, and the plan is the plain search's."""
    rnd = random.Random(1)
    g, names = random_dag(rnd, 300, chain=True)
    keys = list(g.graph["tensors"])
    costs = NodeCosts({k: 256 for k in keys}, frozenset(keys), {}, {v: 0 for v in names}, {v: 8192.0 for v in names})
    spans = MemoryModel(g, costs)
    forbidden = [0] * (spans.n + 1)
    assert front._exact_sums(spans)
    cap = int(0.5 * spans.inner_kept[0, spans.n])
    assert front.least_recompute(spans, cap, forbidden) == reference_search(spans, cap, forbidden)
