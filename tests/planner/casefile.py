"""Planner regression cases: a layer-call graph and its `NodeCosts`, stored
as data, with the planner's answers to a list of queries.

A case file (gzipped JSON) holds what the pure planner reads of a real
model's graph (node `kind` and `position`, edge `tensors`, tensor
producers and bytes, outputs, state chains), the costs
`graphckpt.estimator.peak.node_costs` made for it, and for each query
(`plan_segments`, `plan_for_budget`, `smallest_peak`, `baseline_peak`) the
answer the planner gave when the file was written. `make_cases.py` writes
the files (it needs Keras); `test_regression.py` replays the queries with
the planner of today and compares (it needs no Keras).

This module imports no Keras.
"""

import gzip
import hashlib
import json
import os
import random

import networkx as nx

from graphckpt.graph.build import TensorInfo
from graphckpt.planner import (
    BudgetInfeasible,
    NodeCosts,
    baseline_peak,
    estimated_peak,
    plan_for_budget,
    plan_segments,
    segment_peaks,
    smallest_peak,
)
from tests.planner.graphs import dag, random_costs

CASES_DIR = os.path.join(os.path.dirname(__file__), "cases")


def _enc(key):
    """A node or tensor key -> JSON (tuples become lists)."""
    return [_enc(k) for k in key] if isinstance(key, (tuple, list)) else key


def _dec(value):
    """JSON -> a node or tensor key (lists become tuples)."""
    return tuple(_dec(v) for v in value) if isinstance(value, list) else value


def encode_graph(graph):
    """The parts of a layer-call graph the planner reads, as JSON data.

    Predecessors are listed per node, in the graph's order, so that a
    decoded graph walks them in the same order."""
    nodes = []
    for v, data in graph.nodes(data=True):
        preds = [[_enc(u), [_enc(t) for t in graph.edges[u, v]["tensors"]]] for u in graph.predecessors(v)]
        nodes.append({"key": _enc(v), "kind": data["kind"], "position": data["position"], "preds": preds})
    tensors = [
        [_enc(k), _enc(info.producer), [d for d in info.shape], info.dtype, int(info.nbytes)]
        for k, info in graph.graph["tensors"].items()
    ]
    return {
        "nodes": nodes,
        "tensors": tensors,
        "inputs": [_enc(t) for t in graph.graph["inputs"]],
        "outputs": [_enc(t) for t in graph.graph["outputs"]],
        "state_chains": [[_enc(v) for v in chain] for chain in graph.graph.get("state_chains", ())],
    }


def decode_graph(data):
    """The inverse of `encode_graph`: a `networkx.DiGraph` in graph/layer_graph.py's schema."""
    g = nx.DiGraph()
    for node in data["nodes"]:
        g.add_node(_dec(node["key"]), kind=node["kind"], position=node["position"])
    for node in data["nodes"]:
        for u, tensors in node["preds"]:
            g.add_edge(_dec(u), _dec(node["key"]), tensors=tuple(_dec(t) for t in tensors))
    g.graph["tensors"] = {
        _dec(k): TensorInfo(_dec(k), _dec(p), tuple(shape), dtype, nbytes) for k, p, shape, dtype, nbytes in data["tensors"]
    }
    g.graph["inputs"] = [_dec(t) for t in data["inputs"]]
    g.graph["outputs"] = [_dec(t) for t in data["outputs"]]
    g.graph["state_chains"] = [tuple(_dec(v) for v in chain) for chain in data["state_chains"]]
    return g


def encode_costs(costs):
    def pairs(d):
        return [[_enc(k), v] for k, v in d.items()]

    return {
        "tensor_bytes": [[_enc(k), int(v)] for k, v in costs.tensor_bytes.items()],
        "saved": sorted((_enc(k) for k in costs.saved), key=json.dumps),
        "internal": [[_enc(k), int(v)] for k, v in costs.internal.items()],
        "workspace": [[_enc(k), int(v)] for k, v in costs.workspace.items()],
        "compute": pairs({k: float(v) for k, v in costs.compute.items()}),
        "fixed": int(costs.fixed),
        "per_example": bool(costs.per_example),
    }


