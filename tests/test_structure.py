"""The package's shape: imports flow one way and modules stay small."""

import ast
import pathlib

import networkx as nx

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "graphckpt"
MAX_LINES = 450  # "about 400": the brief's limit, with room for a docstring


def _module(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph():
    """graphckpt module -> graphckpt modules it imports anywhere in its
    code (function-level imports included: a lazy import is still a
    dependency)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from graphckpt import errors` imports graphckpt.errors;
                # `from graphckpt import plan` would import graphckpt itself.
                subs = [f"{node.module}.{a.name}" for a in node.names]
                targets = [t for t in subs if t in modules] or [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph.add_edges_from((name, t) for t in targets if t in modules and t != name)
    return graph


def test_the_import_graph_is_found():
    graph = _import_graph()
    # The checks below are only as good as the graph: it must see known edges.
    assert graph.has_edge("graphckpt.checkpointed", "graphckpt.rewrite")
    assert graph.has_edge("graphckpt.estimate", "graphckpt.keras_rules")
    assert graph.has_edge("graphckpt.keras_rules", "graphckpt.hub_rules")  # a function-level import


def test_no_import_cycle():
    graph = _import_graph()
    assert list(nx.simple_cycles(graph)) == []


def test_no_module_is_long():
    lengths = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {p: n for p, n in lengths.items() if n > MAX_LINES} == {}
