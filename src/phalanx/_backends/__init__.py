"""Backends: stateless strategies that compute a forward pass for all members at once.

A backend is an object with a ``name`` and a ``forward(stack, args, kwargs, in_dims)`` method
that reads the stack's stacked tensors and returns the members' outputs stacked on dim 0. The
``loop`` backend is the specification; every other backend is tested against it. Backends are
looked up by name and imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from phalanx._stack import Stack

BACKENDS = ("fused", "vmap", "loop")
_MODULES = {"loop": "._loop", "vmap": "._vmap", "fused": "._fused"}


class Backend(Protocol):
    name: str

    def forward(
        self,
        stack: Stack,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: tuple[int | None, ...],
    ) -> Any: ...


_loaded: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """Returns the backend called ``name`` ("fused", "vmap" or "loop")."""
    if name not in _loaded:
        module = importlib.import_module(_MODULES[name], __name__)
        _loaded[name] = module.BACKEND
    return _loaded[name]
