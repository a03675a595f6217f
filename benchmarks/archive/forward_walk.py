"""A recomputed segment's forward pass on PyTorch: what it holds.

Keras's functional walk keeps every layer output until the call returns, so
before commit 015b2e7 a recomputed segment's forward pass held its whole
interior at once on an eager backend; graphckpt now drops each output after
its last reader (`graphckpt.keras_compat.run_freeing_dead_tensors`).

The Dense chain of issue 14 (`depth` x Dense(1024, tanh), then Dense(1);
batch 256, SGD, MSE), PyTorch on the CPU, memory by process RSS
(`graphckpt.measure`, each run in a fresh process), methods alternating,
medians of per-round ratios to the Keras baseline:

    keras        the model as it is
    default      graphckpt.checkpoint_model(model)
    1 segment    graphckpt.checkpoint_model(model, segments=1)
    sqrt         graphckpt.checkpoint_model(model, segments="sqrt")

    PYTHONPATH=. .venv/bin/python benchmarks/archive/forward_walk.py [--depth 32] [--repeats 3] [--out FILE]

To measure the code before the change, run the same command from a checkout
of the commit before it (the measuring children import the graphckpt of the
working directory).
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above archive/
sys.path.insert(0, os.getcwd())

from graphckpt.measure import measure  # noqa: E402

FAMILIES_PY = os.path.join(HERE, "families.py")
METHODS = {
    "keras": dict(method="baseline"),
    "default": dict(method="graphckpt"),
    "1 segment": dict(method="graphckpt", checkpoint_kwargs={"segments": 1}),
    "sqrt": dict(method="graphckpt", checkpoint_kwargs={"segments": "sqrt"}),
}


def compare(methods, depth, repeats, out=None):
    """Each of `methods` (label -> `measure` keyword arguments) on the Dense
    chain of `depth` layers, alternating over `repeats` rounds; prints and
    returns the medians of per-round ratios to the "keras" method's."""
    builder_kwargs = dict(depth=depth, width=1024, outputs=1)
    runs = {label: [] for label in methods}
    for r in range(repeats):
        for label, kw in methods.items():
            rec = measure(FAMILIES_PY + ":dense_chain", builder_kwargs=builder_kwargs, batch_size=256, steps=4,
                          warmup=2, backend="torch", **kw)
            runs[label].append(dict(peak_mib=rec.peak_bytes / 2**20, cpu_s=rec.step_cpu_s, segments=rec.num_segments))
            print(f"[r{r}] {label:16s} peak {rec.peak_bytes / 2**20:6.1f} MiB  cpu {rec.step_cpu_s:.3f} s"
                  f"  segments {rec.num_segments}", flush=True)
    print(f"PyTorch, {depth} x Dense(1024), batch 256, {repeats} rounds (median of per-round ratios):")
    rows = {}
    for label, rs in runs.items():
        peak = statistics.median(a["peak_mib"] / b["peak_mib"] for a, b in zip(rs, runs["keras"]))
        cpu = statistics.median(a["cpu_s"] / b["cpu_s"] for a, b in zip(rs, runs["keras"]))
        rows[label] = dict(peak_ratio=peak, cpu_ratio=cpu, peak_mib=statistics.median(a["peak_mib"] for a in rs),
                           segments=statistics.median(a["segments"] for a in rs))
        print(f"  {label:16s} {rows[label]['peak_mib']:6.1f} MiB  x{peak:.3f}  CPU x{cpu:.2f}")
    if out:
        with open(out, "w") as f:
            json.dump(dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), depth=depth,
                           cwd=os.getcwd(), runs=runs, ratios=rows), f, indent=1)
    return rows


def main(methods=lambda depth: METHODS, doc=__doc__):
    """The command line: `--depth`, `--repeats`, `--out`; `methods(depth)`
    gives the methods to compare."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    compare(methods(args.depth), args.depth, args.repeats, args.out)


if __name__ == "__main__":
    main()
