"""phalanx: N PyTorch models of one architecture run as one computation."""

from typing import Any

from phalanx import data, metrics, optim, population
from phalanx._checkpoint import CheckpointError, export_members, load, save
from phalanx._clip import clip_grad_norm_, clip_grad_value_
from phalanx._export import export
from phalanx._losses import member_losses
from phalanx._split import merge, split
from phalanx._stack import Stack, stack
from phalanx._step import CompiledStep, compile_step

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # phalanx.distributed imports torch.distributed: only on first use.
    if name == "distributed":
        import importlib

        return importlib.import_module("phalanx.distributed")
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "CompiledStep",
    "Stack",
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
    "population",
    "save",
    "split",
    "stack",
]
