"""Issue 14's measured acceptance on JAX and PyTorch (CPU), side by side
with each backend's native checkpointing.

For each backend and depth, a Dense chain (`depth` x Dense(1024, tanh),
then Dense(1); batch 256, SGD, MSE) is measured four ways, each run in a
fresh process, alternating round by round:

    (a) keras      the Keras model (benchmarks/families.py:dense_chain),
                   `graphckpt.measure(..., method="baseline")`
    (b) graphckpt  `graphckpt.checkpoint_model(model, batch_size=256)`, the
                   default plan at the step's batch size (what the fit flag
                   plans), `graphckpt.measure(..., method="graphckpt")`. On
                   PyTorch the estimator then counts the weight gradients
                   freed before the backward pass (`NodeCosts.freed`); on
                   JAX the plans are the same with and without the batch
    (b') graphckpt budget  PyTorch only: `checkpoint_model(model, budget=L,
                   batch_size=256)`, L the peak line below (0.40 at depth
                   32, 0.30 at 64): the plan of least recompute the
                   estimate fits in the line, for the time lines at the
                   memory the issue asks for
    (c) native     the same network in plain PyTorch (nn.Sequential,
                   torch.optim.SGD) or plain JAX (one jitted step),
                   benchmarks/native_peers.py
    (d) native ckpt  (c) through `checkpoint_sequential(model,
                   round(sqrt(depth)), x, use_reentrant=False)` on PyTorch,
                   `jax.checkpoint` on each of round(sqrt(depth)) groups of
                   layers on JAX

Every run reads memory with graphckpt's RSS counter in the environment
graphckpt's measuring child gets (MALLOC_MMAP_THRESHOLD_=65536; the peak
of a measured step above the RSS just before it; no forced GC). Ratios are
medians over rounds of the per-round ratio.

    python benchmarks/backends.py                         # torch and jax, depths 32 and 64, 3 rounds
    python benchmarks/backends.py --backends torch --depths 32 --repeats 1
    python benchmarks/backends.py --report-only           # the table from results/backends_*.json
    python benchmarks/backends.py --quick                 # tiny sizes, 1 round, to build/ (smoke)

Writes benchmarks/results/backends_<backend>.json (machine, versions, date,
every run), rewritten after every run.
"""

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from graphckpt.measure import measure  # noqa: E402
from native_peers import default_segments, measure_native  # noqa: E402
from run_all import _load_avg, machine_info  # noqa: E402

FAMILIES_PY = os.path.join(HERE, "families.py")
METHODS = ("keras", "graphckpt", "graphckpt budget", "native", "native ckpt")
NATIVE_NAME = {"torch": "checkpoint_sequential", "jax": "jax.checkpoint per group"}

# Issue 14's acceptance lines: (backend, depth) -> graphckpt peak ratio target,
# and whether graphckpt's ratio must be at or below (torch) / strictly below
# (jax) the native peer's.
PEAK_TARGETS = {("torch", 32): 0.40, ("jax", 32): 0.45, ("torch", 64): 0.30}
BUDGET_LINES = {k: v for k, v in PEAK_TARGETS.items() if k[0] == "torch"}
NATIVE_PEAK_LINE = {("torch", 32): "<=", ("jax", 32): "<"}
CPU_TARGET = 1.40
TORCH_NATIVE_TIME = 1.10


def methods_for(backend, depth):
    """The methods run for `backend` at `depth`: the budget plan where the
    issue has a PyTorch peak line."""
    return [m for m in METHODS if m != "graphckpt budget" or (backend, depth) in BUDGET_LINES]


