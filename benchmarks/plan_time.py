"""Planning time: CPU seconds of `graphckpt.plan(model, ...)` on large graphs
(issue 15, part 4), for the default plan, the sqrt plan and budget plans.

The model is built first; only the `graphckpt.plan` call is timed, in CPU
time (`time.process_time`, so other work on a loaded machine does not count),
the median of `--repeats` calls. Each row also counts how many times the
memory model's span tables were built during one call.

    python benchmarks/plan_time.py [--models nasnetlarge dense_chain_2000] [--repeats 3] [--json PATH]

Run it with another checkout first on `PYTHONPATH` (and `--no-count`, if
that checkout predates the memory model) to time an older planner on the
same models.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if not os.environ.get("PLAN_TIME_KEEP_PATH"):
    sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.setrecursionlimit(10000)

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402

import families  # noqa: E402
import graphckpt  # noqa: E402

MODELS = {
    "nasnetlarge": ("keras.applications.NASNetLarge(weights=None)", lambda: keras.applications.NASNetLarge(weights=None)),
    "dense_chain_2000": (
        "2000 x Dense(64, tanh), then Dense(10) (benchmarks/families.py:dense_chain)",
        lambda: families.dense_chain(depth=2000, width=64),
    ),
    "densenet121": (
        "keras.applications.DenseNet121(weights=None)",
        lambda: keras.applications.DenseNet121(weights=None),
    ),
}

CALLS = {
    "default": {},
    "sqrt": {"segments": "sqrt"},
    "budget_0.5": {"budget": 0.5},
    "budget_0.3": {"budget": 0.3},
}


def _count_spans():
    """A list that grows by one each time a memory model is built."""
    from graphckpt.planner import memory

    built = []
    original = memory.MemoryModel.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        original(self, *args, **kwargs)

    memory.MemoryModel.__init__ = counting
    return built


def _time_call(model, kwargs, repeats, built):
    times, count = [], None
    for _ in range(repeats):
        if built is not None:
            built.clear()
        start = time.process_time()
        try:
            plan = graphckpt.plan(model, **kwargs)
        except graphckpt.InfeasibleBudgetError as e:
            plan, error = None, str(e)
        else:
            error = None
        times.append(time.process_time() - start)
        count = None if built is None else len(built)
    row = {"cpu_seconds": round(statistics.median(times), 3), "all_cpu_seconds": [round(t, 3) for t in times]}
    if plan is not None:
        row.update(
            segments=len(plan.segments),
            recomputed=sum(s.remat for s in plan.segments),
            boundaries=list(plan.boundaries),
            estimated_peak_bytes=plan.estimated_peak_bytes,
            baseline_peak_bytes=plan.baseline_peak_bytes,
        )
    else:
        row["error"] = error
    if count is not None:
        row["memory_models_built"] = count
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=["nasnetlarge", "dense_chain_2000"], choices=sorted(MODELS))
    p.add_argument("--calls", nargs="*", default=["default", "sqrt", "budget_0.5"], choices=sorted(CALLS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-count", action="store_true", help="don't count memory-model builds (older checkouts)")
    p.add_argument("--label", default="graphckpt " + graphckpt.__version__)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    built = None if args.no_count else _count_spans()
    rows = []
    for name in args.models:
        title, build = MODELS[name]
        model = build()
        for call in args.calls:
            row = {"model": name, "title": title, "call": call, "kwargs": CALLS[call]}
            row.update(_time_call(model, CALLS[call], args.repeats, built))
            row["layer_calls"] = len(graphckpt.plan(model, segments=1).order)
            rows.append(row)
            print(
                f"{name:18s} {call:11s} {row['cpu_seconds']:8.2f} s CPU  "
                f"{row.get('segments', '-')} segments, {row.get('recomputed', '-')} recomputed"
                + (f", {row['memory_models_built']} memory model(s)" if "memory_models_built" in row else ""),
                flush=True,
            )
        del model
        keras.backend.clear_session()
    payload = {
        "kind": "plan_time",
        "label": args.label,
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "graphckpt": os.path.dirname(graphckpt.__file__),
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()},
        "load_avg": list(os.getloadavg()),
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    return payload


if __name__ == "__main__":
    main()
