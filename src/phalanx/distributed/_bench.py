"""``bench_sharded``: benchmark workloads on K local ranks against one process, in one run.

Both sides run the same workload: one process holding all N members (this process, with its
intra-op threads), then K ranks of one thread each holding their blocks. A sharded step
takes as long as its slowest rank; members are independent, so the step itself needs no
communication, and none is timed.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch
from torch import nn

__all__ = ["bench_sharded"]

PHASES = ("forward", "train")


def _block(workload: Any, block: range, device: torch.device) -> Any:
    """A phalanx runner over the members ``block`` of a workload, on their slice of the data.

    Members and data come from the benchmark's own builder, so they are the members and data
    the one-process run and every other contender see; members outside the block are never
    built (the builder makes member i under seed ``i``, whatever the others are).
    """
    from phalanx._bench.contenders import PhalanxRunner, phalanx_adam
    from phalanx._bench.workloads import Data, build

    counter = iter(range(workload.num_members))

    def make_member() -> nn.Module:
        return workload.make_member() if next(counter) in block else nn.Identity()

    members, data = build(dataclasses.replace(workload, make_member=make_member), device=device)
    n, lo, hi = workload.num_members, block.start, block.stop
    x, t = data.x, data.target
    if workload.input_mode == "per-member":
        x, t = x[lo:hi], t[lo:hi]
    elif workload.input_mode == "sliced":  # member i reads columns d*i .. d*i + d
        d, o = x.shape[1] // n, t.shape[1] // n
        x, t = x[:, d * lo : d * hi], t[:, o * lo : o * hi]
    mine = dataclasses.replace(workload, num_members=len(block))
    return PhalanxRunner(
        members[lo:hi], Data(x, t), mine, backend="auto", optimizer=phalanx_adam()[0]
    )


def _time_phases(workload: Any, block: range, device: torch.device, quick: bool) -> dict[str, Any]:
    """Seconds per call of each phase, one figure per timed round of calls.

    Also returns, under "output", the block's forward output before any training step, so
    that the caller can check the ranks computed what one process computes.
    """
    runner = _block(workload, block, device)
    runner.stack.eval()
    with torch.no_grad():
        output = runner.forward().cpu()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def forward() -> None:
        with torch.no_grad():
            runner.forward()

    def train() -> None:
        runner.backward()
        runner.step()

    rounds, calls = (5, 5) if quick else (15, 20)
    times: dict[str, Any] = {"output": output}
    for phase, fn in (("forward", forward), ("train", train)):
        runner.stack.train(phase == "train")
        for _ in range(3 if quick else 10):  # warm-up
            fn()
        sync()
        times[phase] = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            times[phase].append((time.perf_counter() - start) / calls)
    return times


def _rank_main(name: str, quick: bool, device: str) -> dict[str, Any]:
    """One rank: time its block; every rank returns its figures."""
    import torch.distributed as dist

    from phalanx._bench.workloads import WORKLOADS
    from phalanx.distributed._mesh import layout

    w = WORKLOADS[name]
    shard = layout(w.num_members)
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", shard.rank % torch.cuda.device_count())
    dist.barrier()  # start together: ranks compete for the same cores and memory bandwidth
    return _time_phases(w, shard.global_indices, dev, quick)


def bench_sharded(
    workloads: list[str], procs: int, quick: bool = True, device: str = "cpu"
) -> list[dict[str, Any]]:
    """Times workloads on ``procs`` local ranks against one process holding every member.

    Members and data come from the benchmark's builder (``phalanx._bench.workloads``), run
    by its phalanx contender (backend "auto", phalanx's Adam). The one-process figure is taken
    in this process, with its intra-op threads; then ``procs`` ranks of one thread each
    (:func:`phalanx.distributed.launch`) time their blocks at the same moment. A sharded
    call takes as long as the slowest rank; each figure is the median over timed rounds.

    Args:
        workloads: workload ids from DESIGN.md, e.g. ["W1", "W6"].
        procs: K, the number of local ranks.
        quick: fewer and shorter timed rounds.
        device: "cpu", or "cuda" to put rank r on GPU ``r % device_count``.

    Returns:
        One row per workload and phase ("forward", "train"): ``workload``, ``phase``,
        ``procs``, ``threads_1proc`` (the one process's intra-op threads; set them with
        ``torch.set_num_threads`` before the call), ``time_1proc_ms``, ``time_kprocs_ms``,
        ``ratio`` = ``time_1proc_ms / time_kprocs_ms`` (above 1 when sharding pays), and
        ``same_outputs``: whether the ranks' forward outputs, joined, match one process's.

    Raises:
        ValueError: an unknown workload or fewer than 1 process.

    Example:
        >>> rows = phalanx.distributed.bench_sharded(["W1", "W6"], procs=2, quick=True, device="cpu")
    """
    from phalanx._bench.workloads import WORKLOADS
    from phalanx.distributed._launch import launch

    where = "phalanx.distributed.bench_sharded()"
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"{where}: unknown workloads {unknown}; choose from {sorted(WORKLOADS)}.")
    if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
        raise ValueError(f"{where}: procs must be a positive int; got {procs!r}.")
    rows = []
    for name in workloads:
        w = WORKLOADS[name]
        one = _time_phases(w, range(w.num_members), torch.device(device), quick)
        per_rank = launch(_rank_main, procs, name, quick, device, timeout=120.0)
        joined = torch.cat(
            [r["output"] for r in per_rank], dim=1 if w.input_mode == "sliced" else 0
        )
        exact = torch.allclose(joined, one["output"], rtol=1e-4, atol=1e-5)
        for phase in PHASES:
            slowest = [max(block) for block in zip(*(r[phase] for r in per_rank))]
            t1 = statistics.median(one[phase]) * 1e3
            tk = statistics.median(slowest) * 1e3
            rows.append(
                {
                    "workload": name,
                    "phase": phase,
                    "procs": procs,
                    "threads_1proc": torch.get_num_threads(),
                    "time_1proc_ms": t1,
                    "time_kprocs_ms": tk,
                    "ratio": t1 / tk,
                    "same_outputs": exact,
                }
            )
    return rows
