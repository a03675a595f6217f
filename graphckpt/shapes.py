"""Deprecated alias of `graphckpt.graph.shapes`, kept for
`graphckpt.shapes.UnknownDimensionWarning`: use
`graphckpt.UnknownDimensionWarning`."""

import warnings

from graphckpt.errors import UnknownDimensionWarning

__all__ = ["UnknownDimensionWarning"]

warnings.warn(
    "graphckpt.shapes is deprecated and will be removed: use graphckpt.UnknownDimensionWarning.",
    DeprecationWarning,
    stacklevel=2,
)
