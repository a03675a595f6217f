"""graphckpt: gradient checkpointing for Keras 3 functional models.

`import graphckpt` does not import Keras (and so TensorFlow, JAX or torch)
by itself: the public names below load on first use, or as soon as Keras is
imported, whichever comes first. Both register graphckpt's layer and model
classes with Keras, so `import graphckpt` before `keras.saving.load_model`
still loads a checkpointed model. The `graphckpt` command relies on this to
answer `--help` and argument errors without importing TensorFlow.
"""

import importlib
import sys
import types

from graphckpt.errors import (
    GraphckptError,
    GraphckptWarning,
    InfeasibleBudgetError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    NotAModelError,
    UnsupportedModelError,
    WeightsFileError,
    WeightsFileNotFoundError,
)

__version__ = "0.1.0"

# Public name -> (module, attribute); attribute None: the module itself.
_LAZY = {
    "checkpoint_model": ("graphckpt.api", "checkpoint_model"),
    "plan": ("graphckpt.api", "plan"),
    "is_checkpointed": ("graphckpt.api", "is_checkpointed"),
    "estimate": ("graphckpt.estimator", "estimate"),
    "MemoryEstimate": ("graphckpt.estimator", "MemoryEstimate"),
    "register_layer_rule": ("graphckpt.rules", "register_layer_rule"),
    "LayerRule": ("graphckpt.rules", "LayerRule"),
    "policies": ("graphckpt.policies", None),
    "uncheckpoint": ("graphckpt.checkpointed", "uncheckpoint"),
    "install": ("graphckpt.fit_flag", "install"),
    "fit": ("graphckpt.fit_flag", "fit"),
    "uninstall": ("graphckpt.fit_flag", "uninstall"),
    "CheckpointedModel": ("graphckpt.checkpointed", "CheckpointedModel"),
    "Plan": ("graphckpt.planner", "Plan"),
    "Segment": ("graphckpt.segment", "Segment"),
}

__all__ = [
    *_LAZY,
    "GraphckptError",
    "NotAModelError",
    "UnsupportedModelError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InfeasibleBudgetError",
    "WeightsFileError",
    "WeightsFileNotFoundError",
    "GraphckptWarning",
]

# Names whose modules import no Keras.
_KERAS_FREE = frozenset({"Plan"})

_state = {"loading": False, "loaded": False}


def load_api():
    """Imports every public name (and so Keras) once: what the first use of
    a public name does, for a caller that needs it at a time of its own
    (the CLI, after it imported Keras quietly).

    The names are bound after all the modules are imported: importing the
    submodules `graphckpt.plan` and `graphckpt.estimate` binds those names
    to the modules, and the functions of the same names must win.
    """
    if _state["loaded"] or _state["loading"]:
        return
    _state["loading"] = True
    try:
        modules = {module: importlib.import_module(module) for module, _ in _LAZY.values()}
        for name, (module, attribute) in _LAZY.items():
            globals()[name] = modules[module] if attribute is None else getattr(modules[module], attribute)
        _state["loaded"] = True
    finally:
        _state["loading"] = False


def __getattr__(name):
    # Only called for names not bound yet. While loading, a submodule's
    # `from graphckpt import policies` must fall through to importing it,
    # and so must `from graphckpt import <submodule>` for any other name.
    if name not in _LAZY or _state["loading"]:
        raise AttributeError(f"module 'graphckpt' has no attribute {name!r}")
    if name in _LAZY and (_LAZY[name][1] is None or name in _KERAS_FREE):
        # A Keras-free name stays cheap: the planner imports without a backend.
        module = importlib.import_module(_LAZY[name][0])
        return module if _LAZY[name][1] is None else getattr(module, _LAZY[name][1])
    load_api()
    if name in globals():
        return globals()[name]
    raise AttributeError(f"module 'graphckpt' has no attribute {name!r}")


def __dir__():
    # The public names (loaded or not), not the modules this file imports.
    return sorted((set(globals()) - {"importlib", "sys", "types"}) | set(__all__))


def _graphckpt_module_initializing():
    """Whether a graphckpt module is half-imported: loading the API then
    would import it again, circularly."""
    return any(
        getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
        if name == __name__ or name.startswith(__name__ + ".")
    )


class _LoadWithKeras:
    """A `sys.meta_path` finder that loads graphckpt's API right after Keras
    is first imported, so that its classes are registered for
    `keras.saving.load_model`. It finds nothing itself: it only wraps the
    loader of the spec the other finders return for `keras`."""

    def find_spec(self, name, path=None, target=None):
        if name != "keras":
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec

        def exec_module(module):
            del loader.exec_module  # the loader's own method again, for a reload
            type(loader).exec_module(loader, module)
            _remove_hook()
            if not _graphckpt_module_initializing():
                load_api()

        loader.exec_module = exec_module
        return spec


def _remove_hook():
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _LoadWithKeras)]


class _Package(types.ModuleType):
    """The package's module type: the import system binds each submodule
    on the package as it is first imported, and `graphckpt.plan` and
    `graphckpt.estimate` are also the names of public functions. A
    submodule imported before the API loads (`from graphckpt.estimate
    import node_costs`) must not hide the function of its name: the
    binding is skipped, and the name loads with the API on first use."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and name in _LAZY and _LAZY[name][1] is not None:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


if "keras" in sys.modules:
    load_api()  # Keras is there already: nothing to save by waiting
else:
    sys.meta_path.insert(0, _LoadWithKeras())
