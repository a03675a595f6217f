"""The package's shape: imports flow one way and modules stay small."""

import ast
import shutil

import networkx as nx

from tests import structure
from tests.structure import PACKAGE, import_graph

MAX_LINES = 450  # "about 400": the brief's limit, with room for a docstring


def test_the_import_graph_is_found():
    graph = import_graph()
    # The checks below are only as good as the graph: it must see known edges.
    assert graph.has_edge("graphckpt.runtime.checkpointed", "graphckpt.runtime.rewrite")
    assert graph.has_edge("graphckpt.estimator.peak", "graphckpt.estimator.keras_rules")
    assert graph.has_edge("graphckpt.estimator.keras_rules", "graphckpt.estimator.hub_rules")  # a function-level import


def test_no_import_cycle():
    graph = import_graph()
    assert list(nx.simple_cycles(graph)) == []


def test_units_import_only_lower_layers():
    """graph -> planner -> estimator | runtime -> api -> training -> cli
    (tests/structure.py, `LAYERS`): runtime never imports the estimator, the
    planner imports only the graph's Keras-free contract, and every new
    top-level module or package must be given a layer."""
    assert structure.violations() == []


def test_a_planted_back_import_is_found(tmp_path):
    """The graph imports nothing of the runtime; one line that does, and a
    new top-level module no layer names, are each reported."""
    copy = tmp_path / "graphckpt"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.json"))
    assert structure.violations(copy) == []
    build = copy / "graph" / "build.py"
    build.write_text(build.read_text() + "\n\ndef _late():\n    from graphckpt.runtime import segment\n")
    (copy / "helpers.py").write_text("from graphckpt import errors\n")
    assert structure.violations(copy) == ["helpers: in no layer of LAYERS", "graph -> runtime"]


def test_how_it_works_shows_the_layers_as_the_imports_make_them():
    """docs/how-it-works.md's table is generated from the code: after a
    move, `python -m tests.structure` rewrites it."""
    assert structure.documented() == structure.layers_markdown()


def test_no_module_has_the_name_of_a_public_function_or_class():
    """A submodule is bound on the package when it is imported: one named
    like a public name (`graphckpt/plan.py` was) would hide it."""
    import graphckpt

    names = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert names & set(graphckpt.__all__) == {"policies"}  # a module, documented as one


