"""A sweep of 8 members sharded over processes: `torchrun --nproc-per-node=2` gives each rank
half the members; run as a plain `python` command it holds all 8. Every member is built,
seeded and fed by its global index, never by rank, so both print the same losses.

    python docs/guides/torchrun_train.py [CHECKPOINT_FOLDER]
    torchrun --nproc-per-node=2 docs/guides/torchrun_train.py [CHECKPOINT_FOLDER]
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
import phalanx.distributed as pdist

N = 8
# Rank r builds only its block of members; member i is seeded with 0 + i on any rank.
stack, shard = pdist.shard(
    lambda: nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)), num_members=N, seed=0
)
lrs = torch.logspace(-3, -1, N)  # one learning rate per global member
opt = phalanx.optim.Adam(stack.parameters(), lr=shard.local(lrs).to(shard.device))

g = torch.Generator().manual_seed(0)  # the same data on every rank
x = torch.randn(768, 10, generator=g)
y = (x[:, :3] + 0.5 * torch.randn(768, 3, generator=g)).argmax(1)
loader = shard.loader(x[:512], y[:512], batch_size=64, seed=0, bootstrap=True)

for _ in range(3):
    for xb, yb in loader:  # (members on this rank, 64, ...): each member its own batch
        xb, yb = xb.to(shard.device), yb.to(shard.device)
        losses = phalanx.member_losses(F.cross_entropy, stack(xb, in_dims=0), yb, in_dims=(0, 0))
        opt.zero_grad()
        losses.sum().backward()  # members are independent: no gradient all-reduce
        opt.step()

with torch.no_grad():
    val = phalanx.member_losses(
        F.cross_entropy, stack(x[512:].to(shard.device)), y[512:].to(shard.device)
    )
all_val = shard.gather(val)  # (N,) on every rank, by global member index
# One sharded checkpoint for all ranks, in a folder every rank sees; it loads on any number
# of ranks: pdist.load(folder, stack, optimizer=opt, loader=loader) continues the run.
folder = sys.argv[1] if len(sys.argv) > 1 else "checkpoint"
pdist.save(folder, stack, optimizer=opt, loader=loader, epoch=3)
if shard.rank == 0:
    print(f"ranks {shard.world_size}, members per rank {[len(r) for r in shard.ranges]}")
    print("validation loss per member:", " ".join(f"{v:.4f}" for v in all_val.tolist()))
pdist.shutdown()
