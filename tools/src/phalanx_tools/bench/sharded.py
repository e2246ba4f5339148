"""``bench_sharded``: benchmark workloads on K local ranks against one process, in one run.

Both sides run the same workload in the same K launched processes, in alternating rounds:
rank 0 alone holding all N members with the caller's intra-op threads (the other ranks idle
at a barrier), then all K ranks with one thread each on their blocks. A sharded call lasts as
long as its slowest rank; members are independent, so a training step needs no
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
    from phalanx_tools.bench.contenders import PhalanxRunner, phalanx_adam
    from phalanx_tools.bench.workloads import Data, build

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


class _Timed:
    """A runner's two phases as functions, each timed over a round of calls."""

    def __init__(self, runner: Any, device: torch.device) -> None:
        self.runner = runner
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def output(self) -> torch.Tensor:
        """The forward output before any training step, to check against one process."""
        self.runner.stack.eval()
        with torch.no_grad():
            return self.runner.forward().cpu()

    def call(self, phase: str) -> None:
        if phase == "forward":
            with torch.no_grad():
                self.runner.forward()
        else:
            self.runner.backward()
            self.runner.step()

    def time(self, phase: str, calls: int) -> float:
        """Seconds per call over ``calls`` back-to-back calls."""
        self.runner.stack.train(phase == "train")
        start = time.perf_counter()
        for _ in range(calls):
            self.call(phase)
        self.sync()
        return (time.perf_counter() - start) / calls


def _rank_main(name: str, quick: bool, device: str, threads_1proc: int) -> dict[str, Any]:
    """One rank. Rounds alternate: rank 0 alone holding all N members with ``threads_1proc``
    threads while the other ranks wait, then every rank on its block with one thread. So
    both sides meet the same bursts of load from other processes on a shared machine.
    """
    import torch.distributed as dist

    from phalanx.distributed import layout
    from phalanx_tools.bench.workloads import WORKLOADS

    w = WORKLOADS[name]
    shard = layout(w.num_members)
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", shard.rank % torch.cuda.device_count())
    mine = _Timed(_block(w, shard.global_indices, dev), dev)
    whole = _Timed(_block(w, range(w.num_members), dev), dev) if shard.rank == 0 else None
    out: dict[str, Any] = {"output": mine.output(), "one": {}, "k": {}}
    if whole is not None:
        out["output_1proc"] = whole.output()
    rounds, calls, warmup = (5, 5, 3) if quick else (15, 20, 10)
    for phase in PHASES:
        out["one"][phase], out["k"][phase] = [], []
        for timed in (mine, whole):
            if timed is not None:
                torch.set_num_threads(1 if timed is mine else threads_1proc)
                for _ in range(warmup):
                    timed.call(phase)
        for _ in range(rounds):
            dist.barrier()
            if whole is not None:
                torch.set_num_threads(threads_1proc)
                out["one"][phase].append(whole.time(phase, calls))
                torch.set_num_threads(1)
            dist.barrier()  # the others wait here, idle, while rank 0 runs alone
            out["k"][phase].append(mine.time(phase, calls))
    return out


def bench_sharded(
    workloads: list[str], procs: int, quick: bool = True, device: str = "cpu"
) -> list[dict[str, Any]]:
    """Times workloads on ``procs`` local ranks against one process holding every member.

    Members and data come from the benchmark's builder (``phalanx_tools.bench.workloads``), run
    by its phalanx contender (backend "auto", phalanx's Adam). ``procs`` ranks are launched
    (:func:`phalanx.distributed.launch`); rounds alternate between rank 0 alone running all N
    members with this process's intra-op threads (the other ranks idle) and every rank
    running its block with one thread, so both sides meet the same load from other
    processes. A sharded call lasts as long as the slowest rank; each figure is the median
    over rounds.

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
        >>> rows = bench_sharded(["W1", "W6"], procs=2, quick=True, device="cpu")
    """
    from phalanx.distributed import launch
    from phalanx_tools.bench.workloads import WORKLOADS

    where = "phalanx_tools.bench.sharded.bench_sharded()"
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        raise ValueError(f"{where}: unknown workloads {unknown}; choose from {sorted(WORKLOADS)}.")
    if isinstance(procs, bool) or not isinstance(procs, int) or procs < 1:
        raise ValueError(f"{where}: procs must be a positive int; got {procs!r}.")
    threads = torch.get_num_threads()
    rows = []
    for name in workloads:
        w = WORKLOADS[name]
        per_rank = launch(_rank_main, procs, name, quick, device, threads, timeout=300.0)
        dim = 1 if w.input_mode == "sliced" else 0
        joined = torch.cat([r["output"] for r in per_rank], dim=dim)
        exact = torch.allclose(joined, per_rank[0]["output_1proc"], rtol=1e-4, atol=1e-5)
        for phase in PHASES:
            one = statistics.median(per_rank[0]["one"][phase]) * 1e3
            # A sharded call lasts as long as its slowest rank.
            slowest = [max(ts) for ts in zip(*(r["k"][phase] for r in per_rank))]
            k = statistics.median(slowest) * 1e3
            rows.append(
                {
                    "workload": name,
                    "phase": phase,
                    "procs": procs,
                    "threads_1proc": threads,
                    "time_1proc_ms": one,
                    "time_kprocs_ms": k,
                    "ratio": one / k,
                    "same_outputs": exact,
                }
            )
    return rows
