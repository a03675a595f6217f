"""benchmarks/recursion_bound.py's lower bound is one: on random layer-call
graphs it is never above the least estimated peak the planner finds with
one level (exact) or two (found within 1%, from above)."""

import os
import random
import sys

import pytest

from graphckpt.planner import BudgetInfeasible, MemoryModel, plan_for_budget, smallest_peak
from tests.planner.graphs import random_costs, random_dag

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from recursion_bound import bounds  # noqa: E402


@pytest.mark.parametrize("seed", range(16))
def test_the_bound_is_below_every_plan(seed):
    rnd = random.Random(seed)
    g, names = random_dag(rnd, rnd.randint(6, 24), chain=seed % 3 == 0)
    costs = random_costs(rnd, g, names, lambda: float(rnd.choice([1, 2, 3, 50])))
    memory = MemoryModel(g, costs)
    bound, _ = bounds(memory, 2)
    one = smallest_peak(g, costs, memory=memory)
    assert bound[1] + costs.fixed <= one
    try:
        plan_for_budget(g, costs, 1, memory=memory)
    except BudgetInfeasible as e:
        assert bound.get(2, bound[1]) + costs.fixed <= e.smallest_bytes
    assert bound.get(2, bound[1]) <= bound[1]  # (one entry: a fixed point at once)
