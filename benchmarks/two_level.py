"""Two-level checkpointing (issue 15 part 2): budgets below the floor of
plans of one level, measured against that floor and the baseline.

For each family: the baseline, the plan of one level with the least
estimated peak (`budget=` that peak), and budget fractions below it, which
`plan_for_budget` meets by cutting segments again. Each run in a fresh
process, the methods alternating, `--repeats` rounds; TensorFlow, no XLA,
in-process BFC peak (`graphckpt.measure`). Prints, per method, the plan
(segments, levels), its estimate against the budget, and the measured peak
and step time as ratios of the baseline's (medians).

    PYTHONPATH=. .venv/bin/python benchmarks/two_level.py [--families dense,cnn] [--repeats 3] [--backend jax]
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from graphckpt.measure import format_bytes, measure  # noqa: E402

FAMILIES_PY = os.path.join(HERE, "families.py")
FAMILIES = {
    # issue 14's and issue 3's chain
    "dense": dict(builder="dense_chain", kwargs=dict(depth=64, width=1024), batch=256, budgets=(0.32, 0.30)),
    # issue 15's ResNet-style CNN: 16, 32, 64 channels at 64 x 64, batch 16
    "cnn": dict(builder="resnet_cnn", kwargs=dict(channels=16, blocks_per_stage=2), batch=16, budgets=(0.50, 0.47)),
}


def _plan_info(fam, budget):
    """(segments, levels, estimated peak, estimated baseline) of a plan."""
    import families  # noqa: F401 - the builders
    import graphckpt

    model = getattr(families, fam["builder"])(**fam["kwargs"])
    plan = graphckpt.plan(model, budget=budget, batch_size=fam["batch"])
    return len(plan.segments), plan.levels, plan.estimated_peak_bytes, plan.baseline_peak_bytes


def _floor(fam):
    import families
    from graphckpt.estimator.peak import node_costs
    from graphckpt.graph.build import build_graph
    from graphckpt.planner import MemoryModel, smallest_peak

    graph = build_graph(getattr(families, fam["builder"])(**fam["kwargs"]))
    costs = node_costs(graph, fam["batch"])
    memory = MemoryModel(graph, costs)
    return smallest_peak(graph, costs, memory=memory), memory.baseline_peak()


def run(name, fam, repeats, steps, warmup, backend="tensorflow"):
    floor, baseline = _floor(fam)
    specs = [("baseline", dict(method="baseline"), None)]
    budgets = [("one level, least peak", int(floor))] + [(f"budget {b}", b) for b in fam["budgets"]]
    for label, budget in budgets:
        specs.append((label, dict(method="graphckpt", checkpoint_kwargs={"budget": budget, "batch_size": fam["batch"]}), budget))
    plans = {label: _plan_info(fam, budget) for label, _, budget in specs if budget is not None}
    print(f"== {name}: {fam['builder']}({fam['kwargs']}), batch {fam['batch']}; estimated floor of one level "
          f"{floor / baseline:.3f} of the estimated baseline", flush=True)
    runs = []
    for rnd in range(repeats):
        for label, spec, _ in specs:
            m = measure(f"{FAMILIES_PY}:{fam['builder']}", batch_size=fam["batch"], builder_kwargs=fam["kwargs"],
                        label=label, steps=steps, warmup=warmup, check=False, backend=backend, **spec)
            runs.append(dict(m.to_dict(), round=rnd))
            msg = f"peak {format_bytes(m.peak_bytes):>10} step {m.step_time_s:.3f} s" if m.ok else f"FAILED {m.error[:200]}"
            print(f"  [r{rnd}] {label:24s} {msg}", flush=True)
    base = [r for r in runs if r["label"] == "baseline" and r["ok"]]
    base_peak = statistics.median(r["peak_bytes"] for r in base)
    base_time = statistics.median(r["step_time_s"] for r in base)
    rows = []
    for label, _, budget in specs[1:]:
        mine = [r for r in runs if r["label"] == label and r["ok"]]
        if not mine:
            continue
        segs, levels, est, est_base = plans[label]
        peak = statistics.median(r["peak_bytes"] for r in mine)
        row = dict(
            label=label,
            segments=segs,
            levels=levels,
            budget_ratio=(budget if isinstance(budget, float) else budget / est_base),
            estimated_ratio=est / est_base,
            estimated_peak_bytes=est,
            peak_bytes=peak,
            peak_ratio=peak / base_peak,
            peak_over_estimate=peak / est,
            time_ratio=statistics.median(r["step_time_s"] for r in mine) / base_time,
        )
        rows.append(row)
        print(f"  {label:24s} {segs:2d} segments, {levels} level(s): estimated x{row['estimated_ratio']:.3f} "
              f"(budget x{row['budget_ratio']:.3f}); measured x{row['peak_ratio']:.3f} "
              f"({format_bytes(peak)}, {row['peak_over_estimate']:.2f} of its estimate), time x{row['time_ratio']:.2f}",
              flush=True)
    return dict(family=name, backend=backend, builder=fam["builder"], kwargs=fam["kwargs"], batch=fam["batch"],
                baseline_peak_bytes=base_peak, estimated_baseline_bytes=baseline, rows=rows, runs=runs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--backend", choices=("tensorflow", "jax", "torch"), default="tensorflow",
                   help="of the measured processes (the plans are made on TensorFlow's estimates alike)")
    p.add_argument("--out", default=None, help="default: results/two_level.json (results/<backend>/ for JAX, PyTorch)")
    args = p.parse_args(argv)
    if args.out is None:
        sub = () if args.backend == "tensorflow" else (args.backend,)
        args.out = os.path.join(HERE, "results", *sub, "two_level.json")
    t0 = time.time()
    results = [run(n, FAMILIES[n], args.repeats, args.steps, args.warmup, args.backend) for n in args.families.split(",")]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(date=time.strftime("%Y-%m-%d"), results=results), f, indent=1)
    print(f"-> {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
