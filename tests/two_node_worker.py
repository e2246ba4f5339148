"""The worker of tests/test_distributed_nodes.py: a sweep that checkpoints, and a node that dies.

Run by two torchrun "nodes" on 127.0.0.1 (``--nnodes=2``), or imported by the test to run the
same training in one process. With ``--replicas 2`` and 2 processes per node, the job is 2
member blocks x 2 data replicas (node 0 holds block 0, node 1 block 1; DDP over each block's
replicas, each replica taking half of every member's batch). With ``--kill``, the ranks of
member block 1 SIGKILL themselves right after the save at step ``--save-at``, while the
others train on (no collective in sight) until the failure detector names a dead rank;
the first survivor told writes what it was told, and when, to ``--report``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import phalanx
import phalanx.distributed as pdist

N = 6
F64 = torch.float64


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)


def build(replicas: int = 1):
    """This rank's stack, optimizer and loader, as a fresh run builds them."""
    stack, shard = pdist.shard(member, num_members=N, seed=0, backend="vmap", replicas=replicas)
    opt = phalanx.optim.Adam(stack.parameters(), lr=shard.local(torch.linspace(1e-3, 3e-2, N)))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 6, generator=g, dtype=F64), torch.randint(0, 3, (40,), generator=g)
    loader = shard.loader(x, y, batch_size=8, seed=3, bootstrap=True)
    return stack, shard, opt, loader


def steps(stack, shard, opt, loader):
    """Training steps without end, epoch after epoch."""
    model = stack
    if shard.num_replicas > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(stack, process_group=shard.replica_group)
    while True:
        for xb, yb in loader:
            if shard.num_replicas > 1:  # each replica: its part of every member's batch
                part = xb.shape[1] // shard.num_replicas
                mine = slice(shard.replica * part, (shard.replica + 1) * part)
                xb, yb = xb[:, mine], yb[:, mine]
            out = model(xb, in_dims=0)
            losses = phalanx.member_losses(F.cross_entropy, out, yb, in_dims=(0, 0))
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
            yield


def final(stack, shard) -> dict:
    return shard.gather(dict(stack.state_dict()))


def run(
    ckpt: str,
    total: int,
    save_at: int,
    resume: bool = False,
    kill: bool = False,
    report: str | None = None,
    replicas: int = 1,
) -> dict:
    stack, shard, opt, loader = build(replicas)
    step = pdist.load(ckpt, stack, opt, loader=loader)["step"] if resume else 0
    trainer = steps(stack, shard, opt, loader)
    try:
        while step < total:
            next(trainer)
            step += 1
            if step == save_at:
                pdist.save(ckpt, stack, opt, loader=loader, step=step)
                if kill and shard.rank == 1:
                    Path(f"{ckpt}.died").write_text(str(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)
            if kill and step > save_at:
                time.sleep(0.02)  # the survivor trains on, slowly, between two saves
    except pdist.DistributedError as e:
        if report is not None:
            # The first survivor to be told writes: torchrun's agent stops a node's other
            # workers (SIGTERM) as soon as one of them exits.
            died = float(Path(f"{ckpt}.died").read_text())
            told = json.dumps({"message": str(e), "seconds": time.time() - died})
            try:
                with open(report, "x") as f:
                    f.write(told)
            except FileExistsError:
                pass
        raise
    return final(stack, shard)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--kill", action="store_true")
    p.add_argument("--report", default=None)
    p.add_argument("--failure-timeout", type=float, default=5.0)
    p.add_argument("--replicas", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(1)
    pdist.init(timeout=60, failure_timeout=a.failure_timeout)
    run(a.ckpt, a.steps, a.save_at, kill=a.kill, report=a.report, replicas=a.replicas)
    pdist.shutdown()


if __name__ == "__main__":
    main()
