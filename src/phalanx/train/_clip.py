"""Gradient clipping per member: one member's exploding gradient never shrinks another's."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

__all__ = ["clip_coefficients", "clip_grad_norm_", "clip_grad_value_", "member_norms"]


def member_norms(grads: list[Tensor], n: int, norm_type: float) -> Tensor:
    """(N,) each member's gradient norm over all its (N, ...) gradients (the one rule, used by
    ``clip_grad_norm_`` and traced by ``compile_step``)."""
    device = grads[0].device
    norms = torch.stack(
        [torch.linalg.vector_norm(g.reshape(n, -1), norm_type, dim=1).to(device) for g in grads],
        dim=1,
    )  # (N, number of parameters)
    return torch.linalg.vector_norm(norms, norm_type, dim=1)


def clip_coefficients(max_norm: Tensor, total: Tensor) -> Tensor:
    """(N,) the factor each member's gradients are scaled by: ``min(1, max_norm / (norm + 1e-6))``
    as torch.nn.utils.clip_grad_norm_ computes it for one model."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _grads(fn: str, parameters: Tensor | Iterable[Tensor]) -> tuple[list[Tensor], int]:
    """The gradients of stacked parameters and N, checking that they share dim 0."""
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    n = -1
    for j, p in enumerate(params):
        if p.dim() == 0 or (n >= 0 and p.shape[0] != n):
            raise ValueError(
                f"{fn}: parameter {j} has shape {tuple(p.shape)}, expected (N, *shape) with "
                f"N = {n if n >= 0 else 'the number of members'}. Pass stacked parameters, "
                "member axis first, such as phalanx.stack(models).parameters()."
            )
        n = p.shape[0]
    if n < 0:
        raise ValueError(f"{fn}: got no parameters; pass the stacked parameters to clip.")
    return [p.grad for p in params if p.grad is not None], n


def _per_member(fn: str, name: str, value: float | Tensor, n: int, like: Tensor) -> Tensor:
    """``value`` as (N,) in ``like``'s dtype and device."""
    if isinstance(value, (int, float)):
        # a fill on the device: torch.as_tensor(number, device="cuda") is a blocking copy
        return torch.full((n,), float(value), dtype=like.dtype, device=like.device)
    t = torch.as_tensor(value, dtype=like.dtype, device=like.device)
    if t.shape not in {(), (n,)}:
        raise ValueError(
            f"{fn}: {name} has shape {tuple(t.shape)}; expected a number or a tensor of shape "
            f"({n},), one value per member."
        )
    return t.expand(n)


def clip_grad_norm_(
    parameters: Tensor | Iterable[Tensor],
    max_norm: float | Tensor,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> Tensor:
    """Clips each member's gradient norm, over all its parameters, to its own ``max_norm``.

    Member i's gradients are scaled exactly as ``torch.nn.utils.clip_grad_norm_`` would scale
    them with member i's parameters alone: by ``min(1, max_norm[i] / (norm[i] + 1e-6))``. A
    member with a non-finite norm gets non-finite gradients and leaves the others untouched;
    ``skip_nonfinite=True`` on a phalanx optimizer then skips it.

    Args:
        parameters: stacked parameters, each of shape (N, *shape); those without a gradient
            are ignored.
        max_norm: the largest norm allowed, a number or an (N,) tensor.
        norm_type: the p of the p-norm; ``float("inf")`` for the largest absolute value.
        error_if_nonfinite: raise if a member's norm is nan or inf (one host sync).

    Returns:
        (N,) the norm of each member's gradients before clipping, in the gradients' dtype.

    Raises:
        ValueError: parameters do not share dim 0, or ``max_norm`` is not a number or (N,).
        RuntimeError: ``error_if_nonfinite`` and some member's norm is not finite.

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2, 3))
        >>> w.grad = torch.tensor([[3.0, 4.0, 0.0], [0.3, 0.4, 0.0]])
        >>> phalanx.clip_grad_norm_([w], max_norm=1.0)
        tensor([5.0000, 0.5000])
        >>> w.grad[:, 0]
        tensor([0.6000, 0.3000])
    """
    fn = "phalanx.clip_grad_norm_()"
    grads, n = _grads(fn, parameters)
    if not grads:
        return torch.zeros(n)
    total = member_norms(grads, n, float(norm_type))
    if error_if_nonfinite and not bool(total.isfinite().all()):
        bad = (~total.isfinite()).nonzero().flatten().tolist()
        raise RuntimeError(
            f"{fn}: the gradient norm of members {bad} is not finite, so it cannot be clipped. "
            "Pass error_if_nonfinite=False to scale them anyway, or skip those members with "
            "a phalanx optimizer's skip_nonfinite=True."
        )
    coef = clip_coefficients(_per_member(fn, "max_norm", max_norm, n, total), total)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype).view(-1, *([1] * (g.dim() - 1))))
    return total


def clip_grad_value_(parameters: Tensor | Iterable[Tensor], clip_value: float | Tensor) -> None:
    """Clamps each member's gradients to ``[-clip_value[i], clip_value[i]]``, in place.

    Args:
        parameters: stacked parameters, each of shape (N, *shape); those without a gradient
            are ignored.
        clip_value: the largest absolute gradient allowed, a number or an (N,) tensor.

    Raises:
        ValueError: parameters do not share dim 0, or ``clip_value`` is not a number or (N,).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2, 2))
        >>> w.grad = torch.tensor([[5.0, -5.0], [5.0, -5.0]])
        >>> phalanx.clip_grad_value_([w], torch.tensor([1.0, 2.0]))
        >>> w.grad
        tensor([[ 1., -1.],
                [ 2., -2.]])
    """
    fn = "phalanx.clip_grad_value_()"
    grads, n = _grads(fn, parameters)
    for g in grads:
        c = _per_member(fn, "clip_value", clip_value, n, g).view(-1, *([1] * (g.dim() - 1)))
        g.clamp_(min=-c, max=c)
