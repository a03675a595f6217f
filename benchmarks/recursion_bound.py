"""How low can recursive checkpointing go under graphckpt's memory model?
A lower bound on the estimated peak of plans of any number of levels
(issue 15 part 2), beside what the planner finds with one and two levels.

Plans cut one topological order of the layer calls. During the backward
pass, while the calls of `[c, b)` run, the calls of `[a, c)` hold at least
`out(a, c)` (`MemoryModel.held_remat`: what they pass on, as values or
gradients, whether kept or recomputed), and a span recomputed without
being cut again peaks at `inner_remat[a, b]`, one kept at
`inner_kept[a, b]`. So, with `L_1 = min(inner_kept, inner_remat)` and

    L_k[a, b] = min(L_{k-1}[a, b],
                    min_c max(L_{k-1}[a, c], held_remat[a, c] + L_k[c, b]))

`fixed + L_{k+1}[0, n]` is at most the estimated peak of any plan of `k`
levels: level 1's segments are the right-hand chain of splits, and each
may be cut again with one level fewer. It is a relaxation: a kept span
is let hold only what a recomputed one does, and a recomputed span cut
again does not pay for copying its inputs. With one and two levels the
planner's least estimates are printed beside it, so the relaxation's gap
can be read there. No process is measured; this is the model's arithmetic.

    PYTHONPATH=. .venv/bin/python benchmarks/recursion_bound.py [--families cnn,dense] [--levels 12]
"""

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from two_level import FAMILIES  # noqa: E402


def bounds(memory, levels):
    """`{k: L_{k+1}[0, n]}` for k = 1 .. levels (bytes, `fixed` left out),
    and the first k whose table equals the one before (a fixed point: the
    bound then holds for any number of levels), or None."""
    n = memory.n
    prev = np.minimum(memory.inner_kept, memory.inner_remat)
    out, fixed_from = {}, None
    for k in range(1, levels + 1):
        cur = prev.copy()
        for length in range(2, n + 1):
            for a in range(n - length + 1):
                b = a + length
                cs = np.arange(a + 1, b)
                split = np.maximum(prev[a, cs], memory.held_remat[a, cs] + cur[cs, b]).min()
                cur[a, b] = min(prev[a, b], split)
        out[k] = float(cur[0, n])
        if np.array_equal(cur, prev):
            fixed_from = k
            break
        prev = cur
    return out, fixed_from


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="cnn,dense")
    p.add_argument("--levels", type=int, default=12, help="at most this many (it stops at a fixed point)")
    args = p.parse_args()

    import families
    import graphckpt
    from graphckpt.estimator.peak import node_costs
    from graphckpt.graph.build import build_graph
    from graphckpt.planner import (
        BudgetInfeasible,
        MemoryModel,
        plan_for_budget,
        smallest_peak,
        two_level,
    )

    for name in args.families.split(","):
        fam = FAMILIES[name]
        model = getattr(families, fam["builder"])(**fam["kwargs"])
        graph = build_graph(model)
        costs = node_costs(graph, fam["batch"])
        memory = MemoryModel(graph, costs)
        base = memory.baseline_peak()
        one = smallest_peak(graph, costs, memory=memory)
        try:  # a budget no plan fits: the error carries the least peak of two levels (within 1%, from above)
            plan_for_budget(graph, costs, 1, memory=memory)
        except BudgetInfeasible as e:
            two = e.smallest_bytes
        print(f"{name}: {memory.n} layer calls, batch {fam['batch']}, estimated baseline {base / 2**20:.1f} MiB")
        print("| levels | lower bound, any plan | the planner's least estimate |\n|---:|---:|---:|")
        values, fixed_from = bounds(memory, args.levels)
        for k, value in values.items():
            found = {1: one, 2: two}.get(k)
            shown = f"x{found / base:.3f}" if found is not None else "(not planned)"
            print(f"| {k} | x{(value + costs.fixed) / base:.3f} | {shown} |")
        if fixed_from:
            print(f"a fixed point at {fixed_from} levels: the last bound holds for any number of levels")
        print(f"one call's backward alone (`two_level._one_call_floor`): x{(two_level._one_call_floor(memory) + costs.fixed) / base:.3f}")
        print(f"(graphckpt {graphckpt.__version__}; plans cut one topological order)\n", flush=True)


if __name__ == "__main__":
    main()
