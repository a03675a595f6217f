"""Runs the graphckpt benchmark suite and writes its results.

Every figure is measured by `graphckpt.measure` in a fresh process: the peak
training-step memory above the resident state (TensorFlow: BFC allocator
statistics; JAX and PyTorch on the CPU: the process RSS high-water mark;
any backend on a GPU: the device allocator) and the
median step time after warm-up. For each model family, all methods are
measured in ONE run, interleaved round by round (baseline, method 1, method
2, ..., then again), so slow drift on a shared machine hits every method
alike; ratios are medians over rounds of the per-round ratio to that round's
baseline.

Usage:
    python benchmarks/run_all.py                       # everything (~1-2 h on 2 cores)
    python benchmarks/run_all.py --quick               # small sizes, 1 round (minutes)
    python benchmarks/run_all.py --families dense,unet --repeats 5
    python benchmarks/run_all.py --report-only         # re-render docs from results/
    python benchmarks/run_all.py --backend torch --families dense   # results/torch/

Writes `benchmarks/results/<family>.json` (raw measurements, machine,
versions, date), then `docs/benchmarks.md` and `docs/img/*.png` (see
`report.py`). `--quick` writes under `build/bench-quick/` (git-ignored) and
leaves the docs alone.
"""

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from graphckpt.measure import format_bytes, measure  # noqa: E402
from report import summarize  # noqa: E402

FAMILIES_PY = os.path.join(HERE, "families.py")
METHODS_PY = os.path.join(HERE, "methods.py")
RESULTS = os.path.join(HERE, "results")

# name -> builder, full and quick sizes, batch sizes, and the targets
# (graphckpt default plan vs baseline: peak ratio, time ratio, strict "<").
FAMILIES = {
    "dense": dict(
        title="Dense chain: 64 x Dense(1024, tanh), Dropout(0.1) after every 8th",
        builder="dense_chain",
        kwargs=dict(depth=64, width=1024, dropout_every=8),
        batch=256,
        quick=dict(kwargs=dict(depth=16, width=256, dropout_every=8), batch=128),
        target=(0.35, 1.40, False),
    ),
    "resnet_cnn": dict(
        title="ResNet-style CNN: 3 stages x 3 residual blocks with BatchNorm, 64x64 input",
        builder="resnet_cnn",
        kwargs=dict(size=64, channels=32, blocks_per_stage=3, stages=3),
        batch=16,
        quick=dict(kwargs=dict(size=32, channels=8, blocks_per_stage=2, stages=2), batch=8),
        target=(0.50, 1.40, False),
    ),
    "transformer": dict(
        title="Transformer encoder: 6 blocks, 128 tokens, dim 256, 4 heads, FFN 1024, Dropout 0.1",
        builder="transformer",
        kwargs=dict(seq_len=128, dim=256, heads=4, ffn=1024, depth=6),
        batch=16,
        quick=dict(kwargs=dict(seq_len=32, dim=64, heads=2, ffn=128, depth=3), batch=8),
        target=(0.50, 1.40, False),
    ),
    "unet": dict(
        title="U-Net: 4 levels, 16 base channels, long skips, 128x128 input",
        builder="unet",
        kwargs=dict(size=128, channels=16, levels=4),
        batch=8,
        quick=dict(kwargs=dict(size=32, channels=4, levels=3), batch=4),
        target=(0.65, 1.40, False),
    ),
    "resnet50v2": dict(
        title="keras.applications.ResNet50V2, weights=None, 128x128",
        builder="resnet50v2",
        kwargs=dict(size=128),
        batch=8,
        quick=dict(kwargs=dict(size=32), batch=2),
        target=(0.60, 1.45, True),
    ),
    "nested_resnet50v2": dict(
        title="ResNet50V2 backbone called as one layer (transfer-learning pattern), weights=None, 128x128",
        builder="nested_resnet50v2",
        kwargs=dict(size=128),
        batch=8,
        quick=dict(kwargs=dict(size=32), batch=2),
        target=(0.40, 1.45, False),
    ),
    "densenet121": dict(
        title="keras.applications.DenseNet121, weights=None, 128x128",
        builder="densenet121",
        kwargs=dict(size=128),
        batch=8,
        quick=dict(kwargs=dict(size=32), batch=2),
        target=(0.60, 1.45, True),
    ),
}

# The acceptance run: baseline vs default plan only, more rounds.
ACCEPTANCE = dict(
    title="Acceptance: 64 x Dense(1024, tanh), no Dropout",
    builder="dense_chain",
    kwargs=dict(depth=64, width=1024),
    batch=512,
    quick=dict(kwargs=dict(depth=16, width=256), batch=128),
    target=(0.35, 1.40, False),
)

SCALING = dict(
    title="Scaling: peak memory vs depth, Dense(1024, tanh) chain",
    builder="dense_chain",
    depths=[16, 32, 64, 128, 256],
    kwargs=dict(width=1024),
    batch=256,
    quick=dict(depths=[8, 16, 32, 64], kwargs=dict(width=128), batch=64),
)

