"""A per-member ``label_smoothing`` for ``member_losses`` (a sweep over smoothing values).

torch's cross-entropy with label smoothing ``e`` is ``(1 - e) * CE(0) + e * CE(1)`` for class
indices and for class probabilities alike (its smoothed target is linear in ``e``, and so is
every reduction), where ``CE(0)`` is the plain loss and ``CE(1)`` the loss against the
uniform distribution. So N members with N smoothing values take two batched calls of torch's
own loss, whatever N, and each member's loss and gradient are its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F


def is_per_member(kwargs: dict[str, Any]) -> bool:
    value = kwargs.get("label_smoothing")
    return isinstance(value, (torch.Tensor, Sequence)) and not isinstance(value, str)


def smoothed_losses(
    member_losses: Callable[..., torch.Tensor],
    loss_fn: Callable[..., torch.Tensor],
    output: torch.Tensor,
    target: Any,
    in_dims: tuple[int | None, ...],
    kwargs: dict[str, Any],
) -> torch.Tensor:
    """``member_losses`` with ``kwargs["label_smoothing"]`` one value per member, ``(N,)``."""
    where = "phalanx.member_losses()"
    if loss_fn is not F.cross_entropy:
        raise ValueError(
            f"{where}: a per-member label_smoothing (one value per member) is supported for "
            f"loss_fn=torch.nn.functional.cross_entropy; got {getattr(loss_fn, '__name__', loss_fn)}. "
            f"Pass one number to apply the same smoothing to every member."
        )
    n = output.shape[0] if in_dims[0] == 0 else target.shape[0]
    rest = {k: v for k, v in kwargs.items() if k != "label_smoothing"}
    eps = torch.as_tensor(kwargs["label_smoothing"], dtype=output.dtype, device=output.device)
    if eps.shape != (n,):
        raise ValueError(
            f"{where}: label_smoothing must be one number, or one per member: shape ({n},); "
            f"got shape {tuple(eps.shape)}."
        )
    if bool(((eps < 0) | (eps > 1)).any()):
        raise ValueError(
            f"{where}: label_smoothing values must lie in [0, 1], as torch requires; got "
            f"{eps.tolist()}."
        )
    plain = member_losses(loss_fn, output, target, in_dims=in_dims, label_smoothing=0.0, **rest)
    uniform = member_losses(loss_fn, output, target, in_dims=in_dims, label_smoothing=1.0, **rest)
    return (1 - eps) * plain + eps * uniform
