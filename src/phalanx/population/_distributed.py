"""Copying members between ranks: the exploit of population-based training, sharded.

A member moves as one message: its weights, buffers, optimizer rows and hyperparameters
packed into one float64 vector (float64 holds every float32, float16, bfloat16, bool and
small int exactly), sent point to point from the rank that owns the source to the rank that
owns the target. Every rank makes the same calls with the same global indices; pairs whose
source and target share a rank are plain local copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from phalanx._members import pairs
from phalanx.distributed import DistributedError
from phalanx.distributed._group import control_group
from phalanx.population._rows import copy_within, member_tensors

if TYPE_CHECKING:
    from phalanx.core._stack import Stack
    from phalanx.data import MemberLoader
    from phalanx.distributed import Shard
    from phalanx.optim import MemberOptimizer

__all__ = ["copy_across_ranks"]

WHERE = "phalanx.population.copy_members()"


def _rows(stack: Stack, optimizer: Any, member: int, hyperparameters: bool) -> list[Tensor]:
    rows = [t[member].detach().clone() for t in member_tensors(stack)]
    if optimizer is not None:
        rows += optimizer.member_rows(member, hyperparameters=hyperparameters)
    return rows


def _pack(rows: list[Tensor], device: torch.device) -> Tensor:
    return torch.cat([r.reshape(-1).to(device, torch.float64) for r in rows])


def _unpack(flat: Tensor, like: list[Tensor]) -> list[Tensor]:
    out, start = [], 0
    for t in like:
        out.append(flat[start : start + t.numel()].view(t.shape).to(t.dtype))
        start += t.numel()
    return out


def _error(shard: Shard, what: str, e: Exception) -> Exception:
    return DistributedError(
        f"{WHERE}: rank {shard.rank} of {shard.world_size}: {what} did not complete ({e}). "
        "Another rank most likely raised or died, or called copy_members with other indices."
    )


@torch.no_grad()
def copy_across_ranks(
    stack: Stack,
    source: Any,
    target: Any,
    optimizer: MemberOptimizer | None,
    loader: MemberLoader | None,
    hyperparameters: bool,
    shard: Shard,
) -> None:
    """``copy_members`` with global indices over ranks; see ``phalanx.population.copy_members``."""
    src, dst = pairs(source, target, shard.num_members, WHERE)
    device = shard.device if dist.get_backend() == "nccl" else torch.device("cpu")
    like = _rows(stack, optimizer, 0, hyperparameters)
    size = sum(t.numel() for t in like)
    # One small collective first, so that ranks whose stacks or optimizers differ (one has
    # stepped, one has not) fail with a message instead of a mismatched receive.
    # On the control group (gloo under nccl too): a dead peer raises here, at once.
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(shard.world_size)]
    try:
        dist.all_gather(
            sizes, torch.tensor([size], dtype=torch.int64), group=control_group(shard.group)
        )
    except RuntimeError as e:
        raise _error(shard, "the all_gather of member sizes", e) from e
    if len({int(s) for s in sizes}) > 1:
        raise ValueError(
            f"{WHERE}: a member's state has {[int(s) for s in sizes]} numbers on ranks "
            f"0..{shard.world_size - 1}; every rank must hold the same architecture and an "
            "optimizer at the same point (call it after the same number of steps everywhere)."
        )
    if loader is not None:
        streams = shard.gather(loader.streams)  # (N,): tiny, and keeps the stream ids global

    owner = {int(i): shard.owner(int(i)) for i in torch.cat([src, dst]).unique()}
    mine = shard.rank
    outgoing, local, incoming = [], [], []
    for s, d in zip(src.tolist(), dst.tolist()):
        if owner[s] == mine and owner[d] == mine:
            local.append((s - shard.start, d - shard.start))
        elif owner[s] == mine:
            rows = _rows(stack, optimizer, s - shard.start, hyperparameters)
            outgoing.append((_pack(rows, device), d))
        elif owner[d] == mine:
            incoming.append((torch.empty(size, dtype=torch.float64, device=device), s, d))
    # Sources are packed above, before any local write; receives are written after the
    # local copies, so every source is read before any target is written.
    try:
        # Peers are ranks of the member axis: with data replicas, each replica's ranks copy
        # among themselves, so every replica's target receives the same source.
        # One batch of point-to-point operations (ncclGroupStart/End under nccl): nccl
        # ignores tags and matches a pair's sends and receives in the order they are posted,
        # so single isend/irecv calls of two ranks exchanging members both ways can wait on
        # each other. Both ends post a pair's messages in the order of the (source, target)
        # list, the same on every rank, so the k-th message between two ranks is the same
        # member on both sides.
        group = shard.group
        ops = [
            dist.P2POp(dist.isend, buf, group=group, group_peer=owner[d], tag=d)
            for buf, d in outgoing
        ]
        ops += [
            dist.P2POp(dist.irecv, buf, group=group, group_peer=owner[s], tag=d)
            for buf, s, d in incoming
        ]
        requests = dist.batch_isend_irecv(ops) if ops else []
        if local:
            ls, ld = zip(*local)
            copy_within(stack, list(ls), list(ld), optimizer, None, hyperparameters, WHERE)
        for request in requests:
            request.wait()
    except RuntimeError as e:
        raise _error(shard, "a point-to-point copy", e) from e
    tensors = member_tensors(stack)
    n_stack = len(tensors)
    for buf, _, d in incoming:
        rows = _unpack(buf, like)
        j = d - shard.start
        for t, row in zip(tensors, rows[:n_stack]):
            t[j] = row.to(t.device)
        if optimizer is not None:
            optimizer.set_member_rows(j, rows[n_stack:], hyperparameters=hyperparameters)
    if loader is not None:
        here = [
            (d - shard.start, int(streams[s]))
            for s, d in zip(src.tolist(), dst.tolist())
            if owner[d] == mine
        ]
        if here:
            members, ids = zip(*here)
            loader.set_streams(list(members), list(ids))