def one_run(method, backend, depth, args):
    """One measurement in a fresh process, as a JSON-friendly dict."""
    t0 = time.time()
    if method in ("keras", "graphckpt", "graphckpt budget"):
        plan_kwargs = {"batch_size": args.batch}
        if method == "graphckpt budget":
            plan_kwargs["budget"] = BUDGET_LINES[(backend, depth)]
        m = measure(
            f"{FAMILIES_PY}:dense_chain",
            batch_size=args.batch,
            builder_kwargs=dict(depth=depth, width=args.width, outputs=1),
            method="baseline" if method == "keras" else "graphckpt",
            checkpoint_kwargs=None if method == "keras" else plan_kwargs,
            label=method,
            steps=args.steps,
            warmup=args.warmup,
            backend=backend,
            device="cpu",
            timeout=args.timeout,
            check=False,
        )
        d = m.to_dict()
    else:
        d = measure_native(
            backend,
            depth=depth,
            width=args.width,
            outputs=1,
            batch_size=args.batch,
            checkpoint=method == "native ckpt",
            steps=args.steps,
            warmup=args.warmup,
            timeout=args.timeout,
        )
        d["label"] = method
    d.update(method_label=method, backend=backend, depth=depth, wall_s=time.time() - t0, load_avg=_load_avg())
    return d


def _median_ratio(runs, num, den, key):
    """Median over rounds of num's `key` over den's, same round."""
    by = {}
    for r in runs:
        if r.get("ok") and r.get(key) is not None:
            by[(r["round"], r["method_label"])] = r[key]
    ratios = [by[(k, num)] / by[(k, den)] for k, m in by if m == num and (k, den) in by and by[(k, den)]]
    return statistics.median(ratios) if ratios else None


def _median(runs, method, key):
    vals = [r[key] for r in runs if r.get("ok") and r["method_label"] == method and r.get(key) is not None]
    return statistics.median(vals) if vals else None


def summarize(runs):
    """Per depth: median figures and ratios."""
    out = {}
    for depth in sorted({r["depth"] for r in runs}):
        rs = [r for r in runs if r["depth"] == depth]
        s = {
            "rounds": len({r["round"] for r in rs}),
            "peak_mib": {m: _mib(_median(rs, m, "peak_bytes")) for m in METHODS},
            "step_cpu_s": {m: _median(rs, m, "step_cpu_s") for m in METHODS},
            "step_time_s": {m: _median(rs, m, "step_time_s") for m in METHODS},
            "graphckpt_peak_ratio": _median_ratio(rs, "graphckpt", "keras", "peak_bytes"),
            "graphckpt_cpu_ratio": _median_ratio(rs, "graphckpt", "keras", "step_cpu_s"),
            "graphckpt_time_ratio": _median_ratio(rs, "graphckpt", "keras", "step_time_s"),
            "native_peak_ratio": _median_ratio(rs, "native ckpt", "native", "peak_bytes"),
            "native_cpu_ratio": _median_ratio(rs, "native ckpt", "native", "step_cpu_s"),
            "native_time_ratio": _median_ratio(rs, "native ckpt", "native", "step_time_s"),
            "graphckpt_vs_native_cpu": _median_ratio(rs, "graphckpt", "native ckpt", "step_cpu_s"),
            "graphckpt_vs_native_time": _median_ratio(rs, "graphckpt", "native ckpt", "step_time_s"),
            "graphckpt_vs_native_peak": _median_ratio(rs, "graphckpt", "native ckpt", "peak_bytes"),
            "keras_vs_native_cpu": _median_ratio(rs, "keras", "native", "step_cpu_s"),
            "budget_peak_ratio": _median_ratio(rs, "graphckpt budget", "keras", "peak_bytes"),
            "budget_cpu_ratio": _median_ratio(rs, "graphckpt budget", "keras", "step_cpu_s"),
            "budget_vs_native_cpu": _median_ratio(rs, "graphckpt budget", "native ckpt", "step_cpu_s"),
            "segments": {"graphckpt": _median(rs, "graphckpt", "num_segments"), "native": default_segments(depth)},
            "failures": [f"{r['method_label']} r{r['round']}: {r.get('error')}" for r in rs if not r.get("ok")],
        }
        out[str(depth)] = s
    return out


