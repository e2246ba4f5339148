"""The narrow-product rewrite of the captured step (``phalanx.step._graph.narrow_product``).

``sweep``: a CPU ``bmm`` of N products ``(M, K) @ (K, C)`` as written (``bmm(a, w^T)``, the
batched linear's form) against the transposed product (``bmm(w, a^T)``), the ratio of their
medians for M, K, C over the grid; above 1 the transposed product is faster.

``step W1``: a workload's captured step with the rewrite and without it, built in one
process ("on" first), timed interleaved in blocks of 100 steps, then each profiled: the
time in ``aten::bmm`` per step.

Run: flock /tmp/bench.lock env OMP_NUM_THREADS=1 python benchmarks/narrow_products.py sweep 400
     flock /tmp/bench.lock env OMP_NUM_THREADS=1 python benchmarks/narrow_products.py step W1
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import torch


def _per_call_us(f: Callable[[], object], calls: int = 100) -> float:
    f()
    start = time.perf_counter()
    for _ in range(calls):
        f()
    return (time.perf_counter() - start) / calls * 1e6


def _median_us(f: Callable[..., object], *args: object) -> float:
    return statistics.median(_per_call_us(lambda: f(*args)) for _ in range(3))


def sweep(n: int) -> None:
    columns = (1, 2, 4, 8, 10, 16, 20, 32, 64, 256)
    print(f"{n} products; as written / transposed, for C = {', '.join(map(str, columns))}")
    for m in (8, 32, 128, 512):
        for k in (10, 20, 64, 256):
            row = []
            for c in columns:
                if m * k * c * n > 2e8:
                    row.append("    -")
                    continue
                a, w = torch.randn(n, m, k), torch.randn(n, c, k)
                written = _median_us(torch.bmm, a, w.transpose(1, 2))
                flipped = _median_us(torch.bmm, w, a.transpose(1, 2))
                row.append(f"{written / flipped:5.2f}")
            print(f"M={m:4d} K={k:4d}:", " ".join(row))


def step(workload: str) -> None:
    from torch.profiler import profile

    import phalanx.step._graph as graph
    from phalanx_tools.bench.contenders import CompiledRunner, phalanx_adam
    from phalanx_tools.bench.workloads import WORKLOADS, build

    w = WORKLOADS[workload]
    members, data = build(w, device="cpu")
    optimizer, _ = phalanx_adam()
    rule = graph.narrow_product
    runners = {}
    for name, choose in (("on", rule), ("off", lambda a, b: False)):
        graph.narrow_product = choose  # read by simplify when the step is traced
        runners[name] = CompiledRunner(members, data, w, optimizer=optimizer)
        print(name, runners[name].compiled.report)
    graph.narrow_product = rule
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(20):
        for name, runner in runners.items():
            times[name].append(_per_call_us(runner.backward))
    for name, ts in times.items():
        print(f"{workload} {name}: median {statistics.median(ts):.0f} us, min {min(ts):.0f} us")
    for name, runner in runners.items():
        with profile() as p:
            for _ in range(200):
                runner.backward()
        events = {e.key: e for e in p.key_averages()}
        bmm = events.get("aten::bmm")
        total = sum(e.self_cpu_time_total for e in events.values()) / 200
        spent = bmm.self_cpu_time_total / 200 if bmm is not None else 0.0
        print(f"{name}: aten::bmm {spent:.0f} us of {total:.0f} us a step (profiled)")


if __name__ == "__main__":
    torch.set_num_threads(1)
    what = sys.argv[1] if len(sys.argv) > 1 else "sweep"
    if what == "sweep":
        sweep(int(sys.argv[2]) if len(sys.argv) > 2 else 400)
    else:
        step(sys.argv[2] if len(sys.argv) > 2 else "W1")
