"""phalanx: N PyTorch models of one architecture run as one computation."""

from phalanx import _backends as _backends
from phalanx._losses import member_losses
from phalanx._split import merge, split
from phalanx._stack import Stack, stack

__version__ = "0.1.0"

__all__ = [
    "Stack",
    "member_losses",
    "merge",
    "split",
    "stack",
]