def _mib(b):
    return None if b is None else b / 2**20


def _x(v, digits=2):
    return "n/a" if v is None else f"x{v:.{digits}f}"


def verdicts(backend, depth, s):
    """(acceptance line, measured, met) for this backend and depth."""
    out = []
    g, n = s["graphckpt_peak_ratio"], s["native_peak_ratio"]
    if (backend, depth) in PEAK_TARGETS:
        t = PEAK_TARGETS[(backend, depth)]
        out.append((f"graphckpt peak ratio <= x{t:.2f}", _x(g, 3), g is not None and g <= t))
    if (backend, depth) in NATIVE_PEAK_LINE:
        op = NATIVE_PEAK_LINE[(backend, depth)]
        met = g is not None and n is not None and (g <= n if op == "<=" else g < n)
        out.append((f"graphckpt peak ratio {op} native {NATIVE_NAME[backend]}'s", f"{_x(g, 3)} vs {_x(n, 3)}", met))
    c = s["graphckpt_cpu_ratio"]
    out.append((f"CPU-time ratio <= x{CPU_TARGET:.2f}", _x(c, 3), c is not None and c <= CPU_TARGET))
    if backend == "torch":
        v = s["graphckpt_vs_native_cpu"]
        out.append(
            (f"step CPU time within 10% of {NATIVE_NAME[backend]}", _x(v, 3), v is not None and v <= TORCH_NATIVE_TIME)
        )
    if s.get("budget_peak_ratio") is not None:
        line = BUDGET_LINES[(backend, depth)]
        b, bc, bn = s["budget_peak_ratio"], s["budget_cpu_ratio"], s["budget_vs_native_cpu"]
        out.append((f"budget={line:.2f} plan: peak ratio <= x{line:.2f}", _x(b, 3), b <= line))
        out.append((f"budget={line:.2f} plan: CPU-time ratio <= x{CPU_TARGET:.2f}", _x(bc, 3), bc <= CPU_TARGET))
        out.append((f"budget={line:.2f} plan: step CPU time within 10% of {NATIVE_NAME[backend]}", _x(bn, 3),
                    bn <= TORCH_NATIVE_TIME))
    return out


