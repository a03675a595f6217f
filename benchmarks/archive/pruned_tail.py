"""Whether TensorFlow recomputes a segment's last call when its backward
does not read that call's output (a lead for issue 15's selective recompute).

12 x [Dense(1024), Activation("tanh")] + Dense(1), batch 512, SGD (learning
rate 0), tf.function steps. Two plans of the same shape, 3 recomputed
segments of 5-6 calls then one run as it is, cut one call apart:

- "ends at tanh": each recomputed segment ends with a tanh, whose backward
  reads its own output, so the recompute must run the whole segment;
- "ends at Dense": each ends with a Dense without activation, whose
  gradient needs only its input and kernel: if TensorFlow prunes the dead
  recompute of that matmul, these steps are faster (3 fewer matmuls a step).

Steps of the baseline and both plans alternate in one process (5 steps per
timing, `--rounds` rounds); the script prints median step times as ratios
of the baseline's.

    PYTHONPATH=. .venv/bin/python benchmarks/archive/pruned_tail.py [--rounds 7] [--jit]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--jit", action="store_true", help="compile the steps with XLA")
    args = p.parse_args(argv)
    import keras
    import numpy as np
    import tensorflow as tf
    from keras import layers

    from graphckpt.graph.build import build_graph
    from graphckpt.planner import plan_from_boundaries, topological_order
    from graphckpt.runtime.checkpointed import checkpointed_model

    inp = keras.Input((1024,))
    x = inp
    for i in range(12):
        x = layers.Activation("tanh", name=f"t{i}")(layers.Dense(1024, name=f"d{i}")(x))
    model = keras.Model(inp, layers.Dense(1)(x))
    graph = build_graph(model)
    order = topological_order(graph)
    plans = {
        "ends at tanh": plan_from_boundaries(graph, order, [0, 6, 12, 18], remat=[True, True, True, False]),
        "ends at Dense": plan_from_boundaries(graph, order, [0, 5, 11, 17], remat=[True, True, True, False]),
    }
    for name, plan in plans.items():
        print(f"{name}: last calls {[s.nodes[-1][0] for s in plan.segments[:-1]]}")
    models = {"baseline": model, **{k: checkpointed_model(model, graph, plan) for k, plan in plans.items()}}
    data = np.random.default_rng(0).random((512, 1024), dtype="float32"), np.zeros((512, 1), "float32")

    def make_step(m):
        optimizer = keras.optimizers.SGD(0.0)

        @tf.function(jit_compile=args.jit)
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(m(x, training=True) - y))
            optimizer.apply(tape.gradient(loss, m.trainable_variables), m.trainable_variables)
            return loss

        return step

    steps = {k: make_step(m) for k, m in models.items()}
    for step in steps.values():
        step(*data)
        step(*data)
    times = {k: [] for k in steps}
    for _ in range(args.rounds):
        for k, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(5):
                step(*data).numpy()
            times[k].append(time.perf_counter() - t0)
    base = statistics.median(times["baseline"])
    for k, ts in times.items():
        print(f"  {k:14s} {statistics.median(ts) / 5:.3f} s/step  x{statistics.median(ts) / base:.2f}")


if __name__ == "__main__":
    main()
