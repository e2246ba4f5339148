"""``shard``: a Stack of this rank's members, built by global member index."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from phalanx.core._build import build_members
from phalanx.core._stack import Stack
from phalanx.distributed._agree import describe_members, differences, exchange
from phalanx.distributed._mesh import Shard, init, is_distributed, layout

__all__ = ["shard", "shard_of"]

# The Shard each stack built by shard() belongs to, so save/load need not be told.
_shards: weakref.WeakKeyDictionary[Stack, Shard] = weakref.WeakKeyDictionary()

Factory = Callable[..., nn.Module]


def shard(
    members: Factory | Sequence[nn.Module] | nn.ModuleList,
    *,
    num_members: int | None = None,
    seed: int | None = 0,
    backend: str = "auto",
    device: torch.device | str | None = None,
    replicas: int = 1,
) -> tuple[Stack, Shard]:
    """This rank's block of N members as a :class:`phalanx.Stack`, and its :class:`Shard`.

    Under torchrun each rank gets a contiguous, balanced block of global member indices;
    in a plain process the one rank holds all N, so the same script runs both ways. Members
    are built by global index, so weights do not depend on the number of ranks.

    Args:
        members: a factory called once per member of this rank, with the global member index
            ``i`` if it takes an argument (``lambda i: MLP(width=widths[i])``) or with none
            (``MLP``); or all N modules (each rank keeps its block of them).
        num_members: N, required with a factory; with modules it must be their number.
        seed: with a factory, member ``i`` is built right after ``torch.manual_seed(seed + i)``
            (the caller's random state is left as it was), so its initial weights are those of
            ``torch.manual_seed(seed + i); factory(i)`` in one process. None leaves seeding to
            the factory. Members are built one at a time straight into the stacked tensors
            (see :func:`phalanx.core._build.stack_from_factory`): memory peaks at this rank's
            stack plus one member.
        backend: the stack's backend, as for :func:`phalanx.stack`.
        device: where to put this rank's members; None: its GPU under nccl, else the CPU.
        replicas: data replicas of each member block, on a 2-D ``DeviceMesh`` ("member",
            "replica"): K ranks hold K / replicas member blocks, each ``replicas`` times.
            Every phalanx collective then runs on the member axis; average gradients over
            ``shard.replica_group`` (e.g. ``DDP(stack, process_group=shard.replica_group)``).
            See :func:`phalanx.distributed.layout`.

    Returns:
        ``(stack, shard)``: the stack of ``shard.num_local`` members, member j being global
        member ``shard.start + j``, and this rank's :class:`Shard`.

    Raises:
        ValueError: no ``num_members`` with a factory, a count that disagrees with the
            modules, or fewer members than ranks.

    Example:
        >>> stack, shard = phalanx.distributed.shard(lambda i: nn.Linear(4, 2), num_members=8)
        >>> len(stack), shard.global_indices  # in a plain process
        (8, range(0, 8))
    """
    where = "phalanx.distributed.shard()"
    init()
    if isinstance(members, nn.Module) and not isinstance(members, nn.ModuleList):
        raise TypeError(
            f"{where}: got one {type(members).__name__}; pass a factory that builds one "
            f"member (e.g. lambda i: {type(members).__name__}(...)) with num_members=N, or a "
            f"list of all N modules."
        )
    if callable(members) and not isinstance(members, nn.ModuleList):
        if num_members is None:
            raise ValueError(
                f"{where}: with a factory, pass num_members=N, the number of members over all "
                f"ranks."
            )
        mine = layout(num_members, device=device, replicas=replicas)
        # One member at a time into the stacked tensors: never two copies of the weights.
        stack = build_members(
            members,
            mine.global_indices,
            seed=seed,
            backend=backend,
            device=mine.device,
            where=where,
        )
    else:
        modules = list(members)
        if num_members is not None and num_members != len(modules):
            raise ValueError(
                f"{where}: num_members={num_members} but {len(modules)} modules were given; "
                f"pass all N modules (each rank keeps its block) and drop num_members."
            )
        mine = layout(len(modules), device=device, replicas=replicas)
        stack = Stack(modules[mine.start : mine.stop], backend=backend).to(mine.device)
    _check_ranks_agree(stack, mine, where)
    _shards[stack] = mine
    return stack, mine


def _check_ranks_agree(stack: Stack, mine: Shard, where: str) -> None:
    """Raises on every rank when the ranks were given another N or other members.

    Found here, at the start, instead of as a gloo abort in the first gather (another N
    gives other block sizes) or as a checkpoint that can never load (other shapes).
    """
    facts = {
        "num_members": mine.num_members,
        "replicas": mine.num_replicas,
        "the members' parameters and buffers (shape, dtype)": describe_members(stack),
    }
    problems = differences(exchange(facts, mine, where, "the members' description"))
    if problems:
        raise ValueError(
            f"{where}: the ranks were given different members, so they cannot train, "
            f"gather or checkpoint as one run (rank {mine.rank} of {mine.world_size}; every "
            f"rank raises this):\n  - " + "\n  - ".join(problems) + "\nGive every rank the "
            "same num_members and the same member architecture (read the same config)."
        )


def shard_of(stack: Stack, where: str) -> Shard:
    """The Shard of a stack built by :func:`shard`; a whole-stack Shard in a plain process."""
    if stack in _shards:
        return _shards[stack]
    if is_distributed():
        raise ValueError(
            f"{where}: this stack was not built by phalanx.distributed.shard(), so which "
            f"global members it holds is unknown; pass shard=, the Shard that "
            f"phalanx.distributed.shard() returned."
        )
    return layout(len(stack))
