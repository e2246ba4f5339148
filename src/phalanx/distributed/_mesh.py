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

import datetime
import gc
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT",
    "DistributedError",
    "Shard",
    "comm_device",
    "init",
    "is_distributed",
    "layout",
    "member_range",
    "shutdown",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
DEFAULT_FAILURE_TIMEOUT = 15.0  # seconds of silence after which a rank is named dead
_timeout: datetime.timedelta = DEFAULT_TIMEOUT
_failure_timeout: float | None = DEFAULT_FAILURE_TIMEOUT


class DistributedError(RuntimeError):
    """A collective failed: another rank raised, died, or stopped making the same calls."""


def is_distributed() -> bool:
    """True when this process is one rank of an initialised torch.distributed process group."""
    return dist.is_available() and dist.is_initialized()


def _seconds(timeout: datetime.timedelta | float) -> datetime.timedelta:
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ValueError(
            f"phalanx.distributed.init(): timeout must be a positive number of seconds or a "
            f"datetime.timedelta; got {timeout!r}."
        )
    return datetime.timedelta(seconds=float(timeout))


def init(
    *,
    backend: str | None = None,
    timeout: datetime.timedelta | float = DEFAULT_TIMEOUT,
    init_method: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    failure_timeout: float | None = DEFAULT_FAILURE_TIMEOUT,
) -> bool:
    """Joins the process group that torchrun describes; a no-op in a plain process.

    Under torchrun (the environment holds ``WORLD_SIZE``, ``RANK`` and ``MASTER_ADDR``) or with
    an explicit ``init_method``, this initialises torch.distributed: nccl with one GPU per rank
    (``LOCAL_RANK``) when CUDA is available, gloo on CPU otherwise. Without either it does
    nothing, and the process runs as rank 0 of 1. Calling it again is a no-op.
    :func:`phalanx.distributed.shard` calls it for you.

    Args:
        backend: "gloo" or "nccl"; None picks nccl when CUDA is available, else gloo.
        timeout: how long a collective (gather, broadcast, checkpoint barrier) waits for the
            other ranks before it fails, in seconds or as a timedelta. A rank that raises or
            dies makes the others fail at once; this bounds the wait for one that hangs.
        init_method: a torch.distributed init method such as ``"file:///tmp/store"``; None
            reads torchrun's environment (``env://``).
        rank: this process's rank, with ``init_method``; None reads ``RANK``.
        world_size: the number of ranks, with ``init_method``; None reads ``WORLD_SIZE``.
        failure_timeout: seconds without a heartbeat after which a rank is named dead: every
            rank then raises :class:`DistributedError` naming it, wherever its main thread
            is (training steps make no collective call, so nothing else would notice). A
            thread beats through the job's c10d store every ``failure_timeout / 15`` s (at
            most 1 s). None turns the detector off.

    Returns:
        True if this process is now one rank of a process group, False in a plain process.

    Raises:
        ValueError: an ``init_method`` without ``rank`` and ``world_size``, or a bad timeout.

    Example:
        >>> phalanx.distributed.init()  # False in a plain process, True under torchrun
        False
    """
    global _timeout, _failure_timeout
    where = "phalanx.distributed.init()"
    timeout = _seconds(timeout)
    if failure_timeout is not None:
        failure_timeout = _seconds(failure_timeout).total_seconds()
    _failure_timeout = failure_timeout
    if is_distributed():
        _start_heartbeat()
        return True
    if init_method is None:
        if "WORLD_SIZE" not in os.environ:
            return False
        init_method = "env://"
    rank = int(os.environ.get("RANK", -1)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", -1)) if world_size is None else world_size
    if rank < 0 or world_size < 1:
        raise ValueError(
            f"{where}: init_method={init_method!r} needs this process's rank and the number of "
            f"ranks; pass rank= and world_size=, or launch with torchrun, which sets RANK and "
            f"WORLD_SIZE."
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device_id = None
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local_rank)
        device_id = torch.device("cuda", local_rank)
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        device_id=device_id,
    )
    _timeout = timeout
    _start_heartbeat()
    return True


