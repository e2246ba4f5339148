"""Member surgery on a whole training run: stack, optimizer and loader together.

``copy_members`` makes members exact copies of others (the exploit of population-based
training); ``keep_members`` drops members for good (early stopping), returning a smaller stack
whose steps cost less. Both index whole stacked tensors: no Python loop over members.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from phalanx._members import member_index
from phalanx._module_tree import copy_modes
from phalanx.core._stack import Stack
from phalanx.data import MemberLoader
from phalanx.optim import MemberOptimizer
from phalanx.population._distributed import copy_across_ranks
from phalanx.population._rows import check_run, copy_within

if TYPE_CHECKING:
    from phalanx.distributed import Shard

__all__ = ["copy_members", "keep_members"]


def _retire(stack: Stack, smaller: Stack) -> None:
    """Makes the replaced stack refuse to train: its optimizer now steps ``smaller``."""
    message = (
        f"this stack of {len(stack)} members was replaced by keep_members(), and its "
        f"optimizer now trains the returned stack of {len(smaller)} (halving.stack after "
        "SuccessiveHalving.stop()); training this one would update nothing. Use the returned "
        "stack (under torch.no_grad() this one still evaluates its weights as they were)."
    )
    stack.retire(message)


@torch.no_grad()
def copy_members(
    stack: Stack,
    source: Any,
    target: Any,
    *,
    optimizer: MemberOptimizer | None = None,
    loader: MemberLoader | None = None,
    hyperparameters: bool = True,
    shard: Shard | None = None,
) -> None:
    """Makes each target member an exact copy of its source member, in place.

    Copies weights and buffers (not gradients: zero them before the next backward); with ``optimizer``, every optimizer state tensor
    (moments, momentum buffers, per-member step counts), the isolation counters and, with
    ``hyperparameters``, the per-member hyperparameters; with ``loader``, the data stream, so the
    target's next batches equal the source's. A target then steps bit for bit as its source
    does. All sources are read before any target is written.

    Args:
        stack: the stack, N members.
        source: member indices to copy from (global indices with ``shard``).
        target: member indices to overwrite, one per source, each at most once.
        optimizer: the phalanx optimizer training the stack.
        loader: give it to make the targets read their sources' data streams.
        hyperparameters: also copy the optimizer's per-member hyperparameters.
        shard: with ``phalanx.distributed``, this rank's Shard: sources and targets are global
            indices and may live on other ranks. Every rank must call with the same indices.

    Raises:
        ValueError: source and target differ in length, a target repeats, or the optimizer
            or loader holds another number of members.
        IndexError: an index is out of range.

    Example:
        >>> stack = phalanx.stack([nn.Linear(4, 3) for _ in range(4)])
        >>> opt = phalanx.optim.Adam(stack.parameters(), lr=torch.tensor([1e-3, 1e-2, 1e-1, 1.0]))
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> val_acc = phalanx.metrics.accuracy(stack(x), y)  # (N,)
        >>> best, worst = int(val_acc.argmax()), int(val_acc.argmin())
        >>> phalanx.population.copy_members(
        ...     stack, [best], [worst], optimizer=opt, hyperparameters=True)
        >>> torch.equal(stack.module.weight[worst], stack.module.weight[best])
        True
        >>> lrs = opt.hyperparameters()["lr"]
        >>> bool(lrs[worst] == lrs[best])
        True
    """
    where = "phalanx.population.copy_members()"
    check_run(stack, optimizer, loader, where)
    if shard is not None and shard.world_size > 1:
        copy_across_ranks(stack, source, target, optimizer, loader, hyperparameters, shard)
        return
    copy_within(stack, source, target, optimizer, loader, hyperparameters, where)


@torch.no_grad()
def keep_members(
    stack: Stack,
    members: Any,
    *,
    optimizer: MemberOptimizer | None = None,
    loader: MemberLoader | None = None,
) -> Stack:
    """A smaller stack of ``members`` only; the optimizer and loader follow it in place.

    The new stack holds copies of the kept members' rows, in the order given; the optimizer
    keeps their state and hyperparameters and steps the new stack's parameters; the loader
    keeps their data streams. Training then continues exactly as it would have for those
    members, and each step costs what a stack of that size costs.

    Args:
        stack: the stack, N members.
        members: member indices (or an (N,) bool mask) to keep, each at most once.
        optimizer: the phalanx optimizer training the stack, changed in place.
        loader: its MemberLoader, changed in place.

    Returns:
        The new stack, with the same backend choice and train/eval modes.

    Raises:
        ValueError: no member kept, a member kept twice, or an optimizer or loader with
            another number of members.

    Example:
        >>> X, Y = torch.randn(64, 4), torch.randint(0, 3, (64,))
        >>> stack = phalanx.stack([nn.Linear(4, 3) for _ in range(8)])
        >>> opt = phalanx.optim.Adam(stack.parameters(), lr=1e-2)
        >>> loader = phalanx.data.MemberLoader(X, Y, num_members=8, batch_size=16, seed=0)
        >>> val_acc = phalanx.metrics.accuracy(stack(X), Y)  # (N,)
        >>> top = torch.topk(val_acc, k=len(stack) // 2).indices
        >>> stack = phalanx.population.keep_members(stack, top, optimizer=opt, loader=loader)
        >>> len(stack), loader.num_members
        (4, 4)
        >>> xb, yb = next(iter(loader))  # training goes on with the 4 kept members
        >>> phalanx.member_losses(F.cross_entropy, stack(xb, in_dims=0), yb, in_dims=(0, 0)).shape
        torch.Size([4])
    """
    where = "phalanx.population.keep_members()"
    check_run(stack, optimizer, loader, where)
    index = member_index(members, len(stack), where)
    if not len(index) or len(index.unique()) != len(index):
        raise ValueError(
            f"{where}: members must list at least one member and each at most once; got "
            f"{index.tolist()}."
        )

    def rows(t: Tensor) -> Tensor:
        return t.detach()[index.to(t.device)]  # advanced indexing: a new tensor

    params = {name: rows(p) for name, p in stack.module.named_parameters()}
    buffers = {name: rows(b) for name, b in stack.module.named_buffers()}
    # The backend the user asked for ("auto" stays "auto"), not the one auto picked: auto
    # chooses again for the smaller stack (its choice depends on the architecture, not N).
    backend = stack.requested_backend
    padding = stack.padding.rows(index.tolist()) if stack.padding is not None else None
    generators = (
        [stack.member_generators(i) for i in index.tolist()] if stack.generator_slots else None
    )
    smaller = Stack.from_stacked(
        stack.template,
        params,
        buffers,
        len(index),
        backend=backend,
        padding=padding,
        generators=generators,
        dropout_rates={k: v[index.cpu()] for k, v in stack.dropout_rates.items()},
    )
    copy_modes(stack.module, smaller.module)
    smaller.training = stack.training
    if optimizer is not None:
        names = {id(p): name for name, p in stack.module.named_parameters()}
        held = [p for group in optimizer.param_groups for p in group["params"]]
        new = dict(smaller.module.named_parameters())
        optimizer.keep_members(index, [new[names[id(p)]] for p in held])
        _retire(stack, smaller)
    if loader is not None:
        loader.keep_members(index)
    return smaller
