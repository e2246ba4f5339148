"""Index operations under ``torch.export`` (both vmap backends): no member's bad index may
raise inside the exported vmap level.

An exported graph enters and leaves the vmap level with operations of its own; an operation
that raises between them (``gather`` with an index out of range) would leave the serving
process inside the level for good: every random operation and ``.numpy()`` fail after it.
While export traces, these routes check each index against its dimension with
:func:`~phalanx.backends.rules._registry.holds` (asserted after the level, ``deferred``)
and hand the operation indices clamped into range until then, so the request is refused
with the member's reason and the process is left as it was. Eager calls are untouched.
Covered: ``gather``, ``index_select``, the ``scatter`` family, ``index_add``/``copy``/``fill``,
``take_along_dim`` and ``x[idx]`` with integer tensor indices (embeddings: ``_embedding``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx import _torch_compat as compat
from phalanx.backends.rules._registry import holds, register


def _size(t: torch.Tensor, dim: int) -> Any:
    """``t.size(dim)`` as the member sees it (the member axis left out)."""
    physical = compat.unwrapped_member_first(t)
    shape = t.shape if physical is None else physical.shape[1:]
    return shape[dim] if len(shape) else 1


def _checked(index: torch.Tensor, size: Any, negative: bool, what: str) -> torch.Tensor:
    """``index`` clamped into range, its range asserted after the vmap level."""
    physical = compat.unwrapped_member_first(index)
    raw = index if physical is None else physical
    if raw.numel():
        low, high = torch.aminmax(raw)
        bound = -size if negative else 0
        holds(
            (low >= bound) & (high < size),
            f"{what}: index out of range for a dimension of size {size} (the member alone "
            f"raises 'index out of bounds')",
        )
    return index.clamp(-size if negative else 0, size - 1)


def _route(
    func: Callable[..., Any],
    name: str,
    *,
    index_at: int,
    dim_at: int,
    index_kw: str = "index",
    negative: bool = False,
) -> Callable[[tuple, dict], Any]:
    def route(given: tuple, given_kwargs: dict) -> Any:
        args, kwargs = list(given), dict(given_kwargs)
        index = args[index_at] if len(args) > index_at else kwargs.get(index_kw)
        dim = args[dim_at] if len(args) > dim_at else kwargs.get("dim")
        source = args[0] if args else kwargs.get("input", kwargs.get("self"))
        if (
            not torch.compiler.is_exporting()
            or not isinstance(index, torch.Tensor)
            or not isinstance(source, torch.Tensor)
            or not isinstance(dim, int)
        ):
            return func(*args, **kwargs)
        clamped = _checked(index, _size(source, dim), negative, name)
        if len(args) > index_at:
            args[index_at] = clamped
        else:
            kwargs[index_kw] = clamped
        return func(*args, **kwargs)

    return route


_ROUTES: list[tuple[Any, str, int, int, bool]] = [
    (torch.gather, "torch.gather", 2, 1, False),
    (torch.Tensor.gather, "Tensor.gather", 2, 1, False),
    (torch.index_select, "torch.index_select", 2, 1, True),
    (torch.Tensor.index_select, "Tensor.index_select", 2, 1, True),
]
for _name in ("scatter", "scatter_add", "scatter_reduce"):
    _ROUTES += [
        (getattr(torch, _name), f"torch.{_name}", 2, 1, False),
        (getattr(torch.Tensor, _name), f"Tensor.{_name}", 2, 1, False),
        (getattr(torch.Tensor, _name + "_"), f"Tensor.{_name}_", 2, 1, False),
    ]
for _name in ("index_add", "index_copy", "index_fill"):
    _ROUTES += [
        (getattr(torch.Tensor, _name), f"Tensor.{_name}", 2, 1, True),
        (getattr(torch.Tensor, _name + "_"), f"Tensor.{_name}_", 2, 1, True),
    ]
for _f, _name, _index_at, _dim_at, _negative in _ROUTES:
    register(
        _f,
        _route(_f, _name, index_at=_index_at, dim_at=_dim_at, negative=_negative),
        table="export",
    )
register(
    torch.take_along_dim,
    _route(torch.take_along_dim, "torch.take_along_dim", index_at=1, dim_at=2, index_kw="indices"),
    table="export",
)


def _getitem(args: tuple, kwargs: dict) -> Any:
    """``x[idx]`` with integer tensor indices (alone or in a tuple of ints, slices and
    tensors): each tensor index checked against the dim it indexes, negatives as Python
    allows them."""
    x, index = args[0], args[1]
    if not torch.compiler.is_exporting() or kwargs:
        return torch.Tensor.__getitem__(x, index)
    parts = list(index) if isinstance(index, tuple) else [index]
    if not any(_int_tensor(p) for p in parts) or any(
        p is Ellipsis or p is None or (isinstance(p, torch.Tensor) and not _int_tensor(p))
        for p in parts
    ):
        return torch.Tensor.__getitem__(x, index)  # nothing to check, or a form left to torch
    checked = [
        _checked(p, _size(x, dim), True, "Tensor.__getitem__") if _int_tensor(p) else p
        for dim, p in enumerate(parts)
    ]
    return torch.Tensor.__getitem__(x, tuple(checked) if isinstance(index, tuple) else checked[0])


def _int_tensor(p: Any) -> bool:
    return isinstance(p, torch.Tensor) and not p.is_floating_point() and p.dtype != torch.bool


register(torch.Tensor.__getitem__, _getitem, table="export")
