"""The arithmetic every rule and executor shares: per-member values broadcast over stacked
tensors, torch.optim's rounding of Python numbers, and non-finite isolation.

A hyperparameter is a Python number shared by all members or a tensor of shape (N,), one
value per member, broadcast as (N, 1, ...) over each stacked tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias, overload

import torch
from torch import Tensor

from phalanx import _torch_compat as compat

__all__ = [
    "Hyper",
    "axpy",
    "finite_members",
    "fused_step_dtype",
    "isolate",
    "math_dtype",
    "maximized",
    "per_member",
    "powers",
    "rows",
    "signed",
    "views",
]

# A hyperparameter as the update rules see it: a Python number shared by all members, or
# one tensor per stacked tensor, shaped (N, 1, ..., 1) in that tensor's dtype.
Hyper: TypeAlias = float | list[Tensor]


def math_dtype(device: torch.device) -> torch.dtype:
    """The dtype of per-member hyperparameter arithmetic (bias corrections, step sizes).

    float64, as torch.optim computes these in Python floats, so that each member matches
    torch.optim to the last bit; float32 where the device has no float64.
    """
    return torch.float32 if device.type == "mps" else torch.float64


def fused_step_dtype() -> torch.dtype:
    """The dtype of the step counts torch's fused kernels read: float32, as torch.optim keeps
    them with ``fused=True`` (``torch.optim.optimizer._get_scalar_dtype(is_fused=True)``).

    torch's CUDA kernels read each step through a ``float*`` whatever the tensor's dtype
    (``ATen/native/cuda/fused_adam_utils.cuh``): a float64 count there reads as 0 (an infinite
    step size, NaN weights). float32 counts are exact integers up to 2**24 steps.
    """
    return torch.float32


@overload
def views(h: Tensor, like: Sequence[Tensor]) -> list[Tensor]: ...
@overload
def views(h: float, like: Sequence[Tensor]) -> float: ...
@overload
def views(h: float | Tensor, like: Sequence[Tensor]) -> Hyper: ...
def views(h: float | Tensor, like: Sequence[Tensor]) -> Hyper:
    """``h`` as the update rules want it: a number, or (N,) -> per-tensor (N, 1, ..., 1) views.

    The (N,) tensor is cast to each tensor's dtype once, exactly as torch casts a Python
    number when it meets a tensor, so ``x.mul_(views(h)[i])`` rounds like ``x.mul_(float(h))``.
    A bool ``h`` stays bool, for ``torch.where``.
    """
    if not isinstance(h, Tensor):
        return h
    cache: dict[tuple[torch.device, torch.dtype, int], Tensor] = {}
    out = []
    for t in like:
        dtype = torch.bool if h.dtype == torch.bool else t.dtype
        key = (t.device, dtype, t.dim())
        if key not in cache:
            cache[key] = h.to(device=t.device, dtype=dtype).view(-1, *([1] * (t.dim() - 1)))
        out.append(cache[key])
    return out


def per_member(h: Any, like: Tensor) -> Any:
    """A number as it is; an (N,) tensor as (N, 1, ..., 1) in ``like``'s dtype and device (bool
    stays bool): how a per-member hyperparameter meets a stacked tensor (``views`` for lists)."""
    if not isinstance(h, Tensor):
        return h
    dtype = torch.bool if h.dtype == torch.bool else like.dtype
    return h.to(device=like.device, dtype=dtype).view(-1, *([1] * (like.dim() - 1)))


def maximized(g: Tensor, maximize: bool | float | Tensor) -> Tensor:
    """The gradient a rule steps against: ``-g`` where ``maximize`` (a bool, or an (N,) bool
    tensor per member), as torch's rules negate it (``g * -1`` is exactly ``-g``)."""
    if isinstance(maximize, Tensor):
        return g * per_member(torch.where(maximize, -1.0, 1.0), g)
    return -g if maximize else g


def powers(base: float | Tensor, exponent: Tensor) -> Tensor:
    """``base ** exponent`` elementwise, (N,), rounded as Python's ``float ** float`` whatever N.

    torch's vectorised ``pow`` (16 or more contiguous float64 elements) rounds some powers
    differently from the C library's ``pow`` that Python and torch's scalar loop call: with 16
    members, 578 of 18000 bias corrections ``0.9 ** t`` differed in the last bit. Strided
    operands take the scalar loop, so a member's bias correction is torch.optim's.
    """
    strided = torch.stack([exponent, exponent], -1)[..., 0]
    if isinstance(base, Tensor):
        base = torch.stack([base, base], -1)[..., 0]
    return base**strided


def rows(values: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Row j of the (P, N) tensor ``values`` as (N, 1, ..., 1) in the dtype of ``like[j]``.

    One cast per dtype for all P rows: a step costs a few launches, not a few per parameter.
    """
    cast: dict[torch.dtype, Tensor] = {}
    out = []
    for j, t in enumerate(like):
        if t.dtype not in cast:
            cast[t.dtype] = values.to(t.dtype)
        out.append(cast[t.dtype][j].view(-1, *([1] * (t.dim() - 1))))
    return out


def axpy(ys: list[Tensor], xs: list[Tensor], a: Hyper) -> list[Tensor]:
    """``ys + a * xs``, rounded as torch's ``y.add(x, alpha=a)`` (one fused multiply-add)."""
    if isinstance(a, list):
        return list(compat.foreach_addcmul(ys, xs, a))
    return list(compat.foreach_add(ys, xs, alpha=a))


def signed(grads: list[Tensor], maximize: float | Tensor) -> list[Tensor]:
    """The gradients, negated for the members that maximize."""
    if isinstance(maximize, Tensor):
        sign = torch.where(maximize, -1.0, 1.0)  # g * -1 is exactly -g
        return list(compat.foreach_mul(grads, views(sign, grads)))
    return list(compat.foreach_neg(grads)) if maximize else grads


def finite_members(tensors: Sequence[Tensor], n: int, device: torch.device) -> Tensor:
    """(N,) bool: True for members all of whose elements in the (N, ...) tensors are finite."""
    finite = torch.ones(n, dtype=torch.bool, device=device)
    for t in tensors:
        if t.numel():
            # one read of t: min and max are finite iff every element is (NaN propagates)
            low, high = torch.aminmax(t.reshape(n, -1), dim=1)
            finite &= (low.isfinite() & high.isfinite()).to(device)
    return finite


def isolate(
    finite: Tensor, mask: Tensor | None, frozen: Tensor, bad_steps: Tensor, freeze_after: int | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Non-finite isolation, the one rule: which members step, which are skipped, which freeze.

    ``finite`` (N,) bool: members whose loss and gradients are finite; ``mask``: the members
    asked to step (None: all). Counts each skipped member in ``bad_steps`` and, with
    ``freeze_after``, freezes a member after that many, both in place. Returns
    ``(active, skipped, newly_frozen)``, ``newly_frozen`` None without ``freeze_after``.
    """
    considered = ~frozen if mask is None else mask & ~frozen
    skipped = considered & ~finite
    bad_steps += skipped
    newly_frozen = None
    if freeze_after is not None:
        newly_frozen = ~frozen & (bad_steps >= freeze_after)
        frozen |= newly_frozen
    return considered & finite, skipped, newly_frozen
