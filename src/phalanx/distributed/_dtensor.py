"""Member blocks as torch DTensors, so torch's own distributed tools work on a sharded stack.

Each rank's stacked tensor ``(n_local, ...)`` is the ``Shard(0)`` piece of one global
``(N, ...)`` DTensor on the job's mesh (``Replicate()`` on the replica axis, if any): the
layouts agree by construction (:func:`phalanx.distributed.member_range` is DTensor's own
chunking). The DTensors share storage with the stack, so ``torch.distributed.checkpoint``
saves them, reshards them to another number of ranks, and loads into the stack in place.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.core._stack import Stack
from phalanx.distributed._mesh import Shard
from phalanx.distributed._shard import shard_of

__all__ = ["to_dtensor", "to_dtensors"]


def to_dtensor(t: torch.Tensor, shard: Shard) -> Any:
    """This rank's ``(n_local, ...)`` member rows as its piece of the global ``(N, ...)`` DTensor.

    The DTensor shares storage with ``t`` (writes to one are writes to the other). In a plain
    process, ``t`` itself.

    Raises:
        ValueError: ``t``'s dim 0 is not this rank's number of members.
    """
    if t.dim() == 0 or t.shape[0] != shard.num_local:
        raise ValueError(
            f"phalanx.distributed.to_dtensor(): rank {shard.rank} holds {shard.num_local} "
            f"members, so the tensor's dim 0 must be {shard.num_local}; got {tuple(t.shape)}."
        )
    if shard.mesh is None:
        return t
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as DShard

    placements: list[Any] = [DShard(0)] + [Replicate()] * (shard.mesh.ndim - 1)
    shape = torch.Size((shard.num_members, *t.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        t, shard.mesh, placements, run_check=False, shape=shape, stride=stride
    )


def to_dtensors(stack: Stack, shard: Shard | None = None) -> dict[str, Any]:
    """The stack's state dict as DTensors for ``torch.distributed.checkpoint``.

    Example:
        >>> import torch.distributed.checkpoint as dcp
        >>> stack, shard = phalanx.distributed.shard(lambda i: nn.Linear(4, 2), num_members=8)
        >>> _ = dcp.save(phalanx.distributed.to_dtensors(stack), checkpoint_id="dcp")  # on K ranks
        >>> other, _ = phalanx.distributed.shard(lambda i: nn.Linear(4, 2), num_members=8, seed=1)
        >>> dcp.load(phalanx.distributed.to_dtensors(other), checkpoint_id="dcp")  # any K: in place
        >>> torch.equal(other.module.weight, stack.module.weight)
        True
    """
    mine = shard if shard is not None else shard_of(stack, "phalanx.distributed.to_dtensors()")
    return {k: to_dtensor(v, mine) for k, v in stack.state_dict(keep_vars=False).items()}
