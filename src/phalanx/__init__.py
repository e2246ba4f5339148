"""phalanx: N PyTorch models of one architecture run as one computation.

``import phalanx`` loads only this file: every name below is imported from its module on first
use (``phalanx.stack`` loads the stack and its backends; ``phalanx.distributed`` the
distributed parts), so a script pays only for what it touches.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

# name -> the module that defines it; a name equal to its module's last part is the module.
_WHERE = {
    "BACKENDS": "phalanx.backends",
    "BackendRefusal": "phalanx.backends",
    "CheckpointError": "phalanx.checkpoint._single",
    "CompiledStep": "phalanx.step._api",
    "CompileWarning": "phalanx._warnings",
    "FallbackWarning": "phalanx._warnings",
    "HintWarning": "phalanx._warnings",
    "MemberGradScaler": "phalanx.train._scaler",
    "MemberView": "phalanx.core._inplace",
    "NonFiniteWarning": "phalanx._warnings",
    "PhalanxDeprecationWarning": "phalanx._warnings",
    "PhalanxWarning": "phalanx._warnings",
    "SharedInputWarning": "phalanx.core._input_warnings",
    "Stack": "phalanx.core._stack",
    "StackedModuleList": "phalanx.core._inplace",
    "clip_grad_norm_": "phalanx.train._clip",
    "clip_grad_value_": "phalanx.train._clip",
    "compile_step": "phalanx.step._api",
    "data": "phalanx.data",
    "distributed": "phalanx.distributed",
    "export": "phalanx.core._export",
    "export_members": "phalanx.checkpoint._single",
    "load": "phalanx.checkpoint._single",
    "member_losses": "phalanx.train._losses",
    "merge": "phalanx.core._split",
    "metrics": "phalanx.metrics",
    "optim": "phalanx.optim",
    "polyak_": "phalanx.core._polyak",
    "population": "phalanx.population",
    "routing": "phalanx.routing",
    "save": "phalanx.checkpoint._single",
    "split": "phalanx.core._split",
    "stack": "phalanx.core._build",
    "stack_in_place": "phalanx.core._inplace",
    "testing": "phalanx.testing",
    "unstack_in_place": "phalanx.core._inplace",
}

__all__ = [
    "BACKENDS",
    "BackendRefusal",
    "CheckpointError",
    "CompileWarning",
    "CompiledStep",
    "FallbackWarning",
    "HintWarning",
    "MemberGradScaler",
    "MemberView",
    "NonFiniteWarning",
    "PhalanxDeprecationWarning",
    "PhalanxWarning",
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

if TYPE_CHECKING:  # what type checkers and IDEs read; at run time __getattr__ imports these
    from phalanx import data, distributed, metrics, optim, population, routing, testing
    from phalanx._warnings import (
        CompileWarning,
        FallbackWarning,
        HintWarning,
        NonFiniteWarning,
        PhalanxDeprecationWarning,
        PhalanxWarning,
    )
    from phalanx.backends import BACKENDS, BackendRefusal
    from phalanx.checkpoint._single import CheckpointError, export_members, load, save
    from phalanx.core._build import stack
    from phalanx.core._export import export
    from phalanx.core._inplace import (
        MemberView,
        StackedModuleList,
        stack_in_place,
        unstack_in_place,
    )
    from phalanx.core._input_warnings import SharedInputWarning
    from phalanx.core._polyak import polyak_
    from phalanx.core._split import merge, split
    from phalanx.core._stack import Stack
    from phalanx.step._api import CompiledStep, compile_step
    from phalanx.train._clip import clip_grad_norm_, clip_grad_value_
    from phalanx.train._losses import member_losses
    from phalanx.train._scaler import MemberGradScaler


if not TYPE_CHECKING:  # hidden from type checkers, so that a misspelt name is an error there

    def __getattr__(name: str) -> Any:
        """Imports a public name's module on first use and keeps the name here (PEP 562)."""
        where = _WHERE.get(name)
        if where is None:
            raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
        module = importlib.import_module(where)
        value = module if where == f"phalanx.{name}" else getattr(module, name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