def test_no_module_is_long():
    lengths = {str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {p: n for p, n in lengths.items() if n > MAX_LINES} == {}


def _private_uses(path):
    """Private names of other graphckpt modules that `path` imports or reads
    (`from graphckpt.x import _y`, `x._y` on an imported graphckpt module)."""
    tree = ast.parse(path.read_text())
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("graphckpt"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{node.module}.{alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname or a.name for a in node.names if a.name == "graphckpt")
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_modules_use_only_each_others_public_names():
    uses = {str(p.relative_to(PACKAGE.parent)): _private_uses(p) for p in PACKAGE.rglob("*.py")}
    assert {p: u for p, u in uses.items() if u} == {}


def test_private_uses_are_found(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import graphckpt\nfrom graphckpt import api\nfrom graphckpt.graph.build import _x\napi._y(graphckpt._z)\n")
    assert sorted(_private_uses(probe)) == ["api._y", "graphckpt._z", "graphckpt.graph.build._x"]


# Private Keras names read outside keras_compat: graphckpt's own marks on
# Keras objects, and the two overrides keras_compat's docstring names.
_OWN_MARKS = ("_graphckpt",)
_OVERRIDES = {"super()._run_through_graph", "def _run_through_graph", "def _obj_type"}
_PRIVATE_MODULES = ("keras.src", "keras_hub.src", "tensorflow.python", "jax._src", "torch._")


def _keras_private_names():
    """The private attributes and methods of Keras's layers and models (on
    the classes and on built instances), which `self._x` in a subclass of
    them reads or overrides."""
    import keras

    inp = keras.Input((2,))
    model = keras.Model(inp, keras.layers.Dense(2)(inp))
    saveable = type(model).__mro__[[c.__name__ for c in type(model).__mro__].index("KerasSaveable")]
    names = set()
    for obj in (keras.layers.Layer, keras.Model, type(model), saveable, model, model.layers[1]):
        names |= {n for n in dir(obj) if n.startswith("_") and not n.startswith("__")}
        names |= {n for n in vars(obj) if n.startswith("_") and not n.startswith("__")}
    return names


def _private_keras_uses(path, keras_names=frozenset()):
    """Private Keras (or keras_hub, TensorFlow, JAX, torch) names that
    `path` reads: `x._y` on anything but `self`/`cls`; `self._y` and `def
    _y` where `_y` is one of Keras's own (`keras_names`); a private name
    read with `getattr`/`hasattr`/`setattr`; imports of private modules and
    their paths spelled in strings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls") and node.attr not in keras_names:
                continue  # a class's own attributes
            if node.attr.startswith(_OWN_MARKS) or ast.unparse(node) in _OVERRIDES:
                continue
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in keras_names:
                    if f"def {item.name}" not in _OVERRIDES:
                        found.append(f"{item.lineno}: def {item.name}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str):
                    if name.value.startswith("_") and not name.value.startswith(("__",) + _OWN_MARKS):
                        found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value.startswith(_PRIVATE_MODULES):
                found.append(f"{node.lineno}: '{node.value}'")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(_PRIVATE_MODULES):
            found.append(f"{node.lineno}: from {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.startswith(_PRIVATE_MODULES)]
    return found


def test_only_keras_compat_reads_private_keras_names():
    names = _keras_private_names()
    uses = {
        str(p.relative_to(PACKAGE.parent)): _private_keras_uses(p, names)
        for p in PACKAGE.rglob("*.py")
        if not p.name.startswith("keras_compat")  # keras_compat.py, keras_compat_attention.py
    }
    assert {p: u for p, u in uses.items() if u} == {}
    assert _private_keras_uses(PACKAGE / "keras_compat.py", names)  # the check finds them where they are


def test_planted_private_keras_uses_are_found(tmp_path):
    """Each way of reaching Keras's internals, planted in a module, is found."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import keras_hub.src.models\n"
        "from keras.src import backend\n"
        "class Block(keras.layers.Layer):\n"
        "    def __init__(self):\n"
        "        self._convert_input_args = False\n"
        "        self._mine = 1\n"
        "    def _maybe_build(self, spec):\n"
        "        pass\n"
        "x = layer._inbound_nodes\n"
        "y = getattr(layer, '_call_context_args', ())\n"
        "z = getattr(layer, '_graphckpt_recipe', None)\n"
        "m = importlib.import_module('keras_hub.src.layers')\n"
    )
    found = [use.split(": ", 1)[1] for use in _private_keras_uses(probe, _keras_private_names())]
    assert sorted(found) == sorted(
        [
            "import keras_hub.src.models",
            "from keras.src",
            "self._convert_input_args",
            "def _maybe_build",
            "layer._inbound_nodes",
            "getattr(layer, '_call_context_args', ())",
            "'keras_hub.src.layers'",
        ]
    )


def _graphckpt_imports(path):
    """(module, name) of each `from graphckpt... import name` in `path`,
    function-level imports included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("graphckpt"):
            for alias in node.names:
                yield node.module, alias.name


def test_benchmarks_and_tests_import_what_the_package_has():
    """A benchmark is run by hand, not by CI: after a refactor its imports
    are the first thing to break (benchmarks/plan_time.py did)."""
    import importlib

    root = PACKAGE.parent
    missing = []
    for path in sorted((root / "benchmarks").rglob("*.py")) + sorted((root / "tests").rglob("*.py")):
        for module, name in _graphckpt_imports(path):
            try:
                found = importlib.import_module(module)
            except ImportError as e:
                missing.append(f"{path.name}: {module} ({e})")
                continue
            if not hasattr(found, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ImportError:
                    missing.append(f"{path.name}: {module}.{name}")
    assert missing == []
