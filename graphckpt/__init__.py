"""graphckpt: gradient checkpointing for Keras 3 functional models.

The public API is the names in `__all__` (docs/api.md), with the modules
`graphckpt.policies` and `graphckpt.measure`; every other module is internal.

`import graphckpt` imports no framework, so that the `graphckpt` command
answers `--help` and argument errors without TensorFlow, and the pure
planner (`graphckpt.planner`) runs where no Keras is installed. The errors
are plain Python and load with the package; `Plan` loads the planner on
first use; the other names import Keras and graphckpt's Keras-side modules
on first use (a module `__getattr__`, PEP 562), all of them at once.

Loading a checkpointed `.keras` file needs graphckpt's layer and model
classes registered with Keras (`keras.saving.register_keras_serializable`,
at their definition): they are once the Keras side has loaded, that is
after the first use of any of its names (`from graphckpt import
CheckpointedModel`), or at `import graphckpt` itself when Keras was already
imported (nothing is saved by waiting then).
"""

import importlib
import sys

from graphckpt.errors import (
    GraphckptError,
    GraphckptWarning,
    InfeasibleBudgetError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    NotAModelError,
    UnknownDimensionWarning,
    UnsupportedModelError,
    WeightsFileError,
    WeightsFileNotFoundError,
)

__version__ = "0.1.0"

# Public names that need Keras: name -> the module that defines it.
_KERAS_SIDE = {
    "checkpoint_model": "graphckpt.api",
    "plan": "graphckpt.api",
    "is_checkpointed": "graphckpt.api",
    "estimate": "graphckpt.estimator.peak",
    "MemoryEstimate": "graphckpt.estimator.peak",
    "register_layer_rule": "graphckpt.estimator.rules",
    "LayerRule": "graphckpt.estimator.rules",
    "uncheckpoint": "graphckpt.runtime.checkpointed",
    "CheckpointedModel": "graphckpt.runtime.checkpointed",
    "install": "graphckpt.training.flag",
    "fit": "graphckpt.training.flag",
    "uninstall": "graphckpt.training.flag",
    "Segment": "graphckpt.runtime.segment",
}
# Public names that import no Keras.
_KERAS_FREE = {"Plan": "graphckpt.planner"}

__all__ = [
    "checkpoint_model",
    "plan",
    "is_checkpointed",
    "estimate",
    "MemoryEstimate",
    "register_layer_rule",
    "LayerRule",
    "policies",
    "uncheckpoint",
    "install",
    "fit",
    "uninstall",
    "CheckpointedModel",
    "Plan",
    "Segment",
    "GraphckptError",
    "NotAModelError",
    "UnsupportedModelError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InfeasibleBudgetError",
    "WeightsFileError",
    "WeightsFileNotFoundError",
    "GraphckptWarning",
    "UnknownDimensionWarning",
]


def load_api():
    """Imports graphckpt's Keras side (and so Keras) and binds its public
    names here, which registers graphckpt's classes with Keras: what the
    first use of one of those names does, for a caller that needs it at a
    time of its own (the CLI, after it imported Keras quietly). Calling it
    again does nothing."""
    modules = {module: importlib.import_module(module) for module in set(_KERAS_SIDE.values())}
    globals().update({name: getattr(modules[module], name) for name, module in _KERAS_SIDE.items()})


def __getattr__(name):
    # Called only for names not bound yet (PEP 562).
    if name in _KERAS_SIDE:
        load_api()
        return globals()[name]
    if name in _KERAS_FREE:
        value = getattr(importlib.import_module(_KERAS_FREE[name]), name)
        globals()[name] = value
        return value
    if name == "policies":
        # A submodule: importing it binds it here.
        return importlib.import_module("graphckpt.policies")
    raise AttributeError(f"module 'graphckpt' has no attribute {name!r}")


def __dir__():
    # The public names (loaded or not), not the modules this file imports.
    return sorted((set(globals()) - {"importlib", "sys"}) | set(__all__))


if "keras" in sys.modules:
    load_api()
