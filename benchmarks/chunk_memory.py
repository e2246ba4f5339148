"""Peak memory (RSS) of one training step of an MLP ensemble (N=32, 64-1024-1024-10, shared
batch 512, SGD), each way in a fresh process: the loop over members, the stack, and the stack
with ``Stack.backward_in_chunks(..., chunk_members=k)``.

Each child builds the members, runs one warm step (gradients allocated), then two more, and
prints ``ru_maxrss`` (the peak resident set size: torch's CPU allocations are not seen by
tracemalloc, and the peak is what decides whether a run fits). A ``baseline`` child builds the
members and their gradients only, so ``peak - baseline`` is what the step itself adds.

Usage::

    OMP_NUM_THREADS=1 flock /tmp/bench.lock python benchmarks/chunk_memory.py
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys

N, B, H = 32, 512, 1024


def _child(way: str) -> None:
    import torch
    import torch.nn.functional as F
    from torch import nn

    import phalanx

    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = [
        nn.Sequential(nn.Linear(64, H), nn.ReLU(), nn.Linear(H, H), nn.ReLU(), nn.Linear(H, 10))
        for _ in range(N)
    ]
    x, y = torch.randn(B, 64), torch.randint(0, 10, (B,))
    if way == "loop" or way == "baseline":
        opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in models]

        def step() -> None:
            for m, o in zip(models, opts):
                o.zero_grad()
                F.cross_entropy(m(x), y).backward()
                o.step()

        if way == "baseline":
            for m in models:
                for p in m.parameters():
                    p.grad = torch.zeros_like(p)
            step = lambda: None  # noqa: E731
    else:
        stack = phalanx.stack(models)
        del models
        opt = torch.optim.SGD(stack.parameters(), lr=0.01)
        k = int(way.split("=")[1]) if "=" in way else None

        def loss(out: torch.Tensor, rows: slice) -> torch.Tensor:
            return phalanx.member_losses(F.cross_entropy, out, y)

        def step() -> None:
            opt.zero_grad()
            if k is None:
                phalanx.member_losses(F.cross_entropy, stack(x), y).sum().backward()
            else:
                stack.backward_in_chunks(loss, x, chunk_members=k)
            opt.step()

    step()
    step()
    step()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 8, 4, 1])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return
    ways = ["baseline", "loop", "stack", *[f"chunk_members={k}" for k in args.chunks]]
    env = {"OMP_NUM_THREADS": "1", "PATH": ""}
    print(f"N={N} MLP 64-{H}-{H}-10, shared batch {B}, one SGD step; peak RSS per fresh process")
    print(f"{'way':>18} {'peak MiB':>9} {'above baseline':>15}")
    base = None
    for way in ways:
        out = subprocess.run(
            [sys.executable, __file__, "--child", way],
            capture_output=True,
            text=True,
            check=True,
            env={**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        )
        peak = int(out.stdout.split()[-1]) / 1024
        base = peak if base is None else base
        print(f"{way:>18} {peak:>9.0f} {peak - base:>15.0f}")


if __name__ == "__main__":
    main()
