"""Gather and broadcast over the member axis, so callers never write collectives.

Shards are uneven when K does not divide N: each rank pads its block to the largest block,
all_gather moves equal-sized tensors, and the padding is trimmed before the blocks are joined.
Every collective runs on the member axis's group (``shard.group``): with data replicas, each
replica's member ranks gather among themselves, and ``src`` is a rank of that axis.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx._torch_compat import pytree
from phalanx.distributed._group import collective, comm_device, control_group

if TYPE_CHECKING:
    from phalanx.distributed._mesh import Shard

__all__ = ["broadcast", "gather"]


def _signature(leaves: list[torch.Tensor]) -> int:
    """A checksum of the leaves' dtypes and shapes after the member axis."""
    text = repr([(str(t.dtype), tuple(t.shape[1:])) for t in leaves])
    return zlib.crc32(text.encode())


def gather(x: Any, shard: Shard) -> Any:
    """Every member's value on every rank: ``(n_local, ...)`` blocks joined into ``(N, ...)``.

    Call it on every rank with this rank's members' tensor, e.g. the stack's output, the
    per-member losses or metrics. The result is new, detached tensors (no gradient flows
    through a gather); in a plain process, a detached copy of ``x``.

    Args:
        x: a tensor ``(n_local, ...)`` whose dim 0 is this rank's members, or a tuple, list or
            dict of such tensors (a stack's structured output).
        shard: this rank's :class:`Shard`.

    Returns:
        ``x``'s structure with ``(N, ...)`` tensors, member i at index i by global index, on
        the device ``x`` was on.

    Raises:
        ValueError: a tensor's dim 0 is not this rank's number of members, or the ranks passed
            tensors of different dtypes or shapes (every rank raises).
        DistributedError: another rank failed, or the timeout passed.

    Example:
        >>> stack, shard = phalanx.distributed.shard(lambda i: nn.Linear(4, 3), num_members=8)
        >>> x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
        >>> losses = phalanx.member_losses(F.cross_entropy, stack(x), y)  # (n_local,)
        >>> all_losses = phalanx.distributed.gather(losses, shard)  # (N,) on every rank
        >>> all_losses.shape, all_losses.requires_grad
        (torch.Size([8]), False)
        >>> best = int(all_losses.argmin())  # a global member index
    """
    where = "phalanx.distributed.gather()"
    leaves, spec = pytree.tree_flatten(x)
    for path, leaf in pytree.tree_flatten_with_path(x)[0]:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0 or len(leaf) != shard.num_local:
            got = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ValueError(
                f"{where}: rank {shard.rank} holds {shard.num_local} members (global "
                f"{shard.start}..{shard.stop - 1}), so every tensor must have {shard.num_local} "
                f"entries along dim 0; got {got} at {pytree.keystr(path) or 'the input'}. Pass "
                f"this rank's members' values, not all N."
            )
    shard.check_job(where)
    if shard.world_size == 1:  # copies, as with K ranks: no result aliases live weights
        return pytree.tree_map(lambda t: t.detach().clone(), x)
    _check_same_everywhere(leaves, shard, where)
    width = max(len(r) for r in shard.ranges)
    out = []
    with collective(where, shard, "all_gather"):
        for leaf in leaves:
            t = leaf.detach().to(comm_device())
            if t.dtype == torch.bool:  # not every backend reduces or moves bool
                t = t.to(torch.uint8)
            padded = t.new_zeros((width, *t.shape[1:]))
            padded[: len(t)] = t
            blocks = [torch.empty_like(padded) for _ in range(shard.world_size)]
            dist.all_gather(blocks, padded.contiguous(), group=shard.group)
            joined = torch.cat([b[: len(r)] for b, r in zip(blocks, shard.ranges)])
            out.append(joined.to(device=leaf.device, dtype=leaf.dtype))
    return pytree.tree_unflatten(out, spec)


