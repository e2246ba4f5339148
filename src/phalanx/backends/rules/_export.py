"""The rules that ``torch.export`` needs besides the ordinary ones (the other families).

Under export (pre-dispatch tracing) in torch 2.13, torch.func turns a batched tensor's
symbolic sizes into Python ints when it answers ``x.size(0)`` or batches ``view``/``reshape``:
``x.view(x.size(0), -1)``, which every classifier head writes, would fix the traced batch to
the example's (a dynamic batch then fails with "Constraints violated ... specialized it to be
a constant"). These rules read sizes off, and reshape, the unwrapped tensor (member axis
first) instead, so the sizes stay symbolic. Only values matter in an exported graph, so
``view`` may become ``reshape``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx import _torch_compat as compat
from phalanx.backends.rules._registry import register


def _shape_rule(func: Callable[..., Any]) -> Callable[[tuple, dict], Any]:
    def route(args: tuple, kwargs: dict) -> Any:
        x, *shape = args
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = list(shape[0])
        if kwargs or not shape or not all(isinstance(s, (int, torch.SymInt)) for s in shape):
            return func(*args, **kwargs)  # view(dtype), shape=...: torch's own rule

        def rule(n: int, dims: tuple, t: torch.Tensor) -> tuple[torch.Tensor, int]:
            return t.movedim(dims[0], 0).reshape(n, *shape), 0

        out = compat.vmap_rule_inline(lambda t: func(t, *shape), rule, (x,))
        return func(*args, **kwargs) if out is None else out

    return route


def _size(args: tuple, kwargs: dict) -> Any:
    """``x.size()`` / ``x.size(d)`` read off the unwrapped tensor (torch.func's own answer is
    a Python int under export: the batch would be fixed)."""
    physical = compat.unwrapped_member_first(args[0])
    if physical is None:
        return torch.Tensor.size(*args, **kwargs)
    sizes = physical.shape[1:]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return sizes if dim is None else sizes[dim]


def _shape(args: tuple, kwargs: dict) -> Any:
    physical = compat.unwrapped_member_first(args[0])
    return args[0].shape if physical is None else physical.shape[1:]


register(torch.Tensor.size, _size, table="export")
register(torch.Tensor.shape.__get__, _shape, table="export")  # type: ignore[attr-defined]
register(torch.Tensor.view, _shape_rule(torch.Tensor.view), table="export")
register(torch.Tensor.reshape, _shape_rule(torch.Tensor.reshape), table="export")
register(torch.reshape, _shape_rule(torch.reshape), table="export")
