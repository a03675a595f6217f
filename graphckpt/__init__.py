"""graphckpt: gradient checkpointing for Keras 3 functional models.

The names that need Keras (everything but the errors and `Plan`) load on
first use, so the pure planner (`graphckpt.plan`, `graphckpt.planner`)
imports without Keras or a backend.
"""

import importlib
import sys
import types

from graphckpt import plan as _plan_module  # noqa: F401 - loaded first: the function `plan` shadows it
from graphckpt.errors import (
    GraphckptError,
    InfeasibleBudgetError,
    InvalidArgumentError,
    NotAModelError,
    UnsupportedModelError,
)
from graphckpt.plan import Plan

__version__ = "0.1.0"

__all__ = [
    "checkpoint_model",
    "plan",
    "is_checkpointed",
    "estimate",
    "MemoryEstimate",
    "policies",
    "uncheckpoint",
    "install",
    "uninstall",
    "CheckpointedModel",
    "Plan",
    "Segment",
    "GraphckptError",
    "NotAModelError",
    "UnsupportedModelError",
    "InvalidArgumentError",
    "InfeasibleBudgetError",
]

# name -> the module that defines it (None: the submodule of that name).
_LAZY = {
    "checkpoint_model": "graphckpt.api",
    "plan": "graphckpt.api",
    "is_checkpointed": "graphckpt.api",
    "CheckpointedModel": "graphckpt.checkpointed",
    "uncheckpoint": "graphckpt.checkpointed",
    "MemoryEstimate": "graphckpt.estimate",
    "estimate": "graphckpt.estimate",
    "install": "graphckpt.fit",
    "uninstall": "graphckpt.fit",
    "Segment": "graphckpt.segment",
    "policies": None,
}
# Functions named like their submodule: importing the submodule must not
# replace the function on the package (as Python's import system does).
_SHADOWED = frozenset({"plan", "estimate"})


def _load_all():
    """Imports every lazy name at once, as an eager `__init__` would: the
    Keras modules import one another, and the functions must end up bound
    over the submodules they shadow."""
    for name, module in _LAZY.items():
        value = importlib.import_module(f"graphckpt.{name}" if module is None else module)
        globals()[name] = value if module is None else getattr(value, name)


class _Package(types.ModuleType):
    def __getattr__(self, name):
        if name in _LAZY:
            _load_all()
            return globals()[name]
        raise AttributeError(f"module 'graphckpt' has no attribute {name!r}")

    def __setattr__(self, name, value):
        if name in _SHADOWED and isinstance(value, types.ModuleType):
            return  # a submodule import: keep the function (loaded on first use)
        super().__setattr__(name, value)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(_LAZY))


del plan  # the submodule, bound by the imports above; `plan` is the function, loaded on first use
sys.modules[__name__].__class__ = _Package
