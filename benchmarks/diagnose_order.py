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

The fix tried here (`ordered_recompute_grad`): return a segment's input
gradients only after its weight gradients exist (a control dependency on
them; a data dependency would be needed under XLA). Then at most one
recomputed interior is alive at a time.

Usage:
    .venv/bin/python benchmarks/diagnose_order.py [--batch 256] [--depth 64]

`ordered_graphckpt` is also a `graphckpt.measure` method, to measure the fix
on any family: method="benchmarks/diagnose_order.py:ordered_graphckpt".

Each configuration runs in a fresh process. Prints the peak training-step
memory above resident (MiB) of each of 3 steps.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def ordered_recompute_grad(f):
    """`tf.recompute_grad`, except that the input gradients wait for the
    weight gradients (graph mode)."""
    import tensorflow as tf
    from tensorflow.python.eager import backprop, context, record
    from tensorflow.python.ops import custom_gradient
    from tensorflow.python.util import nest, tf_decorator

    @custom_gradient.custom_gradient
    def inner(*args):
        with record.stop_recording():
            result = f(*args)

        def grad(*dresult, variables=None):
            with backprop.GradientTape() as tape:
                id_args = nest.map_structure(tf.identity, args)
                if not context.executing_eagerly():
                    # As tf.recompute_grad: recompute only once dresult exists.
                    elem = tf.reduce_max(tf.reshape(dresult[0], [-1])[:1])
                    ok = tf.cast(elem, tf.bool)
                    dep = tf.where(ok == ok, 0.0, float("nan"))
                    id_args = nest.map_structure(lambda x: x + tf.cast(dep, x.dtype), id_args)
                tape.watch(id_args)
                if variables:
                    tape.watch(variables)
                recomputed = f(*id_args)
            wrt = list(id_args) + list(variables or [])
            grads = tape.gradient(
                recomputed, wrt, output_gradients=dresult, unconnected_gradients=tf.UnconnectedGradients.ZERO
            )
            g_args, g_vars = grads[: len(id_args)], grads[len(id_args) :]
            if g_vars and not context.executing_eagerly():
                with tf.control_dependencies(g_vars):
                    g_args = [tf.identity(g) for g in g_args]
            return g_args, g_vars

        return result, grad

    return tf_decorator.make_decorator(f, inner)


def ordered_graphckpt(build, **checkpoint_kwargs):
    """A `graphckpt.measure` method: the default plan, traced with
    `ordered_recompute_grad` in place of `tf.recompute_grad`."""
    import tensorflow as tf

    import graphckpt

    tf.recompute_grad = ordered_recompute_grad  # keras.remat calls it when the train step is traced
    return graphckpt.checkpoint_model(build(), **checkpoint_kwargs)


def child(config):
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    import tensorflow as tf

    if config["inter_op"]:
        tf.config.threading.set_inter_op_parallelism_threads(config["inter_op"])
    sys.path.insert(0, HERE)
    import families
    import numpy as np

    import graphckpt

    model = families.dense_chain(depth=config["depth"], width=1024, dropout_every=config["dropout_every"])
    if config["method"] != "baseline":
        model = graphckpt.checkpoint_model(model)
    if config["method"] == "graphckpt+ordered":
        tf.recompute_grad = ordered_recompute_grad  # keras.remat calls tf.recompute_grad at trace time
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
        for method in ("baseline", "graphckpt", "graphckpt+ordered"):
            config = dict(vars(args), inter_op=inter_op, method=method)
            config.pop("child")
            out = subprocess.run(
                [sys.executable, __file__, "--child", json.dumps(config)], env=env, capture_output=True, text=True
            )
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            peaks = json.loads(line[7:]) if line else None
            shown = " ".join(f"{b / 2**20:6.1f}" for b in peaks) if peaks else "failed: " + out.stderr[-300:]
            print(f"  inter-op threads {inter_op or 'default':>7}  {method:18s} {shown}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
