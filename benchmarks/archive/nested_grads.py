"""Where the nested ResNet50V2's checkpointed peak exceeds its estimate:
the same model with the backbone's weights trainable and frozen
(BatchNormalization left trainable, so the activations are the same),
baseline and the default plan, measured (fresh process per run, TensorFlow
allocator statistics) beside graphckpt's estimate.

    PYTHONPATH=. .venv/bin/python benchmarks/archive/nested_grads.py [--repeats 2]
    PYTHONPATH=. .venv/bin/python benchmarks/archive/nested_grads.py --wait   # in this process

`--wait` separates the two things trainable weights bring: the same
trainable model, stepped in this process (TensorFlow allocator
statistics, 3 steps each) once with the optimizer applying the gradients,
once with each gradient summed to a scalar as soon as it exists and no
optimizer: the difference is gradients waiting for the optimizer.

Writes benchmarks/results/nested_grads.json (not with `--wait`).
"""

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/, above archive/
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from graphckpt.measure import measure  # noqa: E402

BATCH = 8


def wait():
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    import keras
    import numpy as np
    import tensorflow as tf

    import families
    import graphckpt

    x = tf.constant(np.random.default_rng(0).random((BATCH, 128, 128, 3), dtype="float32"))
    y = tf.constant(np.random.default_rng(1).random((BATCH, 10), dtype="float32"))

    def peaks(model, apply):
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            if apply:
                optimizer.apply(grads, model.trainable_variables)
                return loss
            return loss + 0.0 * tf.add_n([tf.reduce_sum(g) for g in grads])

        step()
        step()
        out = []
        for _ in range(3):
            start = tf.config.experimental.get_memory_info("CPU:0")["current"]
            tf.config.experimental.reset_memory_stats("CPU:0")
            step()
            out.append((tf.config.experimental.get_memory_info("CPU:0")["peak"] - start) / 2**20)
        return out

    for method in ("baseline", "graphckpt"):
        for apply in (True, False):
            keras.utils.set_random_seed(0)
            model = families.nested_resnet50v2()
            model = graphckpt.checkpoint_model(model) if method == "graphckpt" else model
            got = peaks(model, apply)
            print(f"{method:9s} {'optimizer applies' if apply else 'summed at once  '}: "
                  f"{', '.join(f'{p:.1f}' for p in got)} MiB", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--wait", action="store_true", help="apply vs sum the gradients, in this process")
    args = p.parse_args(argv)
    if args.wait:
        return wait()
    import families
    import graphckpt

    rows = []
    for frozen in (False, True):
        model = families.nested_resnet50v2(frozen_weights=frozen)
        e = graphckpt.estimate(model, graphckpt.plan(model, batch_size=BATCH), batch_size=BATCH)
        for method in ("baseline", "graphckpt"):
            peaks = []
            for _ in range(args.repeats):
                m = measure(os.path.join(HERE, "families.py") + ":nested_resnet50v2", batch_size=BATCH,
                            builder_kwargs={"frozen_weights": frozen}, method=method, steps=3, warmup=2)
                peaks.append(m.peak_bytes / 2**20)
            estimated = (e.baseline_peak_bytes if method == "baseline" else e.peak_bytes) / 2**20
            rows.append({"frozen_weights": frozen, "method": method, "estimated_mib": estimated, "measured_mib": peaks})
            print(f"{'frozen' if frozen else 'trainable':9s} {method:9s} estimated {estimated:6.1f} MiB, "
                  f"measured {', '.join(f'{x:.1f}' for x in peaks)} MiB", flush=True)
    with open(os.path.join(HERE, "results", "nested_grads.json"), "w") as f:
        json.dump({"date": datetime.date.today().isoformat(), "batch": BATCH, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
