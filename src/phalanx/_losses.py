"""Per-member losses: the sum over members gives each member exactly its own gradient."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import vmap


def member_losses(
    loss_fn: Callable[..., torch.Tensor],
    output: torch.Tensor,
    target: Any,
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
            for one member's ``(B, ...)`` output.
        output: the stack's output, ``(N, B, ...)``.
        target: ``(B, ...)`` shared by every member (the default), or ``(N, B, ...)`` with
            ``in_dims=(0, 0)`` for per-member targets.
        in_dims: how ``output`` and ``target`` map over the member axis, as in
            ``torch.func.vmap``.
        **kwargs: passed to ``loss_fn`` for every member (e.g. ``label_smoothing=0.1``).

    Returns:
        ``(N,)``: the members' losses.

    Raises:
        ValueError: the target carries the member axis but ``in_dims`` says it is shared, or
            ``loss_fn`` does not return one scalar per member.

    Example:
        >>> losses = phalanx.member_losses(F.cross_entropy, stack(x), y)  # (N,)
        >>> losses.sum().backward()
    """
    where = "phalanx.member_losses()"
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
    losses = vmap(lambda o, t: loss_fn(o, t, **kwargs), in_dims=in_dims)(output, target)
    expected = output.shape[:1] if in_dims[0] == 0 else target.shape[:1]
    if losses.shape != expected:
        raise ValueError(
            f"{where}: loss_fn must return one scalar per member, giving shape "
            f"{tuple(expected)}; got {tuple(losses.shape)}. Use reduction='mean' or 'sum'."
        )
    return losses
