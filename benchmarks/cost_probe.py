"""Calibrates the planner's time model on this machine (issue 15 part 1).

The planner chooses what to recompute by its cost. FLOPs alone say a
BatchNormalization or a ReLU costs almost nothing next to a convolution; on
a CPU those are bound by memory traffic and take a real share of the step.
This script times the forward pass of every distinct layer call of the
benchmark families on its own (TensorFlow graph mode, `training=True`, the
family's batch), and fits, per kind of call (`graphckpt.estimator.cost_model.kind_of`):

    seconds = flops * seconds_per_flop[kind] + overhead      (matmul-like)
    seconds = bytes * seconds_per_byte[class] + overhead     (the others)

(matmul-like kinds by FLOPs, every other layer class by the bytes it reads
and writes; `graphckpt.estimator.cost_model`) by least squares on relative errors,
all terms non-negative. It writes the
fit to `graphckpt/estimator/data/cpu_costs.json`, the data the estimator prices
recompute with, and prints how well FLOPs alone and the fitted model rank
the calls' measured times.

    PYTHONPATH=. .venv/bin/python benchmarks/cost_probe.py [--families resnet50v2,transformer] [--no-write]
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import numpy as np  # noqa: E402

RESULTS = os.path.join(HERE, "results", "cost_probe.json")
# The family sizes of run_all.py, plus a wide Dense chain.
PROBED = {
    "resnet50v2": ("resnet50v2", dict(size=128), 8),
    "transformer": ("transformer", dict(seq_len=128, dim=256, heads=4, ffn=1024, depth=6), 16),
    "resnet_cnn": ("resnet_cnn", dict(size=64, channels=32, blocks_per_stage=3, stages=3), 16),
    "unet": ("unet", dict(size=128, channels=16, levels=4), 8),
    "dense": ("dense_chain", dict(depth=8, width=1024, dropout_every=4), 256),
    "densenet121": ("densenet121", dict(size=128), 8),
}


def _time_call(data, tensors, batch, repeats):
    """Median seconds of one forward run of a layer call, alone, in a
    tf.function, on random inputs of its shapes at `batch`, less the
    median time of the same tf.function call without the layer (dispatch,
    which a whole training step pays once, not per call)."""
    import keras
    import tensorflow as tf

    node = data["node"]
    op = data["layer"]
    values = []
    for key in data["in_keys"]:
        info = tensors[key]
        shape = (batch, *(d or 1 for d in info.shape[1:]))
        if "float" in info.dtype:
            values.append(tf.random.uniform(shape, dtype=info.dtype))
        else:
            values.append(tf.zeros(shape, dtype=info.dtype))
    by_id = {id(kt): v for kt, v in zip(node.input_tensors, values)}
    args, kwargs = node.arguments.fill_in(by_id)
    if isinstance(op, keras.layers.Layer) and getattr(op, "_call_has_training_arg", False):
        kwargs["training"] = True

    @tf.function
    def run():
        return op(*args, **kwargs)

    @tf.function
    def dispatch():  # the same call's overhead, without the layer
        return tf.identity(values[0])

    return max(_median_seconds(run, repeats) - _median_seconds(dispatch, repeats), 1e-7)


def _median_seconds(fn, repeats):
    import tensorflow as tf

    def done(out):
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)

    for _ in range(2):
        done(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        done(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe(families, repeats):
    """Rows `{family, call, class, kind, flops, bytes, seconds}`, one per
    distinct call (same class, rule and shapes)."""
    import families as builders
    from graphckpt.estimator import cost_model
    from graphckpt.estimator.peak import call_estimates
    from graphckpt.graph.build import build_graph
    from graphckpt.planner.data import layer_nodes

    rows, seen = [], set()
    for name in families:
        builder, kwargs, batch = PROBED[name]
        model = getattr(builders, builder)(**kwargs)
        graph = build_graph(model)
        tensors = graph.tensors
        by_node = {c.node: c for c in call_estimates(graph, batch)}
        for key in layer_nodes(graph):
            data = graph.nodes[key]
            est = by_node[key]
            io = cost_model.io_bytes(
                [tensors[k] for k in data["in_keys"]], [tensors[k] for k in data["out_keys"]], batch
            )
            signature = (data["class_name"], est.rule, tuple(tensors[k].shape for k in data["in_keys"]), io)
            if signature in seen:
                continue
            seen.add(signature)
            try:
                seconds = _time_call(data, tensors, batch, repeats)
            except Exception as e:  # a call that can't run alone: left out, said
                print(f"  skipped {key[0]} ({data['class_name']}): {type(e).__name__}: {str(e)[:80]}")
                continue
            kind = cost_model.kind_of(data["class_name"], est.rule, est.expensive)
            rows.append(
                dict(family=name, call=key[0], cls=data["class_name"], kind=kind, flops=est.flops, bytes=io, seconds=seconds)
            )
        print(f"{name}: {len(rows)} distinct calls so far", flush=True)
    return rows


# Calls faster than this are within the timing noise: their relative
# errors are weighted as if they took this long.
NOISE_SECONDS = 50e-6


MATMUL_KINDS = ("attention", "conv", "matmul")
# Layer classes with fewer calls than this are priced as "other".
MIN_CALLS = 3


def _kind(row, classes):
    if row["kind"] in MATMUL_KINDS or row["kind"] in classes:
        return row["kind"]
    return "other"


def fit(rows):
    """Non-negative least squares on relative error: seconds per FLOP for
    each matmul-like kind, seconds per byte for each other layer class
    (and "other"), one overhead per call."""
    from collections import Counter

    from scipy.optimize import nnls

    counts = Counter(r["kind"] for r in rows)
    classes = {k for k, n in counts.items() if n >= MIN_CALLS and k not in MATMUL_KINDS}
    columns = sorted({_kind(r, classes) for r in rows} | {"other"})
    a = np.zeros((len(rows), len(columns) + 1))
    b = np.ones(len(rows))
    for i, r in enumerate(rows):
        w = 1.0 / max(r["seconds"], NOISE_SECONDS)
        b[i] = r["seconds"] * w
        kind = _kind(r, classes)
        a[i, columns.index(kind)] = (r["flops"] if kind in MATMUL_KINDS else r["bytes"]) * w
        a[i, -1] = w
    coef, _ = nnls(a, b)
    per_byte = {k: float(coef[j]) for j, k in enumerate(columns) if k not in MATMUL_KINDS}
    if not per_byte["other"]:  # too few uncalibrated calls to say: the classes' median
        per_byte["other"] = float(np.median([v for v in per_byte.values() if v]))
    return dict(
        seconds_per_flop={k: float(coef[j]) for j, k in enumerate(columns) if k in MATMUL_KINDS},
        seconds_per_byte=per_byte,
        seconds_per_call=float(coef[-1]),
    )


def _spearman(x, y):
    rx = np.argsort(np.argsort(x))
    ry = np.argsort(np.argsort(y))
    return float(np.corrcoef(rx, ry)[0, 1])


def report(rows, params):
    from graphckpt.estimator import cost_model

    measured = np.array([r["seconds"] for r in rows])
    flops = np.array([r["flops"] for r in rows])
    model = np.array([cost_model.seconds(params, r["kind"], r["flops"], r["bytes"]) for r in rows])
    rel = np.abs(model - measured) / np.maximum(measured, NOISE_SECONDS)
    print(f"{len(rows)} calls. Rank correlation with measured time: FLOPs {_spearman(flops, measured):.2f}, "
          f"fitted model {_spearman(model, measured):.2f}; fitted model's relative error: median {np.median(rel):.0%}, "
          f"90th percentile {np.quantile(rel, 0.9):.0%}")
    for kind in sorted({r["kind"] for r in rows}, key=lambda k: -sum(r["seconds"] for r in rows if r["kind"] == k)):
        sel = [i for i, r in enumerate(rows) if r["kind"] == kind]
        share = measured[sel].sum() / measured.sum()
        fshare = flops[sel].sum() / flops.sum()
        print(f"  {kind:22s} {len(sel):4d} calls: {share:6.1%} of measured time, {fshare:6.1%} of FLOPs, "
              f"median error {np.median(rel[sel]):.0%}")
    return dict(
        spearman_flops=_spearman(flops, measured),
        spearman_model=_spearman(model, measured),
        median_relative_error=float(np.median(rel)),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(PROBED))
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-write", action="store_true", help="print the fit; leave the package data alone")
    parser.add_argument("--refit", action="store_true", help=f"fit the calls timed last time ({RESULTS})")
    args = parser.parse_args(argv)
    import keras
    import tensorflow as tf

    from graphckpt.estimator import cost_model

    if args.refit:
        with open(RESULTS) as f:
            saved = json.load(f)
        rows, args.families = saved["rows"], ",".join(saved["families"])
        for r in rows:  # the kinds of graphckpt.estimator.cost_model now
            r["kind"] = r["kind"] if r["kind"] in MATMUL_KINDS else r["cls"]
    else:
        rows = probe(args.families.split(","), args.repeats)
    params = fit(rows)
    quality = report(rows, params)
    data = dict(
        params,
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        backend="tensorflow (graph mode, no XLA)",
        versions=f"TensorFlow {tf.__version__}, Keras {keras.__version__}",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        command="PYTHONPATH=. .venv/bin/python benchmarks/cost_probe.py",
        families=args.families.split(","),
        calls=len(rows),
        quality=quality,
    )
    print(json.dumps(params, indent=1))
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(dict(data, rows=rows), f, indent=1)
    if not args.no_write:
        with open(cost_model.DATA, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        print(f"wrote {cost_model.DATA}")


if __name__ == "__main__":
    main()
