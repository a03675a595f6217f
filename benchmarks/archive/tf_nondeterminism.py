"""Counts how often checkpointed training on TensorFlow (no XLA) leaves
plain `fit`'s trajectory, each run in a fresh process (issue 14).

Trains `tests/test_exact_fit.py`'s freeze/unfreeze case (freeze four layers,
train, unfreeze, recompile, train) `--runs` times per mode and prints, per
mode, each distinct trajectory (per-batch losses, and the sum of every
variable afterwards) with how many runs gave it. Plain `fit` gives one.
Until its recompute used the forward pass's weight reads (2026-12-04), the
checkpointed model gave a second one in about 5% of runs on a loaded 2-core
machine: the executor now and then ran a weight update before a recompute
read the weights. Each mode should now give one trajectory, the same.

    PYTHONPATH=. python benchmarks/archive/tf_nondeterminism.py --runs 30 --load
"""

import argparse
import collections
import os
import subprocess
import sys

CHILD = r"""
import tensorflow as tf
if {inter_op}:
    tf.config.threading.set_inter_op_parallelism_threads({inter_op})
import keras
import numpy as np
from tests import test_exact_fit as t

losses = []

class Record(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        losses.append(float(logs["loss"]))

test_fit_fn = t._fit_fn  # the test's own fit, with a callback added
t._fit_fn = lambda x, y, **flag: test_fit_fn(x, y, callbacks=[Record()], **flag)
if {jit}:
    compile_ = keras.Model.compile
    keras.Model.compile = lambda self, *a, **k: compile_(self, *a, **{{**k, "jit_compile": True}})
_, _, state = t.run(t.CASES["freeze_unfreeze"], "{mode}")
print("RESULT", " ".join(f"{{v:.7f}}" for v in losses), "|", repr(float(np.sum([np.sum(s) for s in state]))))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--modes", default="plain,flag", help="comma-separated: plain, checkpoint, flag")
    parser.add_argument("--inter-op", type=int, default=0, help="TensorFlow inter-op threads (0: default)")
    parser.add_argument("--jit", action="store_true", help="compile with jit_compile=True")
    parser.add_argument("--load", action="store_true", help="run a busy loop beside (the flake needs load)")
    args = parser.parse_args()
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    hog = subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) if args.load else None
    try:
        for mode in args.modes.split(","):
            code = CHILD.format(mode=mode, inter_op=args.inter_op, jit=args.jit)
            seen = collections.Counter()
            for _ in range(args.runs):
                out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
                lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
                seen[lines[0][7:] if lines else "failed: " + out.stderr[-300:]] += 1
            print(f"{mode}: {len(seen)} distinct trajectories in {args.runs} runs")
            for result, count in seen.most_common():
                print(f"  {count:3d} x {result[:120]}")
    finally:
        if hog is not None:
            hog.kill()


if __name__ == "__main__":
    main()