SPECIAL = ("acceptance", "scaling")


def method_specs(budgets=(), batch_size=None):
    """(label, measure kwargs) for every method compared, baseline first.

    graphckpt plans beyond the default are added when `checkpoint_model`
    accepts them: `budget=` fractions (estimated for `batch_size`) and
    `policy="save_expensive"`.
    """
    import graphckpt

    m = METHODS_PY
    specs = [
        ("baseline", dict(method="baseline")),
        ("RematScope full", dict(method=f"{m}:remat_scope", method_kwargs={"mode": "full"})),
        ("RematScope activations", dict(method=f"{m}:remat_scope", method_kwargs={"mode": "activations"})),
        ("RematScope larger_than", dict(method=f"{m}:remat_scope", method_kwargs={"mode": "larger_than"})),
        ("RematScope list_of_layers", dict(method=f"{m}:remat_scope", method_kwargs={"mode": "list_of_layers"})),
        ("whole-model keras.remat", dict(method=f"{m}:whole_remat")),
        ("equal segments (sqrt)", dict(method=f"{m}:equal_segments")),
        ("graphckpt default", dict(method="graphckpt")),
    ]
    params = inspect.signature(graphckpt.checkpoint_model).parameters
    sized = {"batch_size": batch_size} if batch_size and "batch_size" in params else {}
    if "budget" in params:
        for b in budgets:
            if b in ("sqrt", "auto", "min"):
                spec = dict(method=f"{m}:graphckpt_budget", method_kwargs={"budget": b, "batch_size": batch_size})
            else:
                spec = dict(method="graphckpt", checkpoint_kwargs={"budget": float(b), **sized})
            specs.append((f"graphckpt budget={b}", spec))
    if "policy" in params:
        specs.append(
            ("graphckpt save_expensive", dict(method="graphckpt", checkpoint_kwargs={"policy": "save_expensive", **sized}))
        )
    return specs


def machine_info():
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu_model"] = names[0] if names else None
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
    except OSError:
        pass
    return info


def _load_avg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def run_rounds(name, fam, specs, args, batch, kwargs):
    """All methods, interleaved, `args.repeats` rounds. A method that fails
    is recorded once and not retried (its failures are deterministic)."""
    runs, failed = [], set()
    builder = f"{FAMILIES_PY}:{fam['builder']}"
    for rnd in range(args.repeats):
        for label, spec in specs:
            if label in failed:
                continue
            t0 = time.time()
            m = measure(
                builder,
                batch_size=batch,
                builder_kwargs=kwargs,
                label=label,
                steps=args.steps,
                warmup=args.warmup,
                jit_compile=args.jit_compile,
                backend=args.backend,
                timeout=args.timeout,
                check=False,
                **spec,
            )
            d = m.to_dict()
            d["round"] = rnd
            d["load_avg"] = _load_avg()
            runs.append(d)
            if m.ok:
                msg = f"peak {format_bytes(m.peak_bytes):>10}  step {m.step_time_s:7.3f} s  segs {m.num_segments}"
            else:
                failed.add(label)
                msg = f"FAILED ({m.phase}): {m.error[:110]}"
            print(f"  [{name} r{rnd}] {label:28s} {msg}  ({time.time() - t0:.0f} s)", flush=True)
    return runs


