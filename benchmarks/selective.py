"""Less recompute for the same memory (issue 15 part 1), measured.

For each family: the baseline, the default plan, and budget plans at the
default plan's estimated peak times 1.00, 1.05, 1.10 and 1.20. A budget plan is
the plan of least estimated recompute *time* that fits
(`graphckpt.estimator.cost_model`: matmul-like calls priced by FLOPs, the others by
the bytes they move, calibrated by `benchmarks/cost_probe.py`), and it
knows that the graph runtime skips recomputing a segment's last call when
that call's backward needs only its inputs (a convolution or Dense without
activation): segments then end right after the expensive calls, whose
outputs are kept, and recompute the cheap calls between them (selective
recompute, as JAX's `checkpoint_dots`).

Each run in a fresh process, the methods alternating, `--repeats` rounds;
TensorFlow, no XLA, in-process BFC peak (`graphckpt.measure`). Prints per
method the plan's segments, its estimated peak and recompute, and the
measured peak, step time and CPU time as ratios of the baseline's (medians
of the per-round ratios).

    PYTHONPATH=. .venv/bin/python benchmarks/selective.py [--families resnet50v2,transformer,cnn] [--repeats 3]

`--open-layers`: the budget plans also cut inside composite layers
(`open_layers=True`: inside each MultiHeadAttention), at the same budgets.
"""

import argparse
import json
import os
import statistics
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from graphckpt.measure import format_bytes, measure  # noqa: E402

FAMILIES_PY = os.path.join(HERE, "families.py")
# The sizes of run_all.py. Issue 15's lines: x1.20 (ResNet50V2, Transformer),
# x1.25 (the ResNet-style CNN) at the default plan's memory + 5%.
FAMILIES = {
    "resnet50v2": dict(builder="resnet50v2", kwargs=dict(size=128), batch=8, target=1.20),
    "transformer": dict(
        builder="transformer", kwargs=dict(seq_len=128, dim=256, heads=4, ffn=1024, depth=6), batch=16, target=1.20
    ),
    "nested_resnet50v2": dict(builder="nested_resnet50v2", kwargs=dict(size=128), batch=8, target=1.20),
    "cnn": dict(builder="resnet_cnn", kwargs=dict(size=64, channels=32, blocks_per_stage=3, stages=3), batch=16, target=1.25),
}
FACTORS = (1.00, 1.05, 1.10, 1.20)


def _plans(fam, open_layers=False):
    """label -> (checkpoint_model kwargs, segments, estimated peak ratio,
    estimated recompute as a fraction of the forward time). With
    `open_layers`, the budget plans cut inside composite layers too (their
    budgets still from the default plan with layers whole)."""
    import families
    import graphckpt

    model = getattr(families, fam["builder"])(**fam["kwargs"])
    batch = fam["batch"]
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = graphckpt.plan(model, batch_size=batch)
        kwargs = {"default": {"batch_size": batch}}
        opened = {"open_layers": True} if open_layers else {}
        for f in FACTORS:
            kwargs[f"budget x{f:.2f} of default"] = {
                "batch_size": batch, "budget": int(default.estimated_peak_bytes * f), **opened
            }
        for label, kw in kwargs.items():
            p = graphckpt.plan(model, **kw)
            e = graphckpt.estimate(model, p, batch_size=batch)
            out[label] = (kw, len(p.segments), e.ratio, e.recompute_seconds / e.forward_seconds)
    return out


def run(name, fam, repeats, steps, warmup, open_layers=False):
    plans = _plans(fam, open_layers)
    specs = [("baseline", dict(method="baseline"))]
    specs += [(label, dict(method="graphckpt", checkpoint_kwargs=kw)) for label, (kw, *_) in plans.items()]
    print(f"== {name}: {fam['builder']}({fam['kwargs']}), batch {fam['batch']}", flush=True)
    runs = []
    for rnd in range(repeats):
        for label, spec in specs:
            m = measure(f"{FAMILIES_PY}:{fam['builder']}", batch_size=fam["batch"], builder_kwargs=fam["kwargs"],
                        label=label, steps=steps, warmup=warmup, check=False, **spec)
            runs.append(dict(m.to_dict(), round=rnd))
            msg = (f"peak {format_bytes(m.peak_bytes):>10} step {m.step_time_s:.3f} s cpu {m.step_cpu_s:.3f} s"
                   if m.ok else f"FAILED {m.error[:200]}")
            print(f"  [r{rnd}] {label:24s} {msg}", flush=True)
    rows = []
    for label, (kw, segs, est_ratio, recompute) in plans.items():
        ratios = {"peak": [], "time": [], "cpu": []}
        for rnd in range(repeats):
            base = [r for r in runs if r["round"] == rnd and r["label"] == "baseline" and r["ok"]]
            mine = [r for r in runs if r["round"] == rnd and r["label"] == label and r["ok"]]
            if base and mine:
                ratios["peak"].append(mine[0]["peak_bytes"] / base[0]["peak_bytes"])
                ratios["time"].append(mine[0]["step_time_s"] / base[0]["step_time_s"])
                ratios["cpu"].append(mine[0]["step_cpu_s"] / base[0]["step_cpu_s"])
        if not ratios["peak"]:
            continue
        row = dict(label=label, budget=kw.get("budget"), segments=segs, estimated_ratio=est_ratio,
                   estimated_recompute=recompute, **{f"{k}_ratio": statistics.median(v) for k, v in ratios.items()})
        rows.append(row)
        print(f"  {label:24s} {segs:2d} segments: estimated x{est_ratio:.3f}, recompute {recompute:.2f} of a forward; "
              f"measured x{row['peak_ratio']:.3f}, time x{row['time_ratio']:.2f}, CPU x{row['cpu_ratio']:.2f}", flush=True)
    return dict(family=name, builder=fam["builder"], kwargs=fam["kwargs"], batch=fam["batch"], target=fam["target"],
                rows=rows, runs=runs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="resnet50v2,transformer,cnn", help=f"of {', '.join(FAMILIES)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--open-layers", action="store_true", help="budget plans with open_layers=True")
    p.add_argument("--out", default=None, help="default: results/selective.json (selective_<families>.json for others)")
    args = p.parse_args(argv)
    if args.out is None:
        name = "" if args.families == "resnet50v2,transformer,cnn" else "_" + args.families.replace(",", "_")
        name += "_open" if args.open_layers else ""
        args.out = os.path.join(HERE, "results", f"selective{name}.json")
    t0 = time.time()
    results = [run(n, FAMILIES[n], args.repeats, args.steps, args.warmup, args.open_layers) for n in args.families.split(",")]
    with open(args.out, "w") as f:
        json.dump(dict(date=time.strftime("%Y-%m-%d"), results=results), f, indent=1)
    print(f"-> {args.out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
