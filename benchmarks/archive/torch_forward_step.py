"""A Dense call's forward step on PyTorch: its bias add and activation are
ops of their own, so one more output-sized tensor lives beside the one
being made (`NodeCosts.forward_temp`, graphckpt/estimator/keras_rules.py
`forward_temporaries`).

The Keras baseline of 32 x Dense(1024) (orthogonal kernels, so that the
chains without an activation stay finite), then Dense(1); batch 256, SGD,
MSE; with and without the layers' bias and tanh. Each run in a fresh
process (`graphckpt.measure`, process RSS), beside the estimate of the
same model, which this process makes with PyTorch's memory model:

    KERAS_BACKEND=torch PYTHONPATH=. .venv/bin/python benchmarks/archive/torch_forward_step.py [--repeats 2]
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above archive/
sys.path.insert(0, HERE)
sys.path.insert(0, os.getcwd())

import keras  # noqa: E402

import families  # noqa: E402
import graphckpt  # noqa: E402
from graphckpt.measure import measure  # noqa: E402

VARIANTS = {
    "bias, tanh": dict(use_bias=True, activation="tanh"),
    "tanh": dict(use_bias=False, activation="tanh"),
    "bias": dict(use_bias=True, activation=None),
    "neither": dict(use_bias=False, activation=None),
}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--depth", type=int, default=32)
    args = p.parse_args()
    if keras.backend.backend() != "torch":
        raise SystemExit("Run with KERAS_BACKEND=torch: the estimate beside each measurement is PyTorch's.")
    print(f"PyTorch, {args.depth} x Dense(1024) + Dense(1), batch 256, {args.repeats} rounds (medians):")
    print("| Dense layers with | measured baseline peak | estimated |\n|---|---:|---:|")
    for label, variant in VARIANTS.items():
        kwargs = dict(depth=args.depth, width=1024, outputs=1, kernel_initializer="orthogonal", **variant)
        peaks = [measure(os.path.join(HERE, "families.py") + ":dense_chain", method="baseline", backend="torch",
                         batch_size=256, builder_kwargs=kwargs, steps=3, warmup=2).peak_bytes
                 for _ in range(args.repeats)]
        estimate = graphckpt.estimate(families.dense_chain(**kwargs), batch_size=256)
        print(f"| {label} | {statistics.median(peaks) / 2**20:.1f} MiB | {estimate.baseline_peak_bytes / 2**20:.1f} MiB |",
              flush=True)


if __name__ == "__main__":
    main()
