"""Two rewrites of the captured step, measured: what their rules rest on, and the A/B.

``sweep [N]``: a CPU ``bmm`` of N products ``(M, K) @ (K, C)`` as written (``bmm(a, w^T)``,
the batched linear's form) against the transposed product (``bmm(w, a^T)``), the ratio of
their medians over the grid of M, K, C; above 1 the transposed product is faster (the rule
``phalanx.step._graph.narrow_product``).

``narrow W1``: a workload's captured step with the narrow-product rewrite and without it;
``keep W1``: with Adam's per-member values kept in buffers (``phalanx._torch_compat.realized``)
and without. Both built in one process (the change's step first), timed interleaved in
20 blocks, then each profiled: the time in ``aten::bmm`` per step.

``profile W6``: a workload's captured step as it is, profiled: its time, the ``bmm`` calls by
shape, the operations that take the most time, and one 64^3 ``mm``'s GFLOP/s for scale.

``adam``: a compiled Adam on (400, 200) with per-member ``(N, 1)`` float64 counts and betas,
the bias corrections inlined by inductor against kept (``realized``); the same bits.

Run under ``flock /tmp/bench.lock env OMP_NUM_THREADS=1``:
    python benchmarks/captured_step_rewrites.py sweep 400
    python benchmarks/captured_step_rewrites.py narrow W1
    python benchmarks/captured_step_rewrites.py keep W6
    python benchmarks/captured_step_rewrites.py profile W6
    python benchmarks/captured_step_rewrites.py adam
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


def _profiled(
    step: Callable[[], object], calls: int, *, shapes: bool = False
) -> tuple[list, float]:
    """``calls`` steps under the profiler: the operations' averages (by input shape with
    ``shapes``) and the profiled time of a step in us."""
    from torch.profiler import profile

    with profile(record_shapes=shapes) as p:
        for _ in range(calls):
            step()
    events = list(p.key_averages(group_by_input_shape=shapes))
    return events, sum(e.self_cpu_time_total for e in events) / calls


def ab(change: str, workload: str) -> None:
    import phalanx._torch_compat as compat
    import phalanx.step._graph as graph
    from phalanx_tools.bench.contenders import CompiledRunner, phalanx_adam
    from phalanx_tools.bench.workloads import WORKLOADS, build

    module, name, off = (
        (graph, "narrow_product", lambda a, b: False)
        if change == "narrow"
        else (compat, "realized", lambda t: t)
    )
    w = WORKLOADS[workload]
    members, data = build(w, device="cpu")
    optimizer, _ = phalanx_adam()
    rule = getattr(module, name)
    runners = {}
    for side, choose in (("on", rule), ("off", off)):
        setattr(module, name, choose)  # read when the step is traced
        runners[side] = CompiledRunner(members, data, w, optimizer=optimizer)
        print(side, runners[side].compiled.report)
    setattr(module, name, rule)
    one = _per_call_us(runners["off"].backward, 2)
    calls = max(3, int(1e5 / one))  # blocks of about 0.1 s
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(20):
        for side, runner in runners.items():
            times[side].append(_per_call_us(runner.backward, calls))
    for side, ts in times.items():
        print(f"{workload} {side}: median {statistics.median(ts):.0f} us, min {min(ts):.0f} us")
    for side, runner in runners.items():
        events, total = _profiled(runner.backward, calls)
        spent = sum(e.self_cpu_time_total for e in events if e.key == "aten::bmm") / calls
        print(f"{side}: aten::bmm {spent:.0f} us of {total:.0f} us a step (profiled)")


def profile_step(workload: str) -> None:
    from phalanx_tools.bench.contenders import CompiledRunner, phalanx_adam
    from phalanx_tools.bench.workloads import WORKLOADS, build

    w = WORKLOADS[workload]
    members, data = build(w, device="cpu")
    runner = CompiledRunner(members, data, w, optimizer=phalanx_adam()[0])
    print(runner.compiled.report)
    one = _per_call_us(runner.backward, 2)
    calls = max(3, int(1e6 / one))  # about a second
    print(f"{workload} captured step: {_per_call_us(runner.backward, calls):.0f} us")
    by_shape, total = _profiled(runner.backward, calls, shapes=True)
    for e in by_shape:
        if e.key == "aten::bmm":
            us = e.self_cpu_time_total / calls
            print(f"  bmm {e.input_shapes}: {e.count / calls:.0f} a step, {us:.0f} us")
    print(f"  profiled: {total:.0f} us a step, of which")
    ops: dict[str, float] = {}
    for e in by_shape:
        ops[e.key] = ops.get(e.key, 0.0) + e.self_cpu_time_total / calls
    for key, us in sorted(ops.items(), key=lambda kv: -kv[1])[:5]:
        print(f"    {key}: {us:.0f} us")
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    print(
        f"one 64^3 mm: {2 * 64**3 / _per_call_us(lambda: torch.mm(a, b), 20000) / 1e3:.0f} GFLOP/s"
    )


def adam() -> None:
    import phalanx._torch_compat as compat

    n, d = 400, 200
    p, g, m, v = (torch.randn(n, d) for _ in range(4))
    v.abs_()
    step = torch.full((n, 1), 5.0, dtype=torch.float64)
    b1, b2 = torch.full_like(step, 0.9), torch.full_like(step, 0.999)
    lr, eps = torch.full_like(step, 1e-3), torch.full_like(step, 1e-8)

    def make(
        keep: Callable[[torch.Tensor], torch.Tensor],
    ) -> Callable[..., tuple[torch.Tensor, ...]]:
        def update(p, g, m, v, step, b1, b2, lr, eps):  # type: ignore[no-untyped-def]
            size = keep(-(lr / (1 - b1**step)))
            root = keep((1 - b2**step).sqrt())
            m2 = m.lerp(g, (1 - b1).float())
            v2 = v * b2.float() + (1 - b2).float() * g * g
            return p + size.float() * m2 / (v2.sqrt() / root.float() + eps.float()), m2, v2

        return torch.compile(update)

    args = (p, g, m, v, step, b1, b2, lr, eps)
    inlined, kept = make(lambda t: t), make(compat.realized)
    same = all(torch.equal(a, b) for a, b in zip(inlined(*args), kept(*args)))
    for _ in range(3):
        a = _median_us(inlined, *args)
        b = _median_us(kept, *args)
        print(f"inlined {a:.1f} us, kept {b:.1f} us; the same bits: {same}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    what = sys.argv[1] if len(sys.argv) > 1 else "sweep"
    if what == "sweep":
        sweep(int(sys.argv[2]) if len(sys.argv) > 2 else 400)
    elif what == "adam":
        adam()
    elif what == "profile":
        profile_step(sys.argv[2] if len(sys.argv) > 2 else "W6")
    else:
        ab(what, sys.argv[2] if len(sys.argv) > 2 else "W1")