def _check_same_everywhere(leaves: list[torch.Tensor], shard: Shard, where: str) -> None:
    """Raises on every rank when the ranks' leaves differ in count, dtype or trailing shape."""
    # N and K too: ranks with another N pad to another width, and all_gather of tensors of
    # different sizes aborts the process inside gloo instead of raising.
    # On the control group (gloo, CPU tensors, under nccl too): a dead or diverging peer
    # raises here on every backend, before any data collective.
    facts = [shard.num_members, shard.world_size, len(leaves), _signature(leaves)]
    mine = torch.tensor(facts, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(shard.world_size)]
    control = control_group(shard.group)
    with collective(where, shard, "all_gather of shapes"):
        dist.all_gather(everyone, mine, group=control)
    if all(torch.equal(e, everyone[0]) for e in everyone):
        return
    described = (
        f"N={shard.num_members} over {shard.world_size} ranks: "
        f"{[(str(t.dtype), tuple(t.shape)) for t in leaves]}"
    )
    table: list[Any] = [None] * shard.world_size
    with collective(where, shard, "all_gather of shapes"):
        dist.all_gather_object(table, described, group=control)
    lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(table))
    raise ValueError(
        f"{where}: the ranks passed tensors of different dtypes or shapes (after dim 0, the "
        f"members), or hold shards of another N, as (dtype, shape) per tensor:\n{lines}\n"
        f"Every rank must pass the same structure, with only dim 0 differing, and shards of "
        f"one N."
    )


def broadcast(x: Any, shard: Shard, *, src: int = 0) -> Any:
    """Rank ``src``'s tensor, or tuple/list/dict of tensors, on every rank.

    Use it for shared data read by one rank: a minibatch, a validation set, a seed. Other
    ranks may pass None. Rank ``src``, and a plain process, get ``x``'s own tensors back.

    Args:
        x: on rank ``src``, the tensor(s) to send; elsewhere ignored (None is fine).
        shard: this rank's :class:`Shard`.
        src: the sending rank.

    Returns:
        Rank ``src``'s tensors, on each rank's device.

    Raises:
        DistributedError: another rank failed, or the timeout passed.

    Example:
        >>> stack, shard = phalanx.distributed.shard(lambda i: nn.Linear(4, 3), num_members=8)
        >>> batch = torch.randn(32, 4) if shard.rank == 0 else None  # read on rank 0 only
        >>> xb = phalanx.distributed.broadcast(batch, shard)  # rank 0's batch on every rank
        >>> stack(xb).shape
        torch.Size([8, 32, 3])
    """
    where = "phalanx.distributed.broadcast()"
    if not 0 <= src < shard.world_size:
        raise ValueError(f"{where}: src must be a rank in 0..{shard.world_size - 1}; got {src}.")
    shard.check_job(where)
    if shard.world_size == 1:
        return x
    header: list[Any] = [None]
    if shard.rank == src:
        leaves, spec = pytree.tree_flatten(x)
        bad = [type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)]
        header = [
            # The spec travels as text: unpickling a TreeSpec warns in recent torch.
            None
            if bad
            else (pytree.treespec_dumps(spec), [(t.dtype, tuple(t.shape)) for t in leaves]),
        ]
    with collective(where, shard, "broadcast"):
        dist.broadcast_object_list(
            header, group_src=src, group=control_group(shard.group), device=torch.device("cpu")
        )
    if header[0] is None:
        raise TypeError(
            f"{where}: rank {src} must pass a tensor or a tuple, list or dict of tensors; "
            f"it passed {type(x).__name__ if shard.rank == src else 'something else'}."
        )
    spec_text, meta = header[0]
    out = []
    with collective(where, shard, "broadcast"):
        for k, (dtype, shape) in enumerate(meta):
            if shard.rank == src:
                t = leaves[k].detach().to(comm_device()).contiguous()
            else:
                t = torch.empty(shape, dtype=dtype, device=comm_device())
            dist.broadcast(t, group_src=src, group=shard.group)
            out.append(t if shard.rank == src else t.to(shard.device))
    return pytree.tree_unflatten(out, pytree.treespec_loads(spec_text))
