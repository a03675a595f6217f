"""Diagnosis: how much of a Dense chain's measured peak does not scale with
the batch (weight gradients, optimizer update temporaries), and so bounds the
ratio graphckpt can reach at a small batch.

    .venv/bin/python benchmarks/archive/diagnose_batch.py [--batches 64,128,256,512] [--dropout-every 8]

For each batch size, baseline and graphckpt default plan run alternately in
fresh processes (`graphckpt.measure`). A least-squares line through peak vs
batch gives the per-example part (slope) and the batch-independent part
(intercept) of each.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above archive/
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from graphckpt.measure import measure  # noqa: E402


def line(xs, ys):
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="64,128,256,512")
    p.add_argument("--depth", type=int, default=64)
    p.add_argument("--dropout-every", type=int, default=8)
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    kw = {"depth": args.depth, "width": 1024, "dropout_every": args.dropout_every}
    peaks = {"baseline": [], "graphckpt": []}
    print(f"{args.depth} x Dense(1024, tanh), Dropout every {args.dropout_every}: peak MiB")
    for b in batches:
        for method in peaks:
            m = measure(os.path.join(HERE, "families.py") + ":dense_chain", batch_size=b, builder_kwargs=kw,
                        method=method, steps=4, warmup=1)
            peaks[method].append(m.peak_bytes / 2**20)
        print(f"  batch {b:4d}: baseline {peaks['baseline'][-1]:6.1f}  graphckpt {peaks['graphckpt'][-1]:6.1f}"
              f"  ratio x{peaks['graphckpt'][-1] / peaks['baseline'][-1]:.3f}", flush=True)
    for method, ys in peaks.items():
        slope, icpt = line(batches, ys)
        print(f"  {method:9s}: {slope * 1024:6.1f} KiB per example (= {slope * 2**20 / 4096:.1f} tensors of "
              f"width 1024) + {icpt:5.1f} MiB independent of the batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