def save(name, payload, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    return path


def header(args, kind):
    return {
        "kind": kind,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "load_avg_start": _load_avg(),
        "settings": {
            "backend": args.backend,
            "quick": args.quick,
            "repeats": args.repeats,
            "steps": args.steps,
            "warmup": args.warmup,
            "jit_compile": args.jit_compile,
            "optimizer": "sgd",
            "loss": "mse",
        },
    }


def run_family(name, args):
    fam = FAMILIES[name] if name in FAMILIES else ACCEPTANCE
    size = fam["quick"] if args.quick else fam
    batch = args.batch or size["batch"]
    specs = method_specs(args.budgets, batch)
    if name == "acceptance":
        specs = [s for s in specs if s[0] in ("baseline", "graphckpt default")]
    elif args.methods:
        keep = {m.strip() for m in args.methods.split(",")} | {"baseline"}
        specs = [s for s in specs if s[0] in keep]
    title = fam["title"] + (f" [quick sizes: {size['kwargs']}]" if args.quick else "")
    print(f"== {name}: {title} (batch {batch})", flush=True)
    runs = run_rounds(name, fam, specs, args, batch, size["kwargs"])
    summary = summarize(runs)
    payload = header(args, "acceptance" if name == "acceptance" else "family")
    payload.update(
        family=name,
        title=title,
        builder=fam["builder"],
        builder_kwargs=size["kwargs"],
        batch_size=batch,
        target=dict(zip(("peak_ratio", "time_ratio", "strict_peak"), fam["target"])),
        versions=_versions_of(runs),
        load_avg_end=_load_avg(),
        summary=summary,
        runs=runs,
    )
    print(f"  -> {save(name, payload, args.out)}", flush=True)
    return payload


def run_scaling(args):
    size = SCALING["quick"] if args.quick else SCALING
    batch = args.batch or size["batch"]
    print(f"== scaling: {SCALING['title']} (batch {batch})", flush=True)
    specs = [("baseline", dict(method="baseline")), ("graphckpt default", dict(method="graphckpt"))]
    runs = []
    for depth in size["depths"]:
        kwargs = dict(size["kwargs"], depth=depth)
        for r in run_rounds(f"depth {depth}", SCALING, specs, args, batch, kwargs):
            r["depth"] = depth
            runs.append(r)
    fits = {}
    for label, _ in specs:
        pts = {}
        for r in runs:
            if r["label"] == label and r["ok"]:
                pts.setdefault(r["depth"], []).append(r["peak_bytes"])
        xs = sorted(pts)
        ys = [statistics.median(pts[x]) for x in xs]
        fits[label] = {"depths": xs, "peak_bytes": ys, "exponent": fit_exponent(xs, ys)}
        print(f"  {label}: exponent {fits[label]['exponent']}", flush=True)
    payload = header(args, "scaling")
    payload.update(
        title=SCALING["title"],
        builder=SCALING["builder"],
        builder_kwargs=size["kwargs"],
        batch_size=batch,
        versions=_versions_of(runs),
        load_avg_end=_load_avg(),
        fits=fits,
        runs=runs,
    )
    print(f"  -> {save('scaling', payload, args.out)}", flush=True)
    return payload


def fit_exponent(xs, ys):
    """Least-squares slope of log(y) against log(x)."""
    import math

    if len(xs) < 2:
        return None
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def _versions_of(runs):
    for r in runs:
        backend = r.get("info", {}).get("backend", "tensorflow")
        if r.get("info", {}).get(backend):
            keys = ("python", "backend", backend, "keras", "numpy", "graphckpt", "platform")
            return {k: r["info"].get(k) for k in keys}
    return {}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = list(FAMILIES) + list(SPECIAL)
    p.add_argument("--families", default=",".join(names), help=f"comma-separated subset of {names}")
    p.add_argument("--methods", default=None, help="comma-separated method labels to keep (baseline always runs)")
    p.add_argument("--quick", action="store_true", help="small sizes, 1 round, 2 steps: a smoke run")
    p.add_argument("--repeats", type=int, default=None, help="rounds per family (default 3; acceptance 5)")
    p.add_argument("--steps", type=int, default=None, help="measured steps per run (default 4)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per run (default 2)")
    p.add_argument("--batch", type=int, default=None, help="override every family's batch size")
    p.add_argument(
        "--budgets",
        default="sqrt,min,0.5",
        help="graphckpt budget plans, if supported: 'sqrt' (the default plan's estimated peak), 'min' (the "
        "smallest estimated peak), or fractions of the estimated baseline",
    )
    p.add_argument("--jit-compile", action="store_true", help="compile train steps with XLA")
    p.add_argument(
        "--backend",
        choices=("tensorflow", "jax", "torch"),
        default=os.environ.get("KERAS_BACKEND", "tensorflow"),
        help="Keras backend of the measured processes (default: KERAS_BACKEND); JAX and PyTorch results "
        "go to results/<backend>/, and the docs are rendered from TensorFlow's only",
    )
    p.add_argument("--timeout", type=int, default=1800, help="seconds per measurement")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results; build/bench-quick with --quick)")
    p.add_argument("--report-only", action="store_true", help="only re-render docs from the results folder")
    p.add_argument("--no-report", action="store_true", help="do not render docs/benchmarks.md and plots")
    args = p.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in args.families if f not in names]
    if unknown:
        p.error(f"unknown families {unknown}; choose from {names}")
    if args.out is None:
        # Quick results go to build/ (git-ignored), never over the real ones.
        args.out = os.path.join(ROOT, "build", "bench-quick") if args.quick else RESULTS
        if args.backend != "tensorflow":
            args.out = os.path.join(args.out, args.backend)
    args.budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    return args


def main(argv=None):
    args = parse(argv)
    import report

    if not args.report_only:
        user_repeats = args.repeats
        args.steps = args.steps or (2 if args.quick else 4)
        args.warmup = args.warmup or (1 if args.quick else 2)
        t0 = time.time()
        for name in args.families:
            args.repeats = user_repeats or (1 if args.quick else 3)
            if name == "scaling":
                args.repeats = user_repeats or 1  # memory is deterministic to the byte here
                run_scaling(args)
            elif name == "acceptance":
                args.repeats = user_repeats or (1 if args.quick else 5)
                run_family("acceptance", args)
            else:
                run_family(name, args)
        print(f"done in {time.time() - t0:.0f} s", flush=True)
    results = report.load(args.out)
    print(report.text_tables(results))
    if not args.no_report and not args.quick and args.backend == "tensorflow":
        for path in report.write_docs(results, ROOT):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
