"""The process group, the device mesh and the member layout: which rank holds which members.

Members are laid out as torch's ``DTensor`` lays out ``Shard(0)``: rank r of K holds the
contiguous block ``torch.arange(N).chunk(K)[r]``, ``ceil(N / K)`` members each and the rest
on the last rank (N = 7 on 3 ranks: 3, 3, 1), so a member block is a DTensor shard and
``torch.distributed.checkpoint``, DTensor and FSDP2 can work on it. A job may also hold data
replicas of each block: a 2-D ``DeviceMesh`` ("member", "replica"), rank = member rank x
replicas + replica; every phalanx collective then runs on the member axis's group. A plain
process without torchrun is rank 0 of 1 and holds every member, so one script runs either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from phalanx.data import MemberLoader
from phalanx.distributed._gather import broadcast, gather
from phalanx.distributed._group import (
    DEFAULT_FAILURE_TIMEOUT,
    DEFAULT_TIMEOUT,
    DistributedError,
    collective,
    comm_device,
    control_group,
    failure_timeout,
    init,
    is_distributed,
    make_control_groups,
    shutdown,
)

__all__ = [
    "DEFAULT_FAILURE_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "DistributedError",
    "Shard",
    "collective",
    "comm_device",
    "control_group",
    "failure_timeout",
    "init",
    "is_distributed",
    "layout",
    "member_range",
    "shutdown",
]


def member_range(num_members: int, world_size: int, rank: int) -> range:
    """The global member indices rank ``rank`` of ``world_size`` holds.

    DTensor's ``Shard(0)`` layout (``torch.chunk``): ``ceil(N / K)`` members per rank, the
    last rank the rest; a rank past the end holds none (which :class:`Shard` refuses).

    Example:
        >>> member_range(7, 3, 0), member_range(7, 3, 1), member_range(7, 3, 2)
        (range(0, 3), range(3, 6), range(6, 7))
    """
    size = -(-num_members // world_size)
    start = min(rank * size, num_members)
    return range(start, min(start + size, num_members))


def _usable_ranks(num_members: int, up_to: int) -> list[int]:
    """The numbers of ranks, up to ``up_to``, that leave no rank without a member."""
    return [k for k in range(1, up_to + 1) if len(member_range(num_members, k, k - 1)) > 0]


@dataclass(frozen=True)
class Shard:
    """Which of the N members this rank holds, and the collectives over the member axis.

    Rank ``rank`` of ``world_size`` holds the global members ``global_indices``, a contiguous
    block; its stack's member i is global member ``start + i``. Give seeds, hyperparameters
    and reports by global index, and slice global ``(N, ...)`` tensors with :meth:`local`.

    Attributes:
        num_members: N, the number of members over all ranks.
        rank: this process's rank.
        world_size: K, the number of ranks.
        device: where this rank's members live: its GPU under nccl, else the CPU.
    """

    num_members: int
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    replica: int = 0
    num_replicas: int = 1
    mesh: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        where = "phalanx.distributed.Shard()"
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"{where}: rank {self.rank} is not in 0..world_size-1 = 0..{self.world_size - 1}."
            )
        if self.num_replicas < 1 or not 0 <= self.replica < self.num_replicas:
            raise ValueError(
                f"{where}: replica {self.replica} is not in 0..{self.num_replicas - 1}."
            )
        if not member_range(self.num_members, self.world_size, self.world_size - 1):
            usable = _usable_ranks(self.num_members, self.world_size)
            raise ValueError(
                f"{where}: {self.num_members} members cannot be shared by {self.world_size} "
                f"ranks: in torch's Shard(0) layout (ceil(N / K) members per rank) some rank "
                f"would hold no member. Launch a number of member ranks that leaves none "
                f"empty ({', '.join(map(str, usable[-4:]))} work for N = {self.num_members}), "
                f"or train more members."
            )

    @property
    def group(self) -> Any:
        """The process group of the member axis (this replica's ranks); None: the whole job."""
        if self.mesh is None or self.num_replicas == 1:
            return None
        return self.mesh.get_group("member")

    @property
    def replica_group(self) -> Any:
        """The process group of this member block's data replicas; None without replicas."""
        if self.mesh is None or self.num_replicas == 1:
            return None
        return self.mesh.get_group("replica")

    def check_job(self, where: str) -> None:
        """Raises when this Shard does not describe the running job (its ranks and axes)."""
        if not is_distributed():
            return
        world = dist.get_world_size()
        if self.world_size * self.num_replicas == world and (
            self.num_replicas == 1 or self.mesh is not None
        ):
            return
        raise ValueError(
            f"{where}: this Shard describes {self.world_size} member ranks x "
            f"{self.num_replicas} replicas{' without a mesh' if self.mesh is None else ''}, "
            f"but the job has {world} ranks. Build it with phalanx.distributed.shard(..., "
            f"replicas=R) or phalanx.distributed.layout(N, replicas=R), which read the job's "
            f"size and make the mesh whose member-axis group the collectives use."
        )

    @property
    def is_writer(self) -> bool:
        """Whether this rank writes its block's checkpoint file: replica 0 of each block."""
        return self.replica == 0

    # ------------------------------------------------------------------------------- layout

    @property
    def global_indices(self) -> range:
        """The global indices of this rank's members, in the order its stack holds them."""
        return member_range(self.num_members, self.world_size, self.rank)

    @property
    def start(self) -> int:
        """The global index of this rank's member 0."""
        return self.global_indices.start

    @property
    def stop(self) -> int:
        """One past the global index of this rank's last member."""
        return self.global_indices.stop

    @property
    def num_local(self) -> int:
        """How many members this rank holds."""
        return len(self.global_indices)

    def __len__(self) -> int:
        return self.num_local

    @property
    def ranges(self) -> tuple[range, ...]:
        """Every rank's global member indices, by rank."""
        return tuple(
            member_range(self.num_members, self.world_size, r) for r in range(self.world_size)
        )

    def owner(self, member: int) -> int:
        """The rank that holds global member ``member``."""
        if not 0 <= member < self.num_members:
            raise IndexError(
                f"Shard.owner(): member {member} is out of range; there are "
                f"{self.num_members} members, 0..{self.num_members - 1}."
            )
        return next(r for r, block in enumerate(self.ranges) if member in block)

    def local(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's members of a global per-member tensor: ``(N, ...) -> (n_local, ...)``.

        Use it for per-member hyperparameters (``lr=shard.local(torch.logspace(-4, -1, N))``),
        targets or masks built for all N members. Returns a view.

        Raises:
            ValueError: ``x`` does not have N entries along ``dim``.
        """
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[dim] != self.num_members:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"Shard.local(): expected a tensor with the global number of members, "
                f"{self.num_members}, along dim {dim}; got {got}. A tensor that already "
                f"holds only this rank's members needs no slicing."
            )
        return x.narrow(dim, self.start, self.num_local)

    # -------------------------------------------------------------------------- collectives

    def gather(self, x: Any) -> Any:
        """All N members' values on every rank: ``(n_local, ...) -> (N, ...)``.

        See :func:`phalanx.distributed.gather`.
        """
        return gather(x, self)

    def broadcast(self, x: Any, src: int = 0) -> Any:
        """Rank ``src``'s tensor (or pytree of tensors) on every rank.

        See :func:`phalanx.distributed.broadcast`.
        """
        return broadcast(x, self, src=src)

    def barrier(self) -> None:
        """Waits until every rank reaches this point (bounded by the timeout); under nccl on
        its gloo control group, so a dead rank raises here as under gloo."""
        if is_distributed() and dist.get_world_size() > 1:
            with collective("Shard.barrier()", self, "barrier"):
                dist.barrier(group=control_group(None))

    def loader(self, *tensors: torch.Tensor, seed: int, **kwargs: Any) -> Any:
        """A :class:`phalanx.data.MemberLoader` for this rank's members, keyed by global index.

        Member i of this rank gets exactly the batches global member ``start + i`` gets in
        one process holding all members with the same ``seed``.

        Args:
            *tensors: the whole data set, identical on every rank, e.g. ``X, Y``.
            seed: the loader's seed; give the same one on every rank.
            **kwargs: ``batch_size``, ``shuffle``, ``bootstrap``, ``drop_last``.
        """
        return MemberLoader(
            *tensors, num_members=self.num_local, first_member=self.start, seed=seed, **kwargs
        )


# The last mesh built, with the group it was built in: a 2-D mesh makes process groups, so
# each shard() must not make new ones. Rebuilt after the group changes (shutdown, init).
_built: tuple[Any, tuple[int, ...], Any] | None = None


def _mesh(world: int, replicas: int) -> Any:
    """The job's DeviceMesh: ("member",) or ("member", "replica") of shape (K / R, R)."""
    global _built
    from torch.distributed.device_mesh import init_device_mesh

    shape = (world,) if replicas == 1 else (world // replicas, replicas)
    group = dist.group.WORLD
    if _built is not None and _built[0] is group and _built[1] == shape:
        return _built[2]
    kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
    names = ("member",) if replicas == 1 else ("member", "replica")
    mesh = init_device_mesh(kind, shape, mesh_dim_names=names)
    # nccl: a gloo twin of each member-axis group for the control-plane exchanges
    make_control_groups([list(range(r, world, replicas)) for r in range(replicas)])
    _built = (group, shape, mesh)
    return mesh


def layout(
    num_members: int, *, device: torch.device | str | None = None, replicas: int = 1
) -> Shard:
    """This rank's :class:`Shard` of ``num_members`` members: all of them in a plain process.

    Under torch.distributed it builds the job's ``DeviceMesh``: 1-D ("member",) or, with
    ``replicas`` > 1, 2-D ("member", "replica") of shape (K / replicas, replicas), where
    global rank g holds member block ``g // replicas`` as replica ``g % replicas``. Every
    rank must call it (the mesh's groups are made collectively).

    Args:
        num_members: N, the number of members over all ranks.
        device: where this rank's members live; None: its GPU under nccl, else the CPU.
        replicas: data replicas of each member block (each trains its block on its own
            part of the data; average their gradients over ``shard.replica_group``, e.g.
            with DDP); the number of ranks must be a multiple of it.

    Raises:
        ValueError: N is not a positive int, the ranks are not a multiple of ``replicas``,
            or some member rank would hold no member.
    """
    where = "phalanx.distributed.layout()"
    if isinstance(num_members, bool) or not isinstance(num_members, int) or num_members < 1:
        raise ValueError(f"{where}: num_members must be a positive int; got {num_members!r}.")
    rank, world = (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"{where}: replicas must be a positive int; got {replicas!r}.")
    if world % replicas:
        raise ValueError(
            f"{where}: {world} ranks cannot hold {replicas} replicas of each member block; "
            f"launch a multiple of {replicas} ranks."
        )
    dev = comm_device() if device is None else torch.device(device)
    mesh = _mesh(world, replicas) if is_distributed() else None
    return Shard(
        num_members,
        rank // replicas,
        world // replicas,
        dev,
        replica=rank % replicas,
        num_replicas=replicas,
        mesh=mesh,
    )
