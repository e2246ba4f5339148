"""Peak memory (RSS) of one training step, the loop over members against the stack, each way
in a fresh process: W7 of DESIGN.md (16 CNNs with BatchNorm, shared batch 64 of 1x28x28) and
the MLP ensemble of issue 26 (32 members of 64-1024-1024-10, shared batch 512), SGD.

Each child builds the members, runs one warm step (gradients allocated), resets the peak
resident set (``/proc/self/clear_refs``) and runs two more steps; it prints the peak (VmHWM,
the number that decides whether a run fits) and what the steps added to the resident set at
their peak over the warm process. torch's CPU allocations are not seen by ``tracemalloc``.

Usage::

    OMP_NUM_THREADS=1 flock /tmp/bench.lock python benchmarks/step_memory.py
    python benchmarks/step_memory.py --workloads w7 --ways loop fused

``fused/k`` runs the step with ``Stack.backward_in_chunks(..., chunk_members=k)``: k members'
activations alive at once instead of N's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

WAYS = ("loop", "fused", "vmap", "fused/4", "fused/2")
"""``fused/k``: ``Stack.backward_in_chunks(..., chunk_members=k)``, k members at a time."""


def _members(workload: str):  # -> (members, x, y)
    import torch
    from torch import nn

    torch.manual_seed(0)
    if workload == "w7":

        def cnn() -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(1, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(16, 32, 3), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                nn.Flatten(), nn.Linear(800, 10),
            )  # fmt: skip

        return [cnn() for _ in range(16)], torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    h = 1024

    def mlp() -> nn.Module:
        return nn.Sequential(
            nn.Linear(64, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10)
        )

    return [mlp() for _ in range(32)], torch.randn(512, 64), torch.randint(0, 10, (512,))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def _child(workload: str, way: str) -> dict:
    import torch
    import torch.nn.functional as F

    import phalanx

    torch.set_num_threads(1)
    members, x, y = _members(workload)
    if way == "loop":
        opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in members]

        def step() -> None:
            for m, o in zip(members, opts):
                o.zero_grad()
                F.cross_entropy(m(x), y).backward()
                o.step()
    else:
        backend, _, chunk = way.partition("/")
        stack = phalanx.stack(members, backend=backend)
        del members
        opt = torch.optim.SGD(stack.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad()
            if chunk:
                stack.backward_in_chunks(
                    lambda out, rows: phalanx.member_losses(F.cross_entropy, out, y),
                    x,
                    chunk_members=int(chunk),
                )
            else:
                phalanx.member_losses(F.cross_entropy, stack(x), y).sum().backward()
            opt.step()

    step()  # warm: gradients allocated
    base = _status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current RSS
    step()
    step()
    peak = _status("VmHWM:")
    return {"peak_mib": peak / 1024, "added_mib": (peak - base) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["w7", "mlp"], choices=["w7", "mlp"])
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    parser.add_argument(
        "--before",
        action="store_true",
        help="BatchNorm as one call over all members' channels (main's rule before issue 26)",
    )
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.before:
            from phalanx.backends.rules import _norm

            _norm.ALONE_BYTES = 1 << 60
        print(json.dumps(_child(*args.child)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"{'workload':>8} {'way':>6} {'peak MiB':>9} {'added MiB':>10} {'peak/loop':>10}")
    for workload in args.workloads:
        loop = None
        for way in args.ways:
            out = subprocess.run(
                [sys.executable, __file__, "--child", workload, way, *(["--before"] if args.before else [])],
                capture_output=True, text=True, check=True, env=env,
            )  # fmt: skip
            r = json.loads(out.stdout.strip().splitlines()[-1])
            loop = r["peak_mib"] if way == "loop" else loop
            ratio = f"{r['peak_mib'] / loop:.2f}x" if loop else "-"
            print(
                f"{workload:>8} {way:>6} {r['peak_mib']:>9.0f} {r['added_mib']:>10.0f} {ratio:>10}"
            )


if __name__ == "__main__":
    main()