def table(payloads):
    lines = [
        "| backend | depth | Keras peak MiB | graphckpt peak MiB | graphckpt / Keras peak | native peak MiB | "
        "native ckpt peak MiB | native ckpt / native peak | graphckpt / Keras CPU time | "
        "native ckpt / native CPU time | graphckpt / native ckpt CPU time | graphckpt / native ckpt wall time | "
        "Keras / native CPU time | segments (graphckpt, native) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in payloads:
        for depth, s in p["summary"].items():
            pk = s["peak_mib"]
            f = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
            seg = s["segments"]
            lines.append(
                f"| {p['backend']} | {depth} | {f(pk['keras'])} | {f(pk['graphckpt'])} | {_x(s['graphckpt_peak_ratio'])} | "
                f"{f(pk['native'])} | {f(pk['native ckpt'])} | {_x(s['native_peak_ratio'])} | "
                f"{_x(s['graphckpt_cpu_ratio'])} | {_x(s['native_cpu_ratio'])} | {_x(s['graphckpt_vs_native_cpu'])} | "
                f"{_x(s['graphckpt_vs_native_time'])} | {_x(s['keras_vs_native_cpu'])} | "
                f"{'n/a' if seg['graphckpt'] is None else int(seg['graphckpt'])}, {seg['native']} |"
            )
    return "\n".join(lines)


def budget_table(payloads):
    lines = [
        "| backend | depth | budget | peak MiB | / Keras peak | / Keras CPU time | / native ckpt CPU time | native ckpt / native peak |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in payloads:
        for depth, s in p["summary"].items():
            if s.get("budget_peak_ratio") is None:
                continue
            mib = s["peak_mib"].get("graphckpt budget")
            lines.append(
                f"| {p['backend']} | {depth} | {BUDGET_LINES[(p['backend'], int(depth))]:.2f} | {mib:.1f} | "
                f"{_x(s['budget_peak_ratio'], 3)} | {_x(s['budget_cpu_ratio'])} | {_x(s['budget_vs_native_cpu'])} | "
                f"{_x(s['native_peak_ratio'], 3)} |"
            )
    return "\n".join(lines)


def acceptance_table(payloads):
    lines = ["| backend | depth | acceptance line | measured | met? |", "|---|---:|---|---|---|"]
    for p in payloads:
        for depth, s in p["summary"].items():
            for line, measured, met in verdicts(p["backend"], int(depth), s):
                lines.append(f"| {p['backend']} | {depth} | {line} | {measured} | {'met' if met else '**missed**'} |")
    return "\n".join(lines)


def _versions(runs):
    for r in runs:
        info = r.get("info") or {}
        if r.get("ok") and info.get("keras"):
            return {k: info.get(k) for k in ("python", "backend", info.get("backend"), "keras", "numpy", "graphckpt",
                                              "graphckpt_source", "platform")}
    return {}


def run_backend(backend, args):
    path = os.path.join(args.out, f"backends_{backend}.json")
    payload = {
        "kind": "backends",
        "backend": backend,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "load_avg_start": _load_avg(),
        "command": "python benchmarks/backends.py " + " ".join(sys.argv[1:]),
        "settings": dict(batch_size=args.batch, width=args.width, outputs=1, depths=args.depths, repeats=args.repeats,
                         steps=args.steps, warmup=args.warmup, optimizer="sgd", loss="mse", device="cpu",
                         counter="rss", native_segments={d: default_segments(d) for d in args.depths}),
        "runs": [],
    }
    os.makedirs(args.out, exist_ok=True)
    for depth in args.depths:
        for rnd in range(args.repeats):
            for method in methods_for(backend, depth):
                d = one_run(method, backend, depth, args)
                d["round"] = rnd
                payload["runs"].append(d)
                if d.get("ok"):
                    msg = f"peak {d['peak_bytes'] / 2**20:8.1f} MiB  cpu {d['step_cpu_s']:6.3f} s  wall {d['step_time_s']:6.3f} s"
                else:
                    msg = f"FAILED: {str(d.get('error'))[:160]}"
                print(f"  [{backend} depth {depth} r{rnd}] {method:12s} {msg}  ({d['wall_s']:.0f} s)", flush=True)
                payload["versions"] = _versions(payload["runs"])
                payload["summary"] = summarize(payload["runs"])
                payload["load_avg_end"] = _load_avg()
                with open(path, "w") as f:
                    json.dump(payload, f, indent=1)
    print(f"  -> {path}", flush=True)
    return payload


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="torch,jax")
    p.add_argument("--depths", default="32,64")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results; build/bench-quick with --quick)")
    p.add_argument("--quick", action="store_true", help="depth 4, width 64, batch 32, 1 round, 1 step: a smoke run")
    p.add_argument("--report-only", action="store_true")
    a = p.parse_args(argv)
    a.backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    if any(b not in ("torch", "jax") for b in a.backends):
        p.error("--backends: torch and/or jax")
    a.depths = [int(d) for d in a.depths.split(",")]
    if a.quick:
        a.depths, a.width, a.batch, a.repeats, a.steps, a.warmup = [4], 64, 32, 1, 1, 1
    a.out = a.out or (os.path.join(ROOT, "build", "bench-quick") if a.quick else os.path.join(HERE, "results"))
    return a


def main(argv=None):
    args = parse(argv)
    payloads = []
    for backend in args.backends:
        if args.report_only:
            with open(os.path.join(args.out, f"backends_{backend}.json")) as f:
                payloads.append(json.load(f))
        else:
            payloads.append(run_backend(backend, args))
    print(table(payloads))
    print()
    print(budget_table(payloads))
    print()
    print(acceptance_table(payloads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
