"""How much of a model's output size a training step holds beside its
segments: the estimator's `fixed` term (`graphckpt/estimator/peak.py`,
`_FIXED_OUTPUTS`).

A Dense chain whose head has no weights and outputs far more than any
layer keeps (16 x Dense(1024, tanh), then each value repeated 8 times:
outputs of 8 MiB at batch 256), measured (fresh process per run, baseline
and the default plan alternating, TensorFlow allocator statistics) beside
the estimate with `fixed` at 0, 1 and 3 times the outputs.

    PYTHONPATH=. .venv/bin/python benchmarks/archive/fixed_outputs.py [--repeats 2]

Writes benchmarks/results/fixed_outputs.json.
"""

import argparse
import datetime
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above archive/
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from graphckpt.measure import measure  # noqa: E402
from tests.measure_builders import big_outputs  # noqa: E402

BATCH = 256
MIB = 2**20


def estimates():
    """{factor: (baseline, default plan)} estimated bytes."""
    import importlib

    import graphckpt

    estimate_module = importlib.import_module("graphckpt.estimator.peak")
    model = big_outputs()
    kept = estimate_module._FIXED_OUTPUTS
    rows = {}
    try:
        for factor in (0.0, 1.0, 3.0):
            estimate_module._FIXED_OUTPUTS = factor
            e = graphckpt.estimate(model, graphckpt.plan(model, batch_size=BATCH), batch_size=BATCH)
            rows[factor] = (e.baseline_peak_bytes, e.peak_bytes)
    finally:
        estimate_module._FIXED_OUTPUTS = kept
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    measured = {"baseline": [], "graphckpt": []}
    for _ in range(args.repeats):
        for method in measured:
            m = measure("tests.measure_builders:big_outputs", batch_size=BATCH, method=method, steps=3, warmup=2)
            measured[method].append(m.peak_bytes)
            print(f"  {method}: {m.peak_bytes / MIB:.1f} MiB", flush=True)
    base, plan = (statistics.median(measured[k]) for k in ("baseline", "graphckpt"))
    rows = estimates()
    print(f"measured (median): baseline {base / MIB:.1f} MiB, default plan {plan / MIB:.1f} MiB")
    for factor, (eb, ep) in rows.items():
        print(f"fixed = {factor:.0f} x outputs: baseline {eb / MIB:.1f} ({eb / base - 1:+.0%}), "
              f"default plan {ep / MIB:.1f} ({ep / plan - 1:+.0%})")
    out = {
        "date": datetime.date.today().isoformat(),
        "batch": BATCH,
        "output_bytes": BATCH * 1024 * 8 * 4,
        "measured": measured,
        "estimated": {str(f): {"baseline": b, "plan": p} for f, (b, p) in rows.items()},
    }
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "fixed_outputs.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
