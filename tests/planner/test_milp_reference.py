"""The budget search's recompute cost against the exact optimum of the same
memory model, from a MILP solver (`milp_reference.py`), on random DAGs of
up to 24 calls: issue 15 asks for within 10% on at least 20. The search is
a dynamic program over the same decision space, so it should be the
optimum itself; the test holds it to within 10% (and never below the
optimum, which would mean a plan the model says does not fit)."""

import pytest

from graphckpt.planner import BudgetInfeasible, baseline_peak, plan_for_budget, smallest_peak
from tests.planner import casefile
from tests.planner.milp_reference import least_recompute, plan_recompute  # scipy: in the test extra

CASES = [(seed, 12 + seed % 4 * 4) for seed in range(24)]  # 12, 16, 20, 24 calls


@pytest.mark.parametrize(("seed", "n"), CASES, ids=[f"seed{s}-n{n}" for s, n in CASES])
def test_budget_search_is_within_10_percent_of_the_milp_optimum(seed, n):
    graph, costs, keep = casefile.random_graph(seed, n)
    keep = keep if seed % 3 == 0 else ()
    low, high = smallest_peak(graph, costs, keep=keep), baseline_peak(graph, costs)
    for fraction in (0.0, 0.3, 0.6, 0.9):
        budget = low + fraction * (high - low)
        optimum = least_recompute(graph, costs, budget, keep)
        assert optimum is not None, "the smallest peak fits, so every budget above it does"
        plan = plan_for_budget(graph, costs, budget, keep=keep)
        assert plan.estimated_peak_bytes <= budget + 1e-6 * max(budget, 1.0)
        cost = plan_recompute(plan, costs)
        assert cost >= optimum - 1e-6 * max(optimum, 1.0), (cost, optimum)
        assert cost <= 1.10 * optimum + 1e-9, (cost, optimum)
    # Below the smallest peak both say no (of plans of one level: the
    # reference has no segments cut again).
    below = low - max(1.0, 0.01 * low)
    assert least_recompute(graph, costs, below, keep) is None
    with pytest.raises(BudgetInfeasible):
        plan_for_budget(graph, costs, below, keep=keep, two_level=False)
