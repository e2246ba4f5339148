"""Per-member losses: the sum over members gives each member exactly its own gradient."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import vmap

from phalanx.core._hf import not_a_tensor, own_loss
from phalanx.train import _smoothing

# Losses that are a mean of per-element terms: computed once on (N, B, ...) with
# reduction="none", then averaged per member, instead of through vmap's per-call overhead.
_ELEMENTWISE = {
    F.mse_loss: (),
    F.l1_loss: (),
    F.smooth_l1_loss: ("beta",),
    F.huber_loss: ("delta",),
    F.binary_cross_entropy_with_logits: (),
    F.binary_cross_entropy: (),
}
# Losses over a class dimension (dim 1 of a member's (B, C, ...) output) with a mean over
# the samples: computed on the (N * B, C, ...) flattening.
# A class `weight` of shape (C,) is shared by the members; with class indices the mean is then
# over the targets' weights, as torch's reduction="mean" divides.
_CLASSWISE = {
    F.cross_entropy: ("label_smoothing", "weight", "ignore_index"),
    F.nll_loss: ("weight", "ignore_index"),
}


def _batched_loss(
    loss_fn: Callable[..., torch.Tensor],
    output: torch.Tensor,
    target: Any,
    in_dims: tuple[int | None, int | None],
    kwargs: dict[str, Any],
) -> torch.Tensor | None:
    """The (N,) losses without vmap for the common losses with a plain mean; else None."""
    if not isinstance(target, torch.Tensor) or in_dims[0] != 0 or output.dim() < 2:
        return None
    n = output.shape[0]
    if in_dims[1] is None:
        target = target.expand(n, *target.shape)
    # A mean over every dim but the member axis, without flattening: the outputs of the fused
    # backend are often strided views, which flatten(1) would copy (and copy back in backward).
    if loss_fn in _ELEMENTWISE and set(kwargs) <= set(_ELEMENTWISE[loss_fn]):
        if target.shape != output.shape:
            return None  # broadcasting targets: let the loss itself warn or refuse
        per_element = loss_fn(output, target, reduction="none", **kwargs)
        return per_element.mean(dim=tuple(range(1, per_element.dim())))
    if loss_fn in _CLASSWISE and set(kwargs) <= set(_CLASSWISE[loss_fn]) and output.dim() >= 3:
        if target.shape[:2] != output.shape[:2]:
            return None
        # The members become the loss's batch and a member's batch its first "spatial" dim:
        # (N, B, C, ...) is read as (N, C, B, ...), a view, with no copy of a shared target.
        if target.is_floating_point():  # class probabilities, shaped like the output
            if target.shape != output.shape:
                return None
            per_sample = loss_fn(output.movedim(2, 1), target.movedim(2, 1), reduction="none",
                                 **kwargs)  # fmt: skip
            return per_sample.mean(dim=tuple(range(1, per_sample.dim())))
        weight = kwargs.get("weight")
        if weight is not None and (not isinstance(weight, torch.Tensor) or weight.dim() != 1):
            return None
        per_sample = loss_fn(output.movedim(2, 1), target, reduction="none", **kwargs)
        # reduction="mean" divides by the number of samples not equal to ignore_index, or with
        # class weights by the sum of their targets' weights (label smoothing's term included)
        counted = target != kwargs.get("ignore_index", -100)
        dims = tuple(range(1, target.dim()))
        if weight is None:
            total = counted.sum(dim=dims)
        else:
            picked = weight.to(per_sample.dtype)[target.where(counted, 0)]
            total = picked.where(counted, 0).sum(dim=dims)
        return per_sample.sum(dim=tuple(range(1, per_sample.dim()))) / total
    return None


def member_losses(
    loss_fn: Callable[..., torch.Tensor] | None,
    output: Any,
    target: Any = None,
    *,
    in_dims: tuple[int | None, int | None] = (0, None),
    **kwargs: Any,
) -> torch.Tensor:
    """Applies ``loss_fn`` to each member's output alone and returns one loss per member.

    Backpropagate ``member_losses(...).sum()``: member i's parameters then get exactly the
    gradient of member i's own loss. The tempting ``loss_fn(output.flatten(0, 1), ...)`` with
    ``reduction="mean"`` divides every member's gradient by N instead.

    Args:
        loss_fn: a loss such as ``torch.nn.functional.cross_entropy`` that returns a scalar
            for one member's ``(B, ...)`` output; or None for the loss each member computed
            itself: the output's ``.loss`` (a Hugging Face ``ModelOutput`` of a call with
            ``labels=``), or a tuple's first element, ``(N,)``.
        output: the stack's output, ``(N, B, ...)``; with ``loss_fn=None``, the stack's
            structured output.
        target: ``(B, ...)`` shared by every member (the default), or ``(N, B, ...)`` with
            ``in_dims=(0, 0)`` for per-member targets.
        in_dims: how ``output`` and ``target`` map over the member axis, as in
            ``torch.func.vmap``.
        **kwargs: passed to ``loss_fn`` for every member (e.g. ``label_smoothing=0.1``).
            ``label_smoothing`` may also be one value per member, an ``(N,)`` tensor or a
            list, with ``F.cross_entropy`` (a smoothing sweep).

    Returns:
        ``(N,)``: the members' losses.

    Raises:
        ValueError: the target carries the member axis but ``in_dims`` says it is shared, or
            ``loss_fn`` does not return one scalar per member.

    Example:
        >>> stack = phalanx.stack([nn.Linear(4, 3) for _ in range(5)])
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))  # one batch for every member
        >>> losses = phalanx.member_losses(F.cross_entropy, stack(x), y)
        >>> losses.shape
        torch.Size([5])
        >>> losses.sum().backward()  # member i's gradient is that of its own loss alone
    """
    where = "phalanx.member_losses()"
    if loss_fn is None:
        return own_loss(output, None, where)
    if not isinstance(output, torch.Tensor) and in_dims[0] == 0:
        raise not_a_tensor(output, where)
    if not callable(loss_fn):
        raise TypeError(
            f"{where}: the loss function comes first: member_losses(loss_fn, output, target); "
            f"got a {type(loss_fn).__name__} where loss_fn goes."
        )
    if isinstance(in_dims, list):
        in_dims = (in_dims[0], in_dims[1]) if len(in_dims) == 2 else in_dims
    if (
        not isinstance(in_dims, tuple)
        or len(in_dims) != 2
        or any(d not in (0, None) or isinstance(d, bool) for d in in_dims)
        or in_dims == (None, None)
    ):
        raise ValueError(
            f"{where}: in_dims={in_dims!r} must say where the member axis is: 0 (dim 0 is "
            f"the member axis) or None (shared by every member) for the output and the "
            f"target, at least one of them 0. The stack's output carries the member axis: "
            f"in_dims=(0, None) for a target shared by every member, (0, 0) for per-member "
            f"targets."
        )
    if _smoothing.is_per_member(kwargs):
        return _smoothing.smoothed_losses(member_losses, loss_fn, output, target, in_dims, kwargs)
    if (
        in_dims[1] is None
        and isinstance(target, torch.Tensor)
        and in_dims[0] == 0
        and target.shape == output.shape
        and target.dim() > 0
    ):
        raise ValueError(
            f"{where}: the target has the output's shape {tuple(output.shape)}, member axis "
            f"included, but in_dims={in_dims} treats it as shared by every member. For a "
            f"per-member target pass in_dims=(0, 0); for a shared one pass a target without the "
            f"member axis."
        )
    losses = _batched_loss(loss_fn, output, target, in_dims, kwargs)
    if losses is None:
        losses = vmap(lambda o, t: loss_fn(o, t, **kwargs), in_dims=in_dims)(output, target)
    expected = output.shape[:1] if in_dims[0] == 0 else target.shape[:1]
    if losses.shape != expected:
        raise ValueError(
            f"{where}: loss_fn must return one scalar per member, giving shape "
            f"{tuple(expected)}; got {tuple(losses.shape)}. Use reduction='mean' or 'sum'."
        )
    return losses
