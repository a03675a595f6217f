"""An inline call that reads an earlier tensor in its backward, between two
recomputed segments, measured (docs/estimator.md, `both_j`).

The U-Net of `families.unet` (128 x 128, batch 8) under two plans that the
memory model without `NodeCosts.reads` priced alike (87.0 MiB):

    inline   the previous default: [2 recomputed] [MaxPooling2D inline]
             [23 recomputed] [5 inline]. The pooling holds its input, the
             first skip tensor, for its backward, while the skip's gradient
             from the decoder's Concatenate is already back.
    merged   the current default: the pooling recomputed in the segment
             before it, [3 recomputed] [23 recomputed] [5 inline].

On TensorFlow (no XLA) and PyTorch (`--backend torch`): the peak of each
plan and of the baseline (TensorFlow's BFC statistics, PyTorch's process
RSS), fresh processes, the three alternating, `--repeats` rounds; ratios
to the same round's baseline, with their medians. On JAX (`--backend
jax`): XLA's buffer assignment of the jitted train step (temporaries,
deterministic), in this process.

    PYTHONPATH=. .venv/bin/python benchmarks/inline_reader.py [--repeats 4] [--backend tensorflow|torch|jax]
"""

import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FAMILIES_PY = os.path.join(HERE, "families.py")
sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

BATCH = 8


def plan_of(model, which):
    """The plan `which` ("inline" or "merged") for the U-Net `model`: the
    first MaxPooling2D inline between its two recomputed neighbours, or
    recomputed with the segment before it."""
    from graphckpt.graph.build import build_graph
    from graphckpt.planner import plan_from_boundaries, topological_order

    graph = build_graph(model)
    order = topological_order(graph)
    pool = next(v for v in order if graph.nodes[v]["class_name"] == "MaxPooling2D")
    i = order.index(pool)
    last = max(j for j, v in enumerate(order) if graph.nodes[v]["class_name"] == "UpSampling2D")
    if which == "inline":
        return graph, plan_from_boundaries(graph, order, [0, i, i + 1, last], remat=[True, False, True, False])
    return graph, plan_from_boundaries(graph, order, [0, i + 1, last], remat=[True, True, False])


def variant(build, which):
    """A `graphckpt.measure` transform: the U-Net under the plan `which`."""
    from graphckpt.runtime.checkpointed import checkpointed_model

    model = build()
    graph, plan = plan_of(model, which)
    return checkpointed_model(model, graph, plan)


def _measured(backend, repeats):
    from graphckpt.measure import measure

    ratios = {"inline": [], "merged": []}
    for r in range(repeats):
        peaks = {}
        for which in ("baseline", "inline", "merged"):
            kw = (
                dict(method="baseline")
                if which == "baseline"
                else dict(method=f"{os.path.abspath(__file__)}:variant", method_kwargs={"which": which})
            )
            m = measure(f"{FAMILIES_PY}:unet", batch_size=BATCH, steps=6, warmup=2, backend=backend, **kw)
            peaks[which] = m.peak_bytes
            print(f"  round {r} {which:8s} peak {m.peak_bytes / 2**20:6.1f} MiB", flush=True)
        for which in ratios:
            ratios[which].append(peaks[which] / peaks["baseline"])
    for which, rs in ratios.items():
        print(f"{which:8s} x{statistics.median(rs):.2f} (rounds: {', '.join(f'x{x:.2f}' for x in rs)})")


def _jax():
    import keras

    import families
    import graphckpt
    from graphckpt.runtime.checkpointed import checkpointed_model
    from jax_estimate import _xla_temp

    for which in ("inline", "merged"):
        keras.utils.set_random_seed(0)
        model = families.unet()
        graph, plan = plan_of(model, which)
        temp = _xla_temp(checkpointed_model(model, graph, plan), BATCH)
        estimate = graphckpt.estimate(model, plan, batch_size=BATCH).peak_bytes
        print(f"{which:8s} XLA temporaries {temp / 2**20:6.1f} MiB, estimate {estimate / 2**20:6.1f} MiB")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--backend", default="tensorflow", choices=("tensorflow", "torch", "jax"))
    args = p.parse_args()
    if args.backend == "jax":
        if os.environ.get("KERAS_BACKEND") != "jax":
            sys.exit("run with KERAS_BACKEND=jax")
        _jax()
    else:
        _measured(args.backend, args.repeats)


if __name__ == "__main__":
    main()
