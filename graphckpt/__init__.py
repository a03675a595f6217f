"""graphckpt: gradient checkpointing for Keras 3 functional models."""

from graphckpt import policies
from graphckpt.api import checkpoint_model, is_checkpointed, plan
from graphckpt.checkpointed import CheckpointedModel, uncheckpoint
from graphckpt.estimate import MemoryEstimate, estimate
from graphckpt.errors import (
    GraphckptError,
    InfeasibleBudgetError,
    InvalidArgumentError,
    NotAModelError,
    UnsupportedModelError,
)
from graphckpt.fit import install, uninstall
from graphckpt.plan import Plan
from graphckpt.segment import Segment

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
