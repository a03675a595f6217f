"""Estimator calibration and budget-plan benchmark (issue 4).

For each benchmark family (benchmarks/families.py, the sizes of run_all.py):
- estimated vs measured peak training-step memory for the baseline, the
  default sqrt plan, budget plans and the `save_expensive` policy;
- measured peak under each budget plan vs the budget;
- for the ResNet-style CNN and the U-Net, a budget plan against sqrt,
  alternating runs, for peak and step-time ratios.

Every measurement runs in a fresh subprocess (`graphckpt.measure`, BFC
allocator statistics on CPU). Results: benchmarks/results/calibration.json;
`--markdown` prints the tables used in docs/estimator.md.

Usage:
    python benchmarks/calibrate.py                  # everything (~1 hour on 2 cores)
    python benchmarks/calibrate.py --families unet resnet_cnn --no-compare
    python benchmarks/calibrate.py --markdown       # tables from the saved JSON
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import families  # noqa: E402
import graphckpt  # noqa: E402
from graphckpt.measure import measure  # noqa: E402
from run_all import FAMILIES  # noqa: E402

RESULTS = os.path.join(HERE, "results", "calibration.json")
FAMILIES_PY = os.path.join(HERE, "families.py")
COMPARE = ("resnet_cnn", "unet")


def _plan_kwargs(name, model, batch):
    """The plans measured for one family: name -> checkpoint_model kwargs."""
    sqrt = graphckpt.plan(model, batch_size=batch, segments="sqrt")
    smallest = graphckpt.estimate(model, sqrt, batch_size=batch).smallest_peak_bytes
    base = sqrt.baseline_peak_bytes
    plans = {"sqrt": {"segments": "sqrt"}, "auto": {}}  # auto: the default plan
    # A budget at sqrt's own estimate (least recompute for that memory), and
    # tighter ones: halfway to the smallest achievable estimate, and that.
    levels = {
        "budget@sqrt": sqrt.estimated_peak_bytes,
        "budget@mid": (sqrt.estimated_peak_bytes + smallest) // 2,
        "budget@min": smallest,
    }
    for label, value in levels.items():
        if smallest <= value < base:
            plans[label] = {"budget": int(value)}
    plans["policy"] = {"policy": "save_expensive"}
    return plans


def _estimate(model, kwargs, batch):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = graphckpt.plan(model, batch_size=batch, **kwargs)
    return p


def run_family(name, args):
    import keras

    fam = FAMILIES[name]
    kwargs, batch = fam["kwargs"], fam["batch"]
    if args.quick:
        kwargs, batch = fam["quick"]["kwargs"], fam["quick"]["batch"]
    builder = f"{FAMILIES_PY}:{fam['builder']}"
    model = getattr(families, fam["builder"])(**kwargs)
    rows = []
    base_est = graphckpt.estimate(model, batch_size=batch)
    base = measure(builder, batch_size=batch, builder_kwargs=kwargs, steps=args.steps, warmup=2, check=False)
    rows.append(_row(name, "baseline", {}, base_est.peak_bytes, base, None, base_est.recompute_flops, base_est))
    print(_line(rows[-1]), flush=True)
    for label, ck in _plan_kwargs(name, model, batch).items():
        p = _estimate(model, ck, batch)
        est = graphckpt.estimate(model, p, batch_size=batch)
        m = measure(
            builder,
            batch_size=batch,
            builder_kwargs=kwargs,
            method="graphckpt",
            checkpoint_kwargs=dict(ck, batch_size=batch),
            label=label,
            steps=args.steps,
            warmup=2,
            check=False,
        )
        rows.append(_row(name, label, ck, p.estimated_peak_bytes, m, p, est.recompute_flops, est))
        print(_line(rows[-1]), flush=True)
        keras.backend.clear_session()
    return rows


def _peak(m):
    """The measured peak of a run: the median of its steps' peaks. On 2
    shared cores TensorFlow's executor sometimes runs a recompute early, in
    parallel, and one step in ten or so peaks far higher (e.g. 72 MiB
    against 26-32 MiB for the other steps of the same model); the median is
    what a step costs, the maximum (also recorded) is that spike."""
    return statistics.median(m.step_peak_bytes) if m.ok else None


def _row(family, label, ck, est, m, plan, recompute_flops, estimate):
    measured = _peak(m)
    return {
        "family": family,
        "method": label,
        "checkpoint_kwargs": ck,
        "batch_size": m.batch_size,
        "estimated_peak_bytes": int(est),
        "measured_peak_bytes": measured,
        "measured_max_step_peak_bytes": m.peak_bytes,
        "error": (est - measured) / measured if measured else None,
        "budget_bytes": ck.get("budget"),
        "measured_over_budget": measured / ck["budget"] if measured and ck.get("budget") else None,
        "step_time_s": m.step_time_s,
        "segments": None if plan is None else len(plan.segments),
        "recomputed_segments": None if plan is None else sum(s.remat for s in plan.segments),
        "recompute_flops": recompute_flops,
        "forward_flops": estimate.forward_flops,
        "ok": m.ok,
        "error_message": m.error,
    }


def _line(r):
    mb = lambda x: "-" if x is None else f"{x / 2**20:8.1f}"  # noqa: E731
    err = "-" if r["error"] is None else f"{100 * r['error']:+6.1f}%"
    extra = f"  measured/budget {r['measured_over_budget']:.2f}" if r["measured_over_budget"] else ""
    t = "-" if r["step_time_s"] is None else f"{r['step_time_s']:.3f}s"
    return f"{r['family']:12s} {r['method']:15s} est {mb(r['estimated_peak_bytes'])} MiB  measured {mb(r['measured_peak_bytes'])} MiB  {err}  {t}{extra}"


def compare_budget_vs_sqrt(name, args, rows):
    """Alternating sqrt / budget runs: median peak and step-time ratios."""
    fam = FAMILIES[name]
    kwargs, batch = fam["kwargs"], fam["batch"]
    if args.quick:
        kwargs, batch = fam["quick"]["kwargs"], fam["quick"]["batch"]
    builder = f"{FAMILIES_PY}:{fam['builder']}"
    out = {}
    budgets = [r for r in rows if r["family"] == name and r["method"].startswith("budget") and r["ok"]]
    for r in budgets:
        runs = {"baseline": [], "sqrt": [], r["method"]: []}
        for _ in range(args.repeats):
            for label, ck in (("baseline", None), ("sqrt", {"segments": "sqrt"}), (r["method"], r["checkpoint_kwargs"])):
                m = measure(
                    builder,
                    batch_size=batch,
                    builder_kwargs=kwargs,
                    method="baseline" if ck is None else "graphckpt",
                    checkpoint_kwargs=None if ck is None else dict(ck, batch_size=batch),
                    label=label,
                    steps=args.steps,
                    warmup=2,
                )
                runs[label].append(m)
        med = {k: (statistics.median(_peak(x) for x in v), statistics.median(x.step_time_s for x in v)) for k, v in runs.items()}
        b = med["baseline"]
        out[r["method"]] = {
            "budget_bytes": r["budget_bytes"],
            "repeats": args.repeats,
            "sqrt": {"peak_bytes": med["sqrt"][0], "peak_ratio": med["sqrt"][0] / b[0], "time_ratio": med["sqrt"][1] / b[1]},
            "budget": {
                "peak_bytes": med[r["method"]][0],
                "peak_ratio": med[r["method"]][0] / b[0],
                "time_ratio": med[r["method"]][1] / b[1],
            },
            "baseline": {"peak_bytes": b[0], "step_time_s": b[1]},
        }
        c = out[r["method"]]
        print(
            f"{name:12s} {r['method']:15s} sqrt: peak x{c['sqrt']['peak_ratio']:.2f} time x{c['sqrt']['time_ratio']:.2f} | "
            f"budget: peak x{c['budget']['peak_ratio']:.2f} time x{c['budget']['time_ratio']:.2f}",
            flush=True,
        )
    return out


def compare_policy(name, args):
    """Alternating baseline / save_expensive policy / sqrt runs: median peak
    and step-time ratios against the baseline."""
    fam = FAMILIES[name]
    kwargs, batch = fam["kwargs"], fam["batch"]
    if args.quick:
        kwargs, batch = fam["quick"]["kwargs"], fam["quick"]["batch"]
    builder = f"{FAMILIES_PY}:{fam['builder']}"
    runs = {"baseline": [], "policy": [], "sqrt": []}
    for _ in range(args.repeats):
        for label, ck in (("baseline", None), ("policy", {"policy": "save_expensive"}), ("sqrt", {"segments": "sqrt"})):
            runs[label].append(
                measure(
                    builder,
                    batch_size=batch,
                    builder_kwargs=kwargs,
                    method="baseline" if ck is None else "graphckpt",
                    checkpoint_kwargs=None if ck is None else dict(ck, batch_size=batch),
                    label=label,
                    steps=args.steps,
                    warmup=2,
                )
            )
    med = {k: (statistics.median(_peak(x) for x in v), statistics.median(x.step_time_s for x in v)) for k, v in runs.items()}
    b = med["baseline"]
    out = {k: {"peak_ratio": v[0] / b[0], "time_ratio": v[1] / b[1], "peak_bytes": v[0]} for k, v in med.items()}
    out["repeats"] = args.repeats
    print(
        f"{name:12s} policy: peak x{out['policy']['peak_ratio']:.2f} time x{out['policy']['time_ratio']:.2f} | "
        f"sqrt: peak x{out['sqrt']['peak_ratio']:.2f} time x{out['sqrt']['time_ratio']:.2f}",
        flush=True,
    )
    return out


def markdown(data):
    lines = [
        "| family | method | estimated (MiB) | measured (MiB) | error | measured / budget |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        mb = lambda x: "-" if x is None else f"{x / 2**20:.1f}"  # noqa: E731
        err = "failed" if r["error"] is None else f"{100 * r['error']:+.0f}%"
        over = "-" if r["measured_over_budget"] is None else f"{r['measured_over_budget']:.2f}"
        lines.append(f"| {r['family']} | {r['method']} | {mb(r['estimated_peak_bytes'])} | {mb(r['measured_peak_bytes'])} | {err} | {over} |")
    if data.get("compare"):
        lines += [
            "",
            "| family | budget plan | sqrt peak | sqrt time | budget peak | budget time |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for fam, by in data["compare"].items():
            for label, c in by.items():
                lines.append(
                    f"| {fam} | {label} | x{c['sqrt']['peak_ratio']:.2f} | x{c['sqrt']['time_ratio']:.2f} "
                    f"| x{c['budget']['peak_ratio']:.2f} | x{c['budget']['time_ratio']:.2f} |"
                )
    if data.get("policy"):
        lines += [
            "",
            "| family | save_expensive peak | save_expensive time | sqrt peak | sqrt time |",
            "|---|---:|---:|---:|---:|",
        ]
        for fam, c in data["policy"].items():
            lines.append(
                f"| {fam} | x{c['policy']['peak_ratio']:.2f} | x{c['policy']['time_ratio']:.2f} "
                f"| x{c['sqrt']['peak_ratio']:.2f} | x{c['sqrt']['time_ratio']:.2f} |"
            )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", nargs="*", default=list(FAMILIES))
    p.add_argument("--quick", action="store_true", help="the small sizes of run_all.py")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-compare", action="store_true")
    p.add_argument("--policy-only", action="store_true", help="only the policy vs sqrt vs baseline comparison")
    p.add_argument("--markdown", action="store_true", help="print tables from the saved results")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    if args.markdown:
        with open(args.out) as f:
            print(markdown(json.load(f)))
        return 0
    data = {"rows": [], "compare": {}}
    if os.path.exists(args.out):
        with open(args.out) as f:
            data = json.load(f)
    if args.policy_only:
        data.setdefault("policy", {})
        for name in args.families:
            data["policy"][name] = compare_policy(name, args)
            with open(args.out, "w") as f:
                json.dump(data, f, indent=1)
        print(markdown(data))
        return 0
    for name in args.families:
        data["rows"] = [r for r in data["rows"] if r["family"] != name]
        rows = run_family(name, args)
        data["rows"] += rows
        if name in COMPARE and not args.no_compare:
            data["compare"][name] = compare_budget_vs_sqrt(name, args, rows)
        import keras
        import tensorflow as tf

        data["info"] = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": platform.platform(),
            "cpus": os.cpu_count(),
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "quick": args.quick,
            "steps": args.steps,
        }
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
