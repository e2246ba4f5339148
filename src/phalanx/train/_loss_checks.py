"""Targets whose shape says the other thing than ``in_dims``: the phalanx error naming the fix,
before the loss raises torch's (``Expected input batch_size (16) to match target batch_size
(4)``) or vmap's about mapped sizes."""

from __future__ import annotations

from typing import Any

import torch


def check_targets(output: Any, target: Any, in_dims: tuple[int | None, int | None]) -> None:
    """Raises where a tensor ``target`` is per-member but declared shared, or the reverse.

    Per-member but declared shared: ``(N, B, ...)`` against an output ``(N, B, ...)`` (the
    first two sizes agree) where a shared target would begin with the member's batch ``B``
    (``output.shape[1]``), which differs. Declared per-member, ``in_dims=(0, 0)``: its first
    size must be N.
    """
    if not isinstance(output, torch.Tensor) or not isinstance(target, torch.Tensor):
        return
    if in_dims[0] != 0 or output.dim() < 2 or target.dim() == 0:
        return
    where = "phalanx.member_losses()"
    n, batch = output.shape[0], output.shape[1]
    if in_dims[1] is None:
        if target.dim() >= 2 and target.shape[:2] == output.shape[:2] and target.shape[0] != batch:
            raise ValueError(
                f"{where}: the target of shape {tuple(target.shape)} begins with the output's "
                f"({n}, {batch}): the member axis, then each member's batch, but in_dims="
                f"{in_dims} treats it as shared by every member, so each member would be "
                f"compared with all {n} members' targets. For per-member targets pass "
                f"in_dims=(0, 0); for one target shared by every member pass it without the "
                f"member axis, shape ({batch}, ...)."
            )
    elif target.shape[0] != n:
        raise ValueError(
            f"{where}: in_dims={in_dims} says the target is per-member, (N, B, ...) with N = "
            f"{n}, but its shape is {tuple(target.shape)}. For a target shared by every "
            f"member pass in_dims=(0, None) (the default); for per-member targets stack them "
            f"members first."
        )
