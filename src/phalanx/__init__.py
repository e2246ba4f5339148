"""phalanx: N PyTorch models of one architecture run as one computation."""

from phalanx import data, distributed, metrics, optim, population, routing, testing
from phalanx.backends import BACKENDS, BackendRefusal
from phalanx.checkpoint._single import CheckpointError, export_members, load, save
from phalanx.core._build import stack
from phalanx.core._export import export
from phalanx.core._inplace import MemberView, StackedModuleList, stack_in_place, unstack_in_place
from phalanx.core._input_warnings import SharedInputWarning
from phalanx.core._polyak import polyak_
from phalanx.core._split import merge, split
from phalanx.core._stack import Stack
from phalanx.step._api import CompiledStep, compile_step
from phalanx.train._clip import clip_grad_norm_, clip_grad_value_
from phalanx.train._losses import member_losses
from phalanx.train._scaler import MemberGradScaler

__version__ = "0.1.0"


__all__ = [
    "BACKENDS",
    "BackendRefusal",
    "CheckpointError",
    "CompiledStep",
    "MemberGradScaler",
    "MemberView",
    "SharedInputWarning",
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