def _start_heartbeat() -> None:
    from phalanx.distributed import _health

    if _failure_timeout is None or _health.current() is not None:
        return
    try:  # the default group's store: private in torch, so a missing one turns this off
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
    except Exception:
        return
    if dist.get_world_size() < 2:
        return
    # A key space for this group's beats, drawn by rank 0: one collective, at init.
    run = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(run, src=0, device=comm_device())
    interval = min(1.0, _failure_timeout / 15)
    _health.start(
        store, dist.get_rank(), dist.get_world_size(), interval, _failure_timeout, str(run[0])
    )


def failure_timeout() -> float | None:
    """The failure detector's deadline in seconds, None when it is off."""
    return _failure_timeout


def shutdown() -> None:
    """Leaves the process group (if any), releasing it cleanly before the process exits.

    Collects garbage first: process-group objects still referenced at interpreter exit have
    aborted runs after correct results.
    """
    from phalanx.distributed import _health

    _health.stop("finished")
    gc.collect()
    if is_distributed():
        dist.destroy_process_group()


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


def comm_device() -> torch.device:
    """Where collectives move tensors: this rank's GPU under nccl, else the CPU."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
        from phalanx.distributed._gather import gather

        return gather(x, self)

    def broadcast(self, x: Any, src: int = 0) -> Any:
        """Rank ``src``'s tensor (or pytree of tensors) on every rank.

        See :func:`phalanx.distributed.broadcast`.
        """
        from phalanx.distributed._gather import broadcast

        return broadcast(x, self, src=src)

    def barrier(self) -> None:
        """Waits until every rank reaches this point (bounded by the timeout)."""
        if is_distributed() and dist.get_world_size() > 1:
            with collective("Shard.barrier()", self, "barrier"):
                dist.barrier()

    def loader(self, *tensors: torch.Tensor, seed: int, **kwargs: Any) -> Any:
        """A :class:`phalanx.data.MemberLoader` for this rank's members, keyed by global index.

        Member i of this rank gets exactly the batches global member ``start + i`` gets in
        one process holding all members with the same ``seed``.

        Args:
            *tensors: the whole data set, identical on every rank, e.g. ``X, Y``.
            seed: the loader's seed; give the same one on every rank.
            **kwargs: ``batch_size``, ``shuffle``, ``bootstrap``, ``drop_last``.
        """
        from phalanx.data import MemberLoader

        return MemberLoader(
            *tensors, num_members=self.num_local, first_member=self.start, seed=seed, **kwargs
        )


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
    mesh = None
    if is_distributed():
        from torch.distributed.device_mesh import init_device_mesh

        kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
        if replicas == 1:
            mesh = init_device_mesh(kind, (world,), mesh_dim_names=("member",))
        else:
            shape = (world // replicas, replicas)
            mesh = init_device_mesh(kind, shape, mesh_dim_names=("member", "replica"))
    return Shard(
        num_members,
        rank // replicas,
        world // replicas,
        dev,
        replica=rank % replicas,
        num_replicas=replicas,
        mesh=mesh,
    )


@contextmanager
def collective(where: str, shard: Shard, op: str) -> Iterator[None]:
    """Turns a failed collective into a :class:`DistributedError` that says what to check."""
    from phalanx.distributed import _health

    try:
        yield
    except RuntimeError as e:
        if isinstance(e, DistributedError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        # A peer that died closes its connections at once, but only the failure detector
        # can say which one it was: wait for its verdict, bounded by its deadline. A timeout
        # means the peers are alive, so no verdict is coming.
        timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        waits = not timed_out and _failure_timeout is not None and _health.wait_in_collectives
        wait = _failure_timeout + 2.0 if waits and _failure_timeout is not None else 0.0
        found = _health.verdict(wait=wait)
        if found is not None:
            raise DistributedError(f"{where}: the {op} did not complete ({first}): {found}") from e
        raise DistributedError(
            f"{where}: rank {shard.rank} of {shard.world_size}: the {op} did not complete "
            f"({first}). Another rank most likely raised or died (look for its traceback), or "
            f"stopped making the same collective calls in the same order. A rank that only "
            f"hangs makes the others fail after the timeout given to "
            f"phalanx.distributed.init(timeout=...), now {_timeout.total_seconds():g} s."
        ) from e
