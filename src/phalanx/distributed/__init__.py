"""The member axis sharded over processes, GPUs and machines with torch.distributed.

Members are independent, so each rank holds a contiguous block of them and trains it alone:
no gradient all-reduce, only data in and predictions out. The same script runs as a plain
process (one rank holding every member) and under torchrun::

    stack, shard = phalanx.distributed.shard(make_member, num_members=N, seed=0)
    opt = phalanx.optim.Adam(stack.parameters(), lr=shard.local(lrs))  # lrs: (N,)
    for xb, yb in shard.loader(X, Y, batch_size=32, seed=0):           # per-member data
        losses = phalanx.member_losses(F.cross_entropy, stack(xb, in_dims=0), yb, in_dims=(0, 0))
        opt.zero_grad(); losses.sum().backward(); opt.step()
    all_losses = shard.gather(losses.detach())                         # (N,) on every rank
    phalanx.distributed.save("ckpt", stack, optimizer=opt)             # loads on any K

Everything random is keyed by the global member index, so results do not depend on the
number of ranks. Member blocks are DTensor ``Shard(0)`` pieces on a ``DeviceMesh`` (with an
optional data-replica axis: ``shard(..., replicas=2)``), a dead rank is named within
``init(failure_timeout=...)`` seconds, and a checkpoint holds the whole run.
"""

from phalanx.distributed._checkpoint import load, save
from phalanx.distributed._dtensor import to_dtensor, to_dtensors
from phalanx.distributed._gather import broadcast, gather
from phalanx.distributed._launch import launch
from phalanx.distributed._mesh import (
    DistributedError,
    Shard,
    init,
    is_distributed,
    layout,
    member_range,
    shutdown,
)
from phalanx.distributed._shard import shard

__all__ = [
    "DistributedError",
    "Shard",
    "broadcast",
    "gather",
    "init",
    "is_distributed",
    "launch",
    "layout",
    "load",
    "member_range",
    "save",
    "shard",
    "shutdown",
    "to_dtensor",
    "to_dtensors",
]


def __dir__() -> list[str]:  # dir() and tab completion offer the public names only
    return list(__all__)
