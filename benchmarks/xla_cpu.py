"""TensorFlow with and without XLA on the CPU: graphckpt's default plan
against the baseline, per model family, memory by process RSS.

    PYTHONPATH=. .venv/bin/python benchmarks/xla_cpu.py [--families resnet_cnn,resnet50v2] [--repeats 1]

Under XLA the BFC allocator's statistics come in powers of two (XLA's
temporary buffers), so both settings are read by RSS (`counter="rss"`,
glibc returning large blocks on free: `graphckpt.measure.counters`).
Baseline and graphckpt alternate, each run in a fresh process
(`graphckpt.measure.compare`); ratios are medians of the paired ratios.
Writes benchmarks/results/xla_cpu.json.
"""

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from graphckpt.measure import compare  # noqa: E402

# family -> batch, as in run_all.py
FAMILIES = {"dense_chain": 256, "resnet_cnn": 16, "transformer": 16, "resnet50v2": 8, "nested_resnet50v2": 8}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=os.path.join(HERE, "results", "xla_cpu.json"))
    args = p.parse_args(argv)
    rows = []
    for family in args.families.split(","):
        for jit in (False, True):
            c = compare(
                os.path.join(HERE, "families.py") + ":" + family,
                batch_size=FAMILIES[family],
                repeats=args.repeats,
                steps=3,
                warmup=2,
                jit_compile=jit,
                counter="rss",
            )
            row = {
                "family": family,
                "batch": FAMILIES[family],
                "jit_compile": jit,
                "baseline_peak_mib": [m.peak_bytes / 2**20 for m in c.baseline],
                "graphckpt_peak_mib": [m.peak_bytes / 2**20 for m in c.candidate],
                "peak_ratio": c.peak_ratio,
                "time_ratio": c.time_ratio,
            }
            rows.append(row)
            print(f"{family:18s} batch {row['batch']:3d} jit {str(jit):5s} baseline "
                  f"{row['baseline_peak_mib'][0]:7.1f} MiB  graphckpt {row['graphckpt_peak_mib'][0]:7.1f} MiB  "
                  f"peak x{c.peak_ratio:.3f}  time x{c.time_ratio:.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "command": " ".join(sys.argv), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
