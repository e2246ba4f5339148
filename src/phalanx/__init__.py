"""phalanx: N PyTorch models of one architecture run as one computation."""

from phalanx import data, distributed, metrics, optim, population, routing, testing
from phalanx._backends import BACKENDS, BackendRefusal
from phalanx._build import stack
from phalanx._checkpoint import CheckpointError, export_members, load, save
from phalanx._clip import clip_grad_norm_, clip_grad_value_
from phalanx._export import export
from phalanx._inplace import MemberView, StackedModuleList, stack_in_place, unstack_in_place
from phalanx._losses import member_losses
from phalanx._polyak import polyak_
from phalanx._split import merge, split
from phalanx._stack import Stack
from phalanx._step import CompiledStep, compile_step

__version__ = "0.1.0"


__all__ = [
    "BACKENDS",
    "BackendRefusal",
    "CheckpointError",
    "CompiledStep",
    "MemberView",
    "Stack",
    "StackedModuleList",
    "clip_grad_norm_",
    "clip_grad_value_",
    "compile_step",
    "data",
    "distributed",
    "export",
    "export_members",
    "load",
    "member_losses",
    "merge",
    "metrics",
    "optim",
    "polyak_",
    "population",
    "routing",
    "save",
    "split",
    "stack",
    "stack_in_place",
    "testing",
    "unstack_in_place",
]
