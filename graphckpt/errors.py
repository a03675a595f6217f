"""The errors and warnings graphckpt raises.

Every error is a `GraphckptError`. Each also derives from the builtin that
fits it (`TypeError` or `ValueError`), so `except ValueError` keeps working.
Messages say what was received, what was expected, and end with a tip.
Every warning is a `GraphckptWarning` (a `UserWarning`): filter graphckpt's
warnings by it, and the `graphckpt` command labels only these as its own.
"""

__all__ = [
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


class GraphckptError(Exception):
    """Base class of all graphckpt errors."""


class NotAModelError(GraphckptError, TypeError):
    """The object passed is not a Keras model."""


class UnsupportedModelError(GraphckptError, ValueError):
    """A Keras model graphckpt cannot rewrite (subclassed, unbuilt, ...)."""


class InvalidArgumentError(GraphckptError, ValueError):
    """An argument has a value outside the accepted set."""


class InvalidArgumentTypeError(GraphckptError, TypeError):
    """An argument of the wrong type (a model that is not one: `NotAModelError`)."""


class InfeasibleBudgetError(InvalidArgumentError):
    """A memory budget below what any plan can reach."""


class WeightsFileError(GraphckptError, OSError):
    """A weights file that could not be read (unreadable or corrupt): an
    `OSError`, as Keras raises for the plain model, so callbacks that fall
    back on `except OSError` (`BackupAndRestore`) do so here too."""


class WeightsFileNotFoundError(WeightsFileError, FileNotFoundError):
    """A weights file that does not exist (a `FileNotFoundError`, as Keras's)."""


class GraphckptWarning(UserWarning):
    """Base class of graphckpt's warnings."""


class UnknownDimensionWarning(GraphckptWarning):
    """Estimates count an unknown non-batch dimension as 1."""
