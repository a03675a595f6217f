"""Why the TensorFlow peak (no XLA) of the 64 x Dense(1024) chain differs
from run to run: the weight gradients' consumers.

One `tf.function` training step of `graphckpt.checkpoint_model(model)` (the
default plan), batch 256, three ways of consuming the gradients:

    apply   the Keras SGD optimizer's `apply` (what `fit` does)
    direct  `v.assign_sub(g * 0.01)` per variable
    sum     `tf.reduce_sum(g)` per gradient, added up (nothing updated)

Each way runs in `--runs` fresh processes (TF_CPU_ALLOCATOR_USE_BFC=true,
the BFC peak of each of 4 steps above the memory in use before it).

    PYTHONPATH=. .venv/bin/python benchmarks/archive/diagnose_spread.py [--runs 3]
"""

import argparse
import os
import subprocess
import sys

CHILD = r"""
import os, sys
import numpy as np
import tensorflow as tf
import keras
import graphckpt
sys.path.insert(0, "benchmarks")
from families import dense_chain

mode = sys.argv[1]
model = graphckpt.checkpoint_model(dense_chain(depth=64, width=1024, outputs=1))
opt = keras.optimizers.SGD(0.01)
opt.build(model.trainable_variables)
rng = np.random.default_rng(0)
x = tf.constant(rng.random((256, 1024), dtype="float32"))
y = tf.constant(rng.random((256, 1), dtype="float32"))


@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    if mode == "apply":
        opt.apply(grads, model.trainable_variables)
    elif mode == "direct":
        for v, g in zip(model.trainable_variables, grads):
            v.assign_sub(g * 0.01)
    else:
        return tf.add_n([tf.reduce_sum(g) for g in grads])
    return loss


for _ in range(2):
    step(x, y)
peaks = []
for _ in range(4):
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    step(x, y)
    peaks.append((tf.config.experimental.get_memory_info("CPU:0")["peak"] - before) / 2**20)
print(" ".join(f"{p:.1f}" for p in peaks))
"""


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + [q for q in env.get("PYTHONPATH", "").split(os.pathsep) if q])
    found = {}
    for r in range(args.runs):
        for mode in ("apply", "direct", "sum"):
            out = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True, text=True, check=True)
            peaks = [float(v) for v in out.stdout.split()]
            found.setdefault(mode, []).extend(peaks)
            print(f"[r{r}] {mode:6s} step peaks (MiB): {peaks}", flush=True)
    for mode, peaks in found.items():
        print(f"{mode:6s} {min(peaks):.1f}-{max(peaks):.1f} MiB over {len(peaks)} steps")


if __name__ == "__main__":
    main()
