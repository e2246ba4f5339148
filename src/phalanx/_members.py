"""Member indices: what every part of phalanx accepts where it asks for "which members".

The leaf under the optimizer, the loader, the population and the checkpoints: a list of ints,
an int tensor or an (N,) bool mask, checked once, the same way everywhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["member_index", "pairs"]


def member_index(members: Any, n: int, where: str, what: str = "members") -> Tensor:
    """``members`` (ints, an int tensor or an (N,) bool mask) as a 1-d int64 index in [0, N)."""
    index = torch.as_tensor(members if members is not None else range(n)).cpu()
    if index.numel() == 0:  # [] is a float tensor to torch; no members is a valid choice
        return torch.zeros(0, dtype=torch.long)
    if index.dtype == torch.bool:
        if index.shape != (n,):
            raise ValueError(
                f"{where}: a bool mask for {what} must have shape ({n},), one flag per member; "
                f"got {tuple(index.shape)}."
            )
        index = index.nonzero().flatten()
    if index.is_floating_point() or index.dim() > 1:
        raise ValueError(
            f"{where}: {what} must be member indices (ints) or an ({n},) bool mask; got a "
            f"{index.dtype} tensor of shape {tuple(index.shape)}."
        )
    index = index.reshape(-1).long()
    bad = index[(index < 0) | (index >= n)]
    if len(bad):
        raise IndexError(
            f"{where}: {what} {bad.tolist()} out of range; there are {n} members, 0..{n - 1}."
        )
    return index


def pairs(source: Any, target: Any, n: int, where: str) -> tuple[Tensor, Tensor]:
    """(source, target) index pairs for a copy, checked: equal lengths, distinct targets."""
    src = member_index(source, n, where, "source members")
    dst = member_index(target, n, where, "target members")
    if len(src) != len(dst):
        raise ValueError(
            f"{where}: {len(src)} source members but {len(dst)} target members; give one "
            f"source per target."
        )
    if len(dst.unique()) != len(dst):
        raise ValueError(
            f"{where}: target members {dst.tolist()} list a member more than once; each target "
            f"can take one source."
        )
    return src, dst
