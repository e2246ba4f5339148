"""A population's rows: the stack's member tensors, the run's checks, a copy within one process.

The leaf of ``phalanx.population``: the one-process copy here is what ``copy_members`` runs,
and what each rank runs for its local pairs when members are copied across ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from phalanx._members import pairs
from phalanx.core._stack import Stack
from phalanx.data import MemberLoader
from phalanx.optim import MemberOptimizer


def member_tensors(stack: Stack) -> list[Tensor]:
    """The stack's stacked parameters and buffers, each (N, *shape), in a fixed order."""
    params = [p for _, p in stack.module.named_parameters()]
    return params + [b for _, b in stack.module.named_buffers()]


def check_run(stack: Stack, optimizer: Any, loader: Any, where: str) -> None:
    """Refuses an optimizer or loader that does not train ``stack``, before anything changes.

    The optimizer must be a phalanx optimizer over this stack's own parameters (one of
    another stack, even of the same N, would have its rows copied instead); optimizer and
    loader must hold the stack's number of members.
    """
    if not isinstance(stack, Stack):
        raise TypeError(
            f"{where}: stack must be a phalanx.Stack (from phalanx.stack(models)); got "
            f"{type(stack).__name__}."
        )
    if stack.retired is not None:
        raise ValueError(f"{where}: {stack.retired}")
    n = len(stack)
    if optimizer is not None and not isinstance(optimizer, MemberOptimizer):
        raise TypeError(
            f"{where}: optimizer must be a phalanx optimizer (a phalanx.optim.MemberOptimizer), "
            f"whose state has a member axis; got {type(optimizer).__module__}."
            f"{type(optimizer).__name__}. Build it with phalanx.optim over stack.parameters()."
        )
    if loader is not None and not isinstance(loader, MemberLoader):
        raise TypeError(
            f"{where}: loader must be a phalanx.data.MemberLoader; got {type(loader).__name__}."
        )
    for name, obj in (("optimizer", optimizer), ("loader", loader)):
        if obj is not None and obj.num_members != n:
            raise ValueError(
                f"{where}: the {name} holds {obj.num_members} members but the stack {n}; pass "
                f"the {name} that trains this stack."
            )
    if optimizer is not None:
        own = {id(p) for p in stack.parameters()}  # ids of objects held here: safe
        held = [p for group in optimizer.param_groups for p in group["params"]]
        stray = [j for j, p in enumerate(held) if id(p) not in own]
        if stray:
            raise ValueError(
                f"{where}: optimizer parameters {stray} (of {len(held)}) are not parameters of "
                f"this stack: the optimizer trains another stack. Pass the optimizer built "
                f"over this stack's parameters()."
            )


@torch.no_grad()
def copy_within(
    stack: Stack,
    source: Any,
    target: Any,
    optimizer: MemberOptimizer | None,
    loader: MemberLoader | None,
    hyperparameters: bool,
    where: str,
) -> None:
    """Copies members ``source`` onto ``target`` inside this process (all reads first)."""
    src, dst = pairs(source, target, len(stack), where)
    for t in member_tensors(stack):
        t[dst.to(t.device)] = t[src.to(t.device)]
    if stack.padding is not None:  # members padded to the widest: targets take the widths
        stack.padding.copy_rows(src.tolist(), dst.tolist())
    if optimizer is not None:
        optimizer.copy_members(src, dst, hyperparameters=hyperparameters)
    if loader is not None:
        loader.copy_members(src, dst)
