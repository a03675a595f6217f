"""Layer-call graphs for the planner tests, hand-made and random. No Keras."""

import networkx as nx

from graphckpt.graph.build import TensorInfo
from graphckpt.planner.costs import NodeCosts
from graphckpt.planner.data import tensor_consumers


def chain(n, nbytes=10):
    """n calls in a line, `n0` .. `n{n-1}` after the input `x`, each making
    one `nbytes` tensor."""
    g = nx.DiGraph()
    names = ["x"] + [f"n{i}" for i in range(n)]
    for i, v in enumerate(names):
        g.add_node(v, kind="input" if i == 0 else "layer", position=i)
    for u, v in zip(names, names[1:]):
        g.add_edge(u, v, tensors=((u, 0, 0),))
    g.graph["tensors"] = {(v, 0, 0): TensorInfo((v, 0, 0), v, (None,), "float32", nbytes) for v in names}
    g.graph["inputs"], g.graph["outputs"] = [("x", 0, 0)], [(names[-1], 0, 0)]
    return g


def random_costs(rnd, graph, names, compute, **fields):
    """`NodeCosts` drawn from `rnd` for a graph's tensors and its calls
    `names`: bytes from 1 to 300, 70% of tensors kept for backward, some
    internal and workspace bytes; `compute()` draws each call's cost."""
    keys = list(graph.graph["tensors"])
    return NodeCosts(
        tensor_bytes={k: rnd.choice([1, 2, 5, 40, 300]) for k in keys},
        saved=frozenset(k for k in keys if rnd.random() < 0.7),
        internal={v: rnd.choice([0, 0, 3, 80]) for v in names},
        workspace={v: rnd.choice([0, 10, 50]) for v in names},
        compute={v: compute() for v in names},
        fixed=rnd.choice([0, 7]),
        **fields,
    )


def dag(n, reads, side_output):
    """A layer-call graph in graph/layer_graph.py's schema: the input `x`, then calls
    `n0` .. `n{n-1}`, each making one 4-byte tensor and reading the one
    before it and `reads(i, earlier)` (a set drawn from `earlier`, the
    tensors made before call i); the last call is an output, and so is
    `side_output(names)` unless None. The random generators below and in
    tests/planner/casefile.py and tests/test_budget.py draw through these
    two functions, in that order."""
    g = nx.DiGraph()
    g.add_node("x", kind="input", position=0)
    names = [f"n{i}" for i in range(n)]
    for i, v in enumerate(names):
        g.add_node(v, kind="layer", position=i + 1)
        earlier = ["x"] + names[:i]
        for u in sorted({earlier[-1]} | reads(i, earlier)):
            g.add_edge(u, v, tensors=((u, 0, 0),))
    g.graph["tensors"] = {(v, 0, 0): TensorInfo((v, 0, 0), v, (None, 1), "float32", 4) for v in ["x"] + names}
    g.graph["inputs"] = [("x", 0, 0)]
    side = side_output(names)
    g.graph["outputs"] = [(v, 0, 0) for v in [names[-1]] + ([] if side is None else [side])]
    g.graph["state_chains"] = []
    return g, names


def random_dag(rnd, n, chain):
    """A layer-call graph in graph/layer_graph.py's schema: a chain, or a random DAG
    (calls reading 1-3 earlier tensors, a side output sometimes)."""
    return dag(
        n,
        lambda i, earlier: set() if chain else {rnd.choice(earlier) for _ in range(rnd.choice([0, 0, 1, 2]))},
        lambda names: None if chain or rnd.random() < 0.7 else rnd.choice(names[:-1]),
    )


def random_reads(rnd, graph):
    """`NodeCosts.reads` drawn from `rnd`: each call reads about half of its
    input tensors in its backward."""
    consumers = tensor_consumers(graph)
    reads = {}
    for key in graph.graph["tensors"]:
        for c in consumers.get(key, ()):
            if rnd.random() < 0.5:
                reads.setdefault(c, set()).add(key)
    return {c: frozenset(k) for c, k in reads.items()}
