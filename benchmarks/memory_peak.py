"""Peak memory (RSS) of building N members of a 1024-1024-1024 MLP, each way, in a fresh process.

Each measurement runs in its own child process and reads ``ru_maxrss`` (the peak resident set
size) at its end, so one way's peak never hides another's. Reported in GiB, with the peak of
a child that only imports torch and phalanx (``baseline``) and the size of the stacked
weights alone, so that ``peak - baseline`` can be compared with the weights.

Usage::

    flock /tmp/phalanx-bench.lock python benchmarks/memory_peak.py --sizes 64 128 256
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

WIDTH = 1024
WAYS = {
    "baseline": "import torch and phalanx, build nothing",
    "members": "a list of N members (no stack)",
    "list+stack": "a list of N members, then phalanx.stack(list): the old pdist.shard path too",
    "factory": "phalanx.core._build.stack_from_factory(factory, num_members=N)",
    "pdist.shard": "phalanx.distributed.shard(factory, num_members=N) in a plain process",
}


def _member():
    from torch import nn

    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


def _child(way: str, n: int) -> None:
    import torch

    import phalanx
    import phalanx.distributed as pdist
    from phalanx.core._build import stack_from_factory

    torch.set_num_threads(1)
    keep = None
    if way == "members":
        keep = [_member() for _ in range(n)]
    elif way == "list+stack":
        keep = phalanx.stack([_member() for _ in range(n)])
    elif way == "factory":
        keep = stack_from_factory(_member, num_members=n)
    elif way == "pdist.shard":
        keep = pdist.shard(_member, num_members=n)
    del keep
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--child", nargs=2, metavar=("WAY", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]))
        return
    per_member = 2 * (WIDTH * WIDTH + WIDTH) * 4  # float32 bytes of one member
    print(f"{'N':>5} {'weights GiB':>12} " + " ".join(f"{w:>12}" for w in WAYS))
    for n in args.sizes:
        peaks = []
        for way in WAYS:
            out = subprocess.run(
                [sys.executable, __file__, "--child", way, str(n)],
                capture_output=True,
                text=True,
                check=True,
            )
            peaks.append(int(out.stdout.split()[-1]) / 2**20)
        weights = n * per_member / 2**30
        print(f"{n:>5} {weights:>12.2f} " + " ".join(f"{p:>12.2f}" for p in peaks))
    print("peak RSS in GiB per way:")
    for way, what in WAYS.items():
        print(f"  {way:>12}: {what}")


if __name__ == "__main__":
    main()
