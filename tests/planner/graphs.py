"""Small hand-made layer-call graphs for the planner tests. No Keras."""

import networkx as nx

from graphckpt.graph import TensorInfo


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
