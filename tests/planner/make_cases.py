"""Writes the planner regression cases in tests/planner/cases/.

Each case is a model's layer-call graph and per-call costs, stored as data
(see `casefile.py`), with the answers the planner of this checkout gives to
a list of queries. `test_regression.py` replays them without Keras: a
planner change that moves any boundary or estimate fails it.

The stored answers were written with the planner before the speed-up of
issue 15 (commit 325211c); rerunning this script with a later planner
rewrites them, and `git diff --stat tests/planner/cases` shows whether any
answer changed (the files are written deterministically).

Usage (from the repository root; the large cases take minutes with a slow
planner):
    KERAS_BACKEND=tensorflow python tests/planner/make_cases.py [--only NAME ...] [--large]
"""

import argparse
import os
import sys
import time

import networkx as nx

sys.setrecursionlimit(10000)  # Keras walks a 2000-call chain recursively
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from graphckpt.graph.build import TensorInfo  # noqa: E402
from graphckpt.planner import baseline_peak, graph_costs, smallest_peak, topological_order  # noqa: E402
from tests.planner import casefile  # noqa: E402

FRACTIONS = (0.25, 0.4, 0.5, 0.6, 0.8, 0.95)


def _keras_cases():
    """name -> (builder, batch_size): small models of every DAG shape, the
    benchmark families at small sizes, and keras.applications models."""
    import keras

    from benchmarks import families
    from tests import models

    apps = keras.applications
    return {
        "chain": (lambda: models.chain(), 8),
        "chain_bn_dropout": (lambda: models.chain(depth=30, dropout=0.1, bn=True), None),
        "resnet": (lambda: models.resnet(), 8),
        "unet": (lambda: models.unet(), 4),
        "densenet": (lambda: models.densenet(blocks=3, layers_per_block=4), 8),
        "inception": (lambda: models.inception(), None),
        "multi_io": (lambda: models.multi_io(), 8),
        "nested": (lambda: models.nested(), 8),
        "masked_lstm": (lambda: models.masked_lstm(), 8),
        "dense_chain_200": (lambda: families.dense_chain(depth=200, width=64, dropout_every=7), 32),
        "resnet_cnn": (lambda: families.resnet_cnn(size=64, channels=16, blocks_per_stage=2), 16),
        "transformer": (lambda: families.transformer(seq_len=64, dim=64, heads=2, ffn=128, depth=4), 8),
        "mobilenetv2": (lambda: apps.MobileNetV2(input_shape=(64, 64, 3), alpha=0.35, weights=None, classes=10), 8),
        "densenet121": (lambda: apps.DenseNet121(input_shape=(64, 64, 3), weights=None, classes=10), 8),
        "efficientnetb0": (lambda: apps.EfficientNetB0(input_shape=(64, 64, 3), weights=None, classes=10), 4),
    }


def _large_cases():
    """The planning-time benchmarks of issue 15 (see benchmarks/plan_time.py)."""
    import keras

    from benchmarks import families

    return {
        "nasnetlarge": (lambda: keras.applications.NASNetLarge(weights=None), None),
        "dense_chain_2000": (lambda: families.dense_chain(depth=2000, width=64), 32),
    }


def _queries(graph, costs, keep, large=False):
    """The queries of one case: default, sqrt and fixed-count plans; budgets
    across the feasible range and just below it; with and without calls
    that may not be recomputed."""
    n = len(topological_order(graph))
    base = baseline_peak(graph, costs)
    queries = [{"kind": "baseline"}, {"kind": "segments", "segments": "auto"}, {"kind": "segments", "segments": "sqrt"}]
    if large:
        return queries + [{"kind": "budget", "budget_bytes": int(0.5 * base), "keep": []}]
    queries += [{"kind": "segments", "segments": "auto", "graph_costs": True}]
    queries += [{"kind": "segments", "segments": k} for k in sorted({1, min(2, n), min(3, n), max(1, n // 3)})]
    least = smallest_peak(graph, costs)
    queries += [{"kind": "smallest", "keep": []}]
    budgets = sorted({int(f * base) for f in FRACTIONS} | {least, least - 1, (least + base) // 2})
    queries += [{"kind": "budget", "budget_bytes": b, "keep": []} for b in budgets]
    if keep:
        enc = [casefile._enc(v) for v in keep]
        least_keep = smallest_peak(graph, costs, keep=keep)
        queries += [{"kind": "smallest", "keep": enc}]
        for b in sorted({least_keep, least_keep - 1, int(0.7 * base), int(0.9 * base)}):
            queries.append({"kind": "budget", "budget_bytes": b, "keep": enc})
    return queries


def _write(name, graph, costs, keep, meta, large=False):
    queries = _queries(graph, costs, keep, large)
    start = time.process_time()
    answers = [casefile.answer(graph, costs, q) for q in queries]
    seconds = time.process_time() - start
    path = os.path.join(casefile.CASES_DIR, f"{name}.json.gz")
    casefile.write_case(path, name, graph, costs, queries, answers, meta)
    print(f"{name}: {len(topological_order(graph))} calls, {len(queries)} queries, {seconds:.1f} s CPU", flush=True)


def _model_case(name, builder, batch_size, large=False):
    from graphckpt import policies
    from graphckpt.estimator.peak import node_costs
    from graphckpt.graph.build import build_graph

    graph = build_graph(builder())
    costs = node_costs(graph, batch_size)
    keep = [v for v in topological_order(graph) if policies.save_expensive(graph.nodes[v]["layer"])]
    _write(name, graph, costs, keep, {"batch_size": batch_size, "source": "keras"}, large)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="case names to write (default: all but the large ones)")
    parser.add_argument("--large", action="store_true", help="also write the large cases (NASNetLarge, a 2000-call chain)")
    args = parser.parse_args(argv)
    os.makedirs(casefile.CASES_DIR, exist_ok=True)
    wanted = set(args.only or ())
    randoms = {f"random_{seed}": seed for seed in range(12)}
    for name, seed in randoms.items():
        if not wanted or name in wanted:
            g, costs, keep = casefile.random_graph(seed, 8 + 3 * seed)
            _write(name, g, costs, keep, {"seed": seed, "source": "random"})
    chain = "graph_costs_chain_150"
    if not wanted or chain in wanted:
        g = nx.DiGraph()
        names = ["x"] + [f"n{i}" for i in range(150)]
        for i, v in enumerate(names):
            g.add_node(v, kind="input" if i == 0 else "layer", position=i)
        for u, v in zip(names, names[1:]):
            g.add_edge(u, v, tensors=((u, 0, 0),))
        g.graph.update(
            tensors={(v, 0, 0): TensorInfo((v, 0, 0), v, (None, 1), "float32", 4) for v in names},
            inputs=[("x", 0, 0)],
            outputs=[(names[-1], 0, 0)],
            state_chains=[],
        )
        _write(chain, g, graph_costs(g), names[5::7], {"source": "uniform chain"})
    cases = dict(_keras_cases()) if (not wanted or wanted - set(randoms) - {chain}) else {}
    for name, (builder, batch) in cases.items():
        if not wanted or name in wanted:
            _model_case(name, builder, batch)
    if args.large:
        for name, (builder, batch) in _large_cases().items():
            if not wanted or name in wanted:
                _model_case(name, builder, batch, large=True)


if __name__ == "__main__":
    main()
