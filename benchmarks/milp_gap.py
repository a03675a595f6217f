"""graphckpt's budget search against the exact optimum of the same memory
model (a MILP solved by scipy's HiGHS: `tests/planner/milp_reference.py`)
on random DAGs, at budgets across the feasible range (issue 15, part 3).
No Keras is imported.

    python benchmarks/milp_gap.py [--calls 40] [--seeds 20] [--json PATH]

Prints, per DAG and budget, graphckpt's recompute cost over the optimum
(1.000 = optimal), and the solver's and the search's CPU seconds.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from graphckpt.planner import baseline_peak, plan_for_budget, smallest_peak  # noqa: E402
from tests.planner import casefile  # noqa: E402
from tests.planner.milp_reference import least_recompute, plan_recompute  # noqa: E402

FRACTIONS = (0.0, 0.3, 0.6, 0.9)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows, worst = [], 1.0
    for seed in range(args.seeds):
        graph, costs, keep = casefile.random_graph(seed, args.calls)
        keep = keep if seed % 3 == 0 else ()
        low, high = smallest_peak(graph, costs, keep=keep), baseline_peak(graph, costs)
        for fraction in FRACTIONS:
            budget = low + fraction * (high - low)
            t = time.process_time()
            try:
                optimum = least_recompute(graph, costs, budget, keep)
            except AssertionError as e:  # the solver's time limit
                print(f"seed {seed:2d} budget {fraction:.1f}: solver gave up ({e})")
                continue
            solver_s = time.process_time() - t
            t = time.process_time()
            cost = plan_recompute(plan_for_budget(graph, costs, budget, keep=keep), costs)
            search_s = time.process_time() - t
            ratio = cost / optimum if optimum else (1.0 if cost == 0 else float("inf"))
            worst = max(worst, ratio)
            rows.append({"seed": seed, "fraction": fraction, "optimum": optimum, "graphckpt": cost,
                         "ratio": ratio, "solver_s": solver_s, "search_s": search_s})
            print(f"seed {seed:2d} budget {fraction:.1f}: x{ratio:.4f}  solver {solver_s:6.2f} s  search {search_s:5.3f} s")
    print(f"{len(rows)} plans of {args.calls}-call DAGs, worst graphckpt / optimum: x{worst:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"calls": args.calls, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
