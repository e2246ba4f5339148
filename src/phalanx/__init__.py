"""phalanx: N PyTorch models of one architecture run as one computation."""

from phalanx import _backends as _backends
from phalanx import data, distributed, metrics, optim
from phalanx._checkpoint import export_members, load, save
from phalanx._clip import clip_grad_norm_, clip_grad_value_
from phalanx._losses import member_losses
from phalanx._split import merge, split
from phalanx._stack import Stack, stack

__version__ = "0.1.0"

__all__ = [
    "Stack",
    "clip_grad_norm_",
    "clip_grad_value_",
    "data",
    "distributed",
    "export_members",
    "load",
    "member_losses",
    "merge",
    "metrics",
    "optim",
    "save",
    "split",
    "stack",
]
