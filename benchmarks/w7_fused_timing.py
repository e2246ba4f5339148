"""W7's training step (16 CNNs with BatchNorm, SGD): the loop against the fused stack, in one
process on identical weights and data, interleaved rounds, medians.

Two questions, one mode each:

- ``faults``: the minor page faults, system and user CPU time of a step, the loop and the
  fused stack, with malloc as phalanx sets it and (``PHALANX_CPU_ALLOCATOR=system``, run it
  again with that set) with glibc's defaults.
- ``pool`` (default): the fused stack with the channels-last max-pool rule
  (``rules/_pool.py``) and without it (torch.func's rule), against the loop.
- ``adam``: the same, with the step of ``phalanx bench``'s contenders: the loop sums the 16
  losses for one backward and steps ``torch.optim.Adam``, the stack ``phalanx.optim.Adam``.

Usage::

    OMP_NUM_THREADS=1 flock /tmp/bench.lock python benchmarks/w7_fused_timing.py pool 11
    OMP_NUM_THREADS=1 flock /tmp/bench.lock python benchmarks/w7_fused_timing.py adam 11
    OMP_NUM_THREADS=1 flock /tmp/bench.lock python benchmarks/w7_fused_timing.py faults
    PHALANX_CPU_ALLOCATOR=system OMP_NUM_THREADS=1 flock /tmp/bench.lock \\
        python benchmarks/w7_fused_timing.py faults
"""

import copy
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import phalanx
from phalanx.backends.rules import SPEED

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_memory import _members

torch.set_num_threads(1)
mode = sys.argv[1] if len(sys.argv) > 1 else "pool"
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 11
members, x, y = _members("w7")
loop_members = copy.deepcopy(members)
loop_opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in loop_members]
loop_adam = torch.optim.Adam([p for m in loop_members for p in m.parameters()], lr=1e-3)
ways = ("channels-last pool", "torch.func pool") if mode != "faults" else ("fused",)
stacks = {k: phalanx.stack(copy.deepcopy(members), backend="fused") for k in ways}
opt = phalanx.optim.Adam if mode == "adam" else torch.optim.SGD
opts = {k: opt(s.parameters(), lr=1e-3 if mode == "adam" else 0.01) for k, s in stacks.items()}
pool_rule = SPEED[F.max_pool2d]


def loop() -> None:
    if mode == "adam":
        loop_adam.zero_grad(set_to_none=True)
        torch.stack([F.cross_entropy(m(x), y) for m in loop_members]).sum().backward()
        loop_adam.step()
        return
    for m, o in zip(loop_members, loop_opts):
        o.zero_grad()
        F.cross_entropy(m(x), y).backward()
        o.step()


def fused(k: str) -> None:
    if k == "torch.func pool":
        SPEED.pop(F.max_pool2d, None)
    else:
        SPEED[F.max_pool2d] = pool_rule
    opts[k].zero_grad(set_to_none=True)
    phalanx.member_losses(F.cross_entropy, stacks[k](x), y).sum().backward()
    opts[k].step()


steps = {"loop": loop, **{k: (lambda k=k: fused(k)) for k in ways}}
for f in steps.values():  # warm: gradients allocated, malloc's setting made
    f()
    f()
if mode == "faults":
    allocator = os.environ.get("PHALANX_CPU_ALLOCATOR", "phalanx's")
    for k, f in steps.items():
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(rounds):
            f()
        r1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        print(
            f"{allocator} malloc, {k}: {(r1.ru_minflt - r0.ru_minflt) / rounds:.0f} minor faults "
            f"a step, system {(r1.ru_stime - r0.ru_stime) / rounds * 1e3:.0f} ms, user "
            f"{(r1.ru_utime - r0.ru_utime) / rounds * 1e3:.0f} ms, wall "
            f"{(t1 - t0) / rounds * 1e3:.0f} ms"
        )
    sys.exit(0)
times: dict[str, list[float]] = {k: [] for k in steps}
for r in range(rounds):
    for k, f in steps.items() if r % 2 else reversed(steps.items()):
        s = time.perf_counter()
        f()
        times[k].append(time.perf_counter() - s)
base = statistics.median(times["loop"])
for k, t in times.items():
    m = statistics.median(t)
    print(f"W7 train step, {k}: {m * 1e3:.1f} ms, {base / m:.2f}x the loop ({len(t)} interleaved)")
