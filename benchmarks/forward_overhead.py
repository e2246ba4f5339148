"""Stack.forward's own cost over its backend, on W2's MLP (8 members 10-20-2, shared batch 32).

The issue 26 goal: ``Stack.forward`` at most 5 us over ``backend.forward`` for this call. CPU
time of this thread (``time.thread_time``), contenders alternating in blocks of 200 calls in
one process on the same input; per contender the minimum and the median over blocks, and
the median of the paired differences to ``backend.forward`` (the block measured next to it).

Rows: ``stack(x)`` (through ``nn.Module.__call__``, as a user calls it), ``stack.forward(x)``
(the goal's figure), ``stack(x, in_dims=(None,))`` (the general path, every check run), and
``backend.forward`` (what the stack adds to).

Run: flock /tmp/bench.lock env OMP_NUM_THREADS=1 python benchmarks/forward_overhead.py [blocks]
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import phalanx
from phalanx.backends import get_backend


def _per_call_us(f: Callable[[], object], calls: int = 200) -> float:
    start = time.thread_time()
    for _ in range(calls):
        f()
    return (time.thread_time() - start) / calls * 1e6


def main(blocks: int = 100) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2)) for _ in range(8)]
    stack = phalanx.stack(members)
    x = torch.randn(32, 10)
    backend = get_backend(stack._requested)  # "auto": what the stack calls
    chosen = get_backend(stack.backend)  # what auto runs: "fused"
    view = stack._view  # what the stack hands its backend
    calls: dict[str, Callable[[], object]] = {
        "stack(x)": lambda: stack(x),
        "stack.forward(x)": lambda: stack.forward(x),
        "stack(x, in_dims=(None,)) (general path)": lambda: stack(x, in_dims=(None,)),
        f"{stack.backend} backend.forward (auto's choice)": lambda: chosen.forward(
            view, (x,), {}, (None,), frozenset()
        ),
        "backend.forward": lambda: backend.forward(view, (x,), {}, (None,), frozenset()),
    }
    for f in calls.values():  # warm-up: caches, the allocator
        for _ in range(300):
            f()
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(blocks):
        for k, f in calls.items():
            times[k].append(_per_call_us(f))
    bare = times["backend.forward"]
    print(
        f"torch {torch.__version__}, 1 thread, backend {stack._requested!r} running "
        f"{stack.backend!r}, {blocks} blocks of 200 calls"
    )
    for k, v in times.items():
        paired = statistics.median(p - q for p, q in zip(v, bare, strict=True))
        print(
            f"{k:42s} min {min(v):7.1f} us  median {statistics.median(v):7.1f} us  "
            f"over backend.forward: min {min(v) - min(bare):5.1f} us, paired median {paired:5.1f} us"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100)
