"""Diagnosis: graphckpt's measured peak depends on the TensorFlow executor's
op order, because nothing orders a segment's recompute after the previous
segment's weight gradients.

`tf.recompute_grad` (what `keras.remat` is on TensorFlow) makes a segment's
recompute wait for the gradient of the segment's *output* only. The layer
activations that segment k+1 recomputed stay alive until *all* its gradients
are done, including the weight gradients (dW), which nothing downstream waits
for. The executor is free to run the input-gradient chain (dX) ahead, start
segment k's recompute, then k-1's, ..., while the dW work, and with it every
recomputed interior, is still pending. With one inter-op thread that is what
happens, and the checkpointed model needs about as much as the baseline.

The fix, now in `graphckpt.remat.tf_remat`: return a segment's input
gradients only after its weight gradients exist (a control dependency on
them; a data dependency would be needed under XLA). Then at most one
recomputed interior is alive at a time. This script compares it with the
plain `keras.remat` (`tf.recompute_grad`) graphckpt used before
(`graphckpt, plain remat`), with the default and with one inter-op thread.

Usage:
    .venv/bin/python benchmarks/diagnose_order.py [--batch 256] [--depth 64]

Each configuration runs in a fresh process. Prints the peak training-step
memory above resident (MiB) of each of 3 steps.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def child(config):
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    import tensorflow as tf

    if config["inter_op"]:
        tf.config.threading.set_inter_op_parallelism_threads(config["inter_op"])
    sys.path.insert(0, HERE)
    import numpy as np

    import families
    import graphckpt

    if config["method"] == "graphckpt, plain remat":
        import keras

        from graphckpt import remat

        remat.tf_remat = lambda f, n_inputs: keras.remat(f)  # read when the train step is traced
    model = families.dense_chain(depth=config["depth"], width=1024, dropout_every=config["dropout_every"])
    if config["method"] != "baseline":
        model = graphckpt.checkpoint_model(model)
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((config["batch"], 1024), dtype=np.float32))
    y = tf.constant(rng.standard_normal((config["batch"], 10), dtype=np.float32))
    model.train_on_batch(x, y)
    peaks = []
    for _ in range(3):
        tf.config.experimental.reset_memory_stats("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"]
        model.train_on_batch(x, y)
        peaks.append(tf.config.experimental.get_memory_info("CPU:0")["peak"] - before)
    print("RESULT " + json.dumps(peaks))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--depth", type=int, default=64)
    p.add_argument("--dropout-every", type=int, default=0)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    print(f"{args.depth} x Dense(1024, tanh), batch {args.batch}: peak MiB of 3 steps")
    for inter_op in (0, 1):
        for method in ("baseline", "graphckpt, plain remat", "graphckpt"):
            config = dict(vars(args), inter_op=inter_op, method=method)
            config.pop("child")
            out = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(config)], env=env, capture_output=True, text=True
            )
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            peaks = json.loads(line[7:]) if line else None
            shown = " ".join(f"{b / 2**20:6.1f}" for b in peaks) if peaks else "failed: " + out.stderr[-300:]
            print(f"  inter-op threads {inter_op or 'default':>7}  {method:22s} {shown}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