def decode_costs(data):
    def mapping(pairs):
        return {_dec(k): v for k, v in pairs}

    return NodeCosts(
        tensor_bytes=mapping(data["tensor_bytes"]),
        saved=frozenset(_dec(k) for k in data["saved"]),
        internal=mapping(data["internal"]),
        workspace=mapping(data["workspace"]),
        compute=mapping(data["compute"]),
        fixed=data["fixed"],
        per_example=data["per_example"],
    )


def _digest(plan):
    """A hash of everything in the plan (nodes, inputs, outputs, flags)."""
    return hashlib.sha256(json.dumps(plan.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _plan_answer(graph, plan, costs):
    peaks = segment_peaks(graph, plan, costs)
    return {
        "boundaries": list(plan.boundaries),
        "remat": [s.remat for s in plan.segments],
        "estimated_peak_bytes": plan.estimated_peak_bytes,
        "baseline_peak_bytes": plan.baseline_peak_bytes,
        "peak": int(estimated_peak(graph, plan, costs)),
        "segment_peaks": [[p.held_before_bytes, p.held_bytes, p.recompute_peak_bytes, p.peak_bytes, p.recompute_cost] for p in peaks],
        "digest": _digest(plan),
    }


def answer(graph, costs, query):
    """The planner's answer to one query, as JSON data.

    Queries: `{"kind": "segments", "segments": "auto" | "sqrt" | k,
    "graph_costs": bool}`, `{"kind": "budget", "budget_bytes": int, "keep":
    [...]}`, `{"kind": "smallest", "keep": [...]}`, `{"kind": "baseline"}`.
    """
    kind = query["kind"]
    keep = [_dec(v) for v in query.get("keep", ())]
    if kind == "segments":
        plan = plan_segments(graph, segments=query["segments"], costs=None if query.get("graph_costs") else costs)
        return _plan_answer(graph, plan, costs)
    if kind == "budget":
        try:
            # As recorded: plans of one level (no segment cut again).
            plan = plan_for_budget(graph, costs, query["budget_bytes"], keep=keep, two_level=False)
        except BudgetInfeasible as e:
            return {"infeasible": int(e.smallest_bytes)}
        return _plan_answer(graph, plan, costs)
    if kind == "smallest":
        return {"smallest": int(smallest_peak(graph, costs, keep=keep))}
    if kind == "baseline":
        return {"baseline": int(baseline_peak(graph, costs))}
    raise ValueError(f"unknown query kind {kind!r}")


def write_case(path, name, graph, costs, queries, answers, meta):
    data = {
        "name": name,
        "meta": meta,
        "graph": encode_graph(graph),
        "costs": encode_costs(costs),
        "queries": queries,
        "answers": answers,
    }
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump(data, f, separators=(",", ":"))


def read_case(path):
    """`(data, graph, costs)` of a case file."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    return data, decode_graph(data["graph"]), decode_costs(data["costs"])


def case_paths():
    return sorted(os.path.join(CASES_DIR, f) for f in os.listdir(CASES_DIR) if f.endswith(".json.gz"))


def random_graph(seed, n):
    """A random DAG in graph/layer_graph.py's schema (one tensor per call, 1-3 inputs,
    a side output sometimes), with random costs; unit compute on even seeds
    so that many plans tie."""
    rnd = random.Random(seed)
    g, names = dag(
        n,
        lambda i, earlier: {rnd.choice(earlier) for _ in range(rnd.choice([0, 0, 1, 2]))},
        lambda names: rnd.choice(names[:-1]) if rnd.random() < 0.3 else None,
    )
    costs = random_costs(rnd, g, names, lambda: 1.0 if seed % 2 == 0 else rnd.choice([1.0, 2.5, 1e6, 3.3e9]))
    keep = [v for v in names if rnd.random() < 0.15]
    return g, costs, keep
