"""Backends: stateless strategies that compute a forward pass for all members at once.

A backend is an object with a ``name`` and a ``forward(view, args, kwargs, in_dims, kw_dims)``
method (``kw_dims``: the names of the keyword inputs that are per-member, ``(N, ...)``)
that reads the stack through a :class:`StackView` (a narrow, read-only view: the member
count, the module holding the stacked tensors, the stacked tensors by name, and one cache
dictionary per backend) and returns the members' outputs stacked on dim 0. A backend that
cannot run an architecture or an input exactly raises :class:`BackendRefusal`, whatever the
cause; ``auto`` hands over to the next backend on it.

The ``loop`` backend is the specification; every other backend is tested against it.
Backends are looked up by name and imported on first use.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

BACKENDS = ("fused", "vmap", "loop")
"""The strategies, fastest first as a rule; ``auto`` chooses among them."""
CHOICES = ("auto", *BACKENDS)
_MODULES = {"loop": "._loop", "vmap": "._vmap", "fused": "._fused", "auto": "._auto"}


class BackendRefusal(RuntimeError):
    """A backend cannot run this architecture or this input exactly; the message says why."""


class CallLock:
    """A re-entrant lock that copies and pickles as a fresh lock (a stack may be deep-copied)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def __deepcopy__(self, memo: dict) -> CallLock:
        return CallLock()

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self._lock = threading.RLock()


class StackView:
    """What a backend may see of a stack: read-only, except for its own cache.

    Attributes:
        num_members: N.
        module: member 0's architecture holding the stacked tensors ``(N, *shape)``.
        template: member 0's architecture on the ``meta`` device (ties kept).
        cache: one dictionary per backend name, for what a backend keeps between calls.
        lock: held for the duration of each call: backends run one module tree.
        generators: the members' own ``torch.Generator`` attributes, one set per member
            (``_random.MemberGenerators``), or None where the member holds none.
        rates: the members' dropout rates where they differ (``_rates.MemberRates``), or
            None where every member has its Dropout modules' own ``p``.
    """

    generators: Any = None
    rates: Any = None

    def __init__(
        self,
        num_members: int,
        module: nn.Module,
        template: nn.Module,
        state: Callable[[], tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]],
    ) -> None:
        self.num_members = num_members
        self.module = module
        self.template = template
        self._state = state
        self.cache: dict[str, dict[str, Any]] = {}
        self.lock = CallLock()

    def __len__(self) -> int:
        return self.num_members

    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The stacked parameters and buffers by name, each ``(N, *shape)``."""
        return self._state()

    def cache_of(self, backend: str) -> dict[str, Any]:
        return self.cache.setdefault(backend, {})


class Backend(Protocol):
    name: str

    def forward(
        self,
        view: StackView,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        in_dims: tuple[int | None, ...],
        kw_dims: frozenset[str] = ...,
    ) -> Any: ...


_loaded: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """Returns the backend called ``name`` ("auto", "fused", "vmap" or "loop").

    The first call imports every backend (``auto`` calls the others): never later, inside
    a ``torch.compile`` trace, which would trace the modules' import-time code too.
    """
    if not _loaded:
        from phalanx.backends._guard import Guarded

        for key, module in _MODULES.items():
            backend = importlib.import_module(module, __name__).BACKEND
            # What one vmapped call needs beyond the member's forward (``_guard``).
            _loaded[key] = Guarded(backend) if key in ("fused", "vmap") else backend
    return _loaded[name]
