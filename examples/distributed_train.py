"""A learning-rate sweep of N small classifiers, sharded over processes with torch.distributed.

Each member is `Linear(10, 32) -> ReLU -> Linear(32, 3)` trained with its own learning rate on
its own bootstrap resample of one synthetic data set. The same script runs

    python examples/distributed_train.py                             # one process, all members
    torchrun --nproc-per-node=2 examples/distributed_train.py        # two ranks, half each

and prints the same per-member validation losses either way: members are built, seeded and
fed by global member index, never by rank. Pass --checkpoint DIR to save a sharded checkpoint
of the whole run (weights, optimizer, the loader's position, the epoch; it loads on any number
of ranks) and --resume to continue from it: `--epochs 3` then `--epochs 3 --resume`, on any
number of ranks, prints what `--epochs 6` prints.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
import phalanx.distributed as pdist


def make_member() -> nn.Module:
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))


def make_data(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same synthetic 3-class problem on every rank: no rank reads another's data."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(10, 3, generator=g)
    x = torch.randn(n, 10, generator=g)
    return x, (x @ w + 0.5 * torch.randn(n, 3, generator=g)).argmax(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoint", default=None, help="directory of a sharded checkpoint")
    parser.add_argument("--resume", action="store_true", help="load --checkpoint first")
    args = parser.parse_args()
    n = args.members

    # Rank r builds only its block of members; member i is seeded with 0 + i on any rank.
    stack, shard = pdist.shard(make_member, num_members=n, seed=0)
    lrs = torch.logspace(-3, -1, n)  # one learning rate per global member
    opt = phalanx.optim.Adam(stack.parameters(), lr=shard.local(lrs).to(shard.device))
    x, y = make_data(768)
    x_train, y_train, x_val, y_val = x[:512], y[:512], x[512:], y[512:]
    loader = shard.loader(x_train, y_train, batch_size=64, seed=0, bootstrap=True)
    start = 0
    if args.resume:  # the loader continues each member's data stream where it stopped
        start = pdist.load(args.checkpoint, stack, optimizer=opt, loader=loader)["epoch"]

    for _ in range(start, start + args.epochs):
        for xb, yb in loader:  # (n_local, 64, 10), (n_local, 64): each member its own batch
            xb, yb = xb.to(shard.device), yb.to(shard.device)
            logits = stack(xb, in_dims=0)
            losses = phalanx.member_losses(F.cross_entropy, logits, yb, in_dims=(0, 0))
            opt.zero_grad()
            losses.sum().backward()  # each member gets its own gradient; no all-reduce
            opt.step()

    with torch.no_grad():
        logits = stack(x_val.to(shard.device))  # shared input: (n_local, 256, 3)
        val = phalanx.member_losses(F.cross_entropy, logits, y_val.to(shard.device))
        all_val = shard.gather(val)  # (N,) on every rank, by global member index
        probs = shard.gather(logits.softmax(-1)).mean(0)  # the ensemble of all N members
    if shard.rank == 0:
        best = int(all_val.argmin())
        accuracy = (probs.argmax(-1).cpu() == y_val).float().mean().item()
        print(f"ranks: {shard.world_size}, members per rank: {[len(r) for r in shard.ranges]}")
        print("validation loss per member:", " ".join(f"{v:.6f}" for v in all_val.tolist()))
        print(f"best member: {best} (lr {lrs[best]:.4g}), ensemble accuracy: {accuracy:.4f}")
    if args.checkpoint:
        pdist.save(args.checkpoint, stack, optimizer=opt, loader=loader, epoch=start + args.epochs)
    pdist.shutdown()


if __name__ == "__main__":
    main()
