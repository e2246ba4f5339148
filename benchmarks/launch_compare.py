"""Side by side on 2 gloo ranks: phalanx.distributed.launch against torch's elastic_launch.

Measures the startup of a trivial function under each, and shows what elastic_launch
reports when a rank calls ``os._exit(3)`` and what it does when a rank hangs after its last
collective (phalanx's launch is tested on both in tests/test_distributed.py).

Usage::

    flock /tmp/phalanx-bench.lock python benchmarks/launch_compare.py
"""

from __future__ import annotations

import datetime
import os
import time
import uuid

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

import phalanx.distributed as pdist

TIMEOUT = datetime.timedelta(seconds=3)


def trivial() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


def exits() -> int:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    if dist.get_rank() == 1:
        os._exit(3)
    dist.all_reduce(torch.zeros(1))
    return 0


def hangs_after_its_last_collective() -> int:
    dist.init_process_group("gloo", timeout=TIMEOUT)
    dist.all_reduce(torch.zeros(1))
    if dist.get_rank() == 1:
        time.sleep(40)
    return 0


def nothing() -> None:
    return None


def run_elastic(fn):
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=2,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    return elastic_launch(config, fn)()


def main() -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    for fn in (trivial, exits, hangs_after_its_last_collective):
        start = time.monotonic()
        try:
            outcome = repr(run_elastic(fn))
        except Exception as e:
            outcome = f"{type(e).__name__}: " + str(e)[:600].replace("\n", " | ")
        print(f"elastic_launch {fn.__name__}: {time.monotonic() - start:.1f} s, {outcome}")
    for _ in range(3):
        start = time.monotonic()
        pdist.launch(nothing, 2)
        mine = time.monotonic() - start
        start = time.monotonic()
        run_elastic(trivial)
        theirs = time.monotonic() - start
        print(f"startup, trivial function: launch {mine:.1f} s, elastic_launch {theirs:.1f} s")


if __name__ == "__main__":
    main()
