"""The estimator against JAX: what a training step holds there, beside what
graphckpt estimates (its rules follow TensorFlow's gradient functions).

Per family, the Keras baseline and graphckpt's default plan at the batch
size, three figures each:

    estimated   `graphckpt.estimate(...).baseline_peak_bytes`, or the plan's
                `estimated_peak_bytes`
    XLA temp    XLA's buffer assignment for the jitted train step (state
                donated, as Keras's trainer compiles it):
                `compile().memory_analysis().temp_size_in_bytes`, this
                process, deterministic
    RSS         `graphckpt.measure(..., backend="jax")`: the process RSS peak
                of a step above the RSS before it, a fresh process each,
                medians of `--repeats` runs

    KERAS_BACKEND=jax PYTHONPATH=. .venv/bin/python benchmarks/jax_estimate.py [--repeats 1] [--families dense,cnn,transformer,blocks]
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.getcwd())

import keras  # noqa: E402
import numpy as np  # noqa: E402

import families  # noqa: E402
import graphckpt  # noqa: E402
from graphckpt.measure import measure  # noqa: E402
from graphckpt.measure.crosscheck import independent_peak  # noqa: E402

FAMILIES = {
    "dense": ("dense_chain", dict(depth=64, width=1024, outputs=1), 256),
    "cnn": ("resnet_cnn", dict(size=64, channels=32, blocks_per_stage=3, stages=3), 16),
    "transformer": ("transformer", dict(seq_len=128, dim=256, heads=4, ffn=1024, depth=6), 16),
    # the CNN's first stage alone, 6 residual blocks at 64 x 64 x 32
    "blocks": ("resnet_cnn", dict(size=64, channels=32, blocks_per_stage=6, stages=1), 16),
}


def _xla_temp(model, batch):
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *model.input_shape[1:])).astype("float32")
    y = rng.standard_normal((batch, *model.output_shape[1:])).astype("float32")
    model.train_on_batch(x, y)  # builds the optimizer's state
    return independent_peak(model, x, y)["bytes"]  # XLA's buffer assignment, as the RSS counter's cross-check


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default="dense,cnn,transformer,blocks")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    if keras.backend.backend() != "jax":
        raise SystemExit("Run with KERAS_BACKEND=jax: the XLA figures are compiled in this process.")
    print("| family | plan | estimated | XLA temp | RSS | XLA temp / estimated |\n|---|---|---:|---:|---:|---:|")
    for name in args.families.split(","):
        builder, kwargs, batch = FAMILIES[name]
        for method in ("baseline", "graphckpt"):
            model = getattr(families, builder)(**kwargs)
            if method == "baseline":
                estimated = graphckpt.estimate(model, batch_size=batch).baseline_peak_bytes
            else:
                estimated = graphckpt.plan(model, batch_size=batch).estimated_peak_bytes
                model = graphckpt.checkpoint_model(model, batch_size=batch)
            temp = _xla_temp(model, batch)
            rss = statistics.median(
                measure(os.path.join(HERE, "families.py") + ":" + builder, method=method, backend="jax",
                        batch_size=batch, builder_kwargs=kwargs, steps=3, warmup=2,
                        checkpoint_kwargs={"batch_size": batch} if method == "graphckpt" else None).peak_bytes
                for _ in range(args.repeats))
            mib = 2**20
            print(f"| {name} | {method} | {estimated / mib:.1f} MiB | {temp / mib:.1f} MiB | {rss / mib:.1f} MiB "
                  f"| {temp / estimated:.2f} |", flush=True)


if __name__ == "__main__":
    main()
