"""The process group: joining it, leaving it, and turning a failed collective into a message.

``init`` joins the group torchrun describes (or any init method) and starts the failure
detector (:mod:`._health`); ``collective`` wraps every phalanx collective so that a failure
names the dead rank when the detector knows it, and says what to check otherwise.
"""

from __future__ import annotations

import datetime
import gc
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx import _torch_compat as compat
from phalanx._errors import first_line
from phalanx.distributed import _health
from phalanx.distributed._errors import DistributedError

if TYPE_CHECKING:
    from phalanx.distributed._mesh import Shard

__all__ = [
    "DEFAULT_FAILURE_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "DistributedError",
    "collective",
    "comm_device",
    "control_group",
    "failure_timeout",
    "init",
    "is_distributed",
    "shutdown",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)
DEFAULT_FAILURE_TIMEOUT = 15.0  # seconds of silence after which a rank is named dead
_timeout: datetime.timedelta = DEFAULT_TIMEOUT
_failure_timeout: float | None = DEFAULT_FAILURE_TIMEOUT


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
        make_control_groups([list(range(dist.get_world_size()))])
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
    make_control_groups([list(range(world_size))])
    _start_heartbeat()
    return True


def _start_heartbeat() -> None:
    if _failure_timeout is None or _health.current() is not None:
        return
    store = compat.default_store()  # private in torch: None turns the heartbeat off
    if store is None:
        return
    if dist.get_world_size() < 2:
        return
    # A key space for this group's beats, drawn by rank 0: one collective, at init.
    run = [secrets.token_hex(8) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(run, src=0, group=control_group(None), device=torch.device("cpu"))
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

    _health.stop("finished")
    _control.clear()
    gc.collect()
    if is_distributed():
        dist.destroy_process_group()


def comm_device() -> torch.device:
    """Where collectives move tensors: this rank's GPU under nccl, else the CPU."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Under nccl, gloo groups over the same ranks as the job's groups, by ranks, with the WORLD
# group they were made in (a new init makes new ones).
_control: dict[tuple[int, ...], tuple[Any, Any]] = {}


def make_control_groups(rank_lists: list[list[int]]) -> None:
    """Under nccl, makes a gloo group over each list of ranks (collectively: every rank of
    the job calls this with the same lists, in the same order); under gloo, nothing."""
    if not is_distributed() or dist.get_backend() != "nccl":
        return
    world = dist.group.WORLD
    for ranks in rank_lists:
        key = tuple(sorted(ranks))
        if key in _control and _control[key][0] is world:
            continue
        side = dist.new_group(list(key), timeout=_timeout, backend="gloo")
        _control[key] = (world, side)


def control_group(group: Any) -> Any:
    """The group that carries phalanx's control-plane exchanges among ``group``'s ranks
    (None: the whole job): sizes, shapes and dtypes, headers, agreement tables.

    Under gloo it is ``group``. Under nccl it is a gloo group over the same ranks, made by
    ``init`` and ``layout``: gloo raises at once when a peer is gone or calls differ, where
    nccl has no error to raise (a collective whose peer died waits until the watchdog's
    timeout aborts the process, or hangs), so the checks that come before the data
    collectives raise the same :class:`DistributedError` on either backend. Their tensors
    are on the CPU.
    """
    if not is_distributed() or dist.get_backend() != "nccl":
        return group
    ranks = tuple(
        sorted(dist.get_process_group_ranks(group))
        if group is not None
        else range(dist.get_world_size())
    )
    found = _control.get(ranks)
    if found is None or found[0] is not dist.group.WORLD:
        raise RuntimeError(
            f"phalanx.distributed: no gloo control group over ranks {list(ranks)}; the job's "
            f"groups are made by phalanx.distributed.init() and layout()/shard(). Build "
            f"the shard with phalanx.distributed.shard() after init()."
        )
    return found[1]


@contextmanager
def collective(where: str, shard: Shard, op: str) -> Iterator[None]:
    """Turns a failed collective into a :class:`DistributedError` that says what to check.

    Each rank counts its arrivals at phalanx's collectives in the job's store (with the
    failure detector on): a rank whose collective times out names the ranks that never
    reached it, not itself.
    """
    monitor = _health.current()
    # Counted over every rank only where every rank takes part (no replica groups).
    arrived = (
        monitor.arrive(f"{where}: {op}")
        if monitor is not None and shard.num_replicas == 1
        else None
    )
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, DistributedError):
            raise
        first = first_line(e) or type(e).__name__
        # A peer that died closes its connections at once, but only the failure detector
        # can say which one it was: wait for its verdict, bounded by its deadline. A timeout
        # means the peers are alive, so no verdict is coming.
        timed_out = "timed out" in str(e).lower() or "timeout" in str(e).lower()
        late = monitor.not_arrived(arrived) if timed_out and monitor and arrived else []
        if late:
            raise DistributedError(
                f"{where}: rank {shard.rank} of {shard.world_size} waited in the {op} until "
                f"the timeout ({_timeout.total_seconds():g} s, "
                f"phalanx.distributed.init(timeout=...)): " + "; ".join(late) + ". Look for "
                "what that rank is doing (a hang, a long step) or why its calls differ."
            ) from e
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
