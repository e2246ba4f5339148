"""The machine's own limits, measured in the run: fp32 GEMM throughput and copy bandwidth."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from phalanx_tools.bench._seconds import seconds

BUSY = "the machine is busy, figures are noisy; rerun when it is quiet"


@dataclass
class Machine:
    """What the benchmark ran on, and its measured limits.

    Attributes:
        device: "cpu" or "cuda".
        device_name: the GPU's name, or the CPU model on CPU.
        cpu: the CPU model.
        cores: logical cores the process may use.
        platform: operating system and architecture.
        python: Python version.
        torch: torch version.
        threads: ``torch.get_num_threads()``.
        gemm_n: the side of the square fp32 matmul timed.
        gemm_gflops: the best GFLOP/s of that matmul: the "peak" of the %-of-peak column.
        copy_mib: the size of the tensor copied.
        bandwidth_gbs: the best copy bandwidth, GB/s, counting read and write.
        load_average: the 1-minute load average when the run started (None where the OS
            does not say): above about 1, other processes competed for the cores.
    """

    device: str
    device_name: str
    cpu: str
    cores: int
    platform: str
    python: str
    torch: str
    threads: int
    gemm_n: int
    gemm_gflops: float
    copy_mib: int
    bandwidth_gbs: float
    load_average: float | None = None

    def describe(self) -> str:
        """The machine description printed at the top of the benchmark."""
        lines = [
            f"machine    {self.cpu}, {self.cores} cores, {self.platform}",
            f"software   Python {self.python}, torch {self.torch}, "
            f"{self.threads} intra-op thread{'s' * (self.threads != 1)}",
            f"device     {self.device}"
            + (f" ({self.device_name})" if self.device != "cpu" else ""),
            f"measured   fp32 GEMM {self.gemm_n}x{self.gemm_n}: {self.gemm_gflops:.1f} GFLOP/s; "
            f"copy of {self.copy_mib} MiB: {self.bandwidth_gbs:.1f} GB/s (read + write); "
            f"best of the repeats",
        ]
        if self.load_average is not None:
            lines.append(
                f"load       1-minute load average {self.load_average:.2f} at the start"
                + (f": {BUSY}" if self.busy() else "")
            )
        return "\n".join(lines)

    def busy(self) -> bool:
        """Whether other processes were competing for the cores when the run started."""
        return self.load_average is not None and self.load_average >= 1.0

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_model() -> str:
    """The CPU model from /proc/cpuinfo, else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _gemm(n: int, device: torch.device) -> Callable[[], object]:
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    out = torch.empty(n, n, device=device)
    return lambda: torch.mm(a, b, out=out)


def _copy(mib: int, device: torch.device) -> Callable[[], object]:
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def measure(device: torch.device, *, quick: bool) -> Machine:
    """Describes the machine and measures its fp32 GEMM GFLOP/s and copy bandwidth.

    The best of several repeats is kept: on a shared machine the best is the closest to what
    the hardware can do, which is what the fraction-of-peak and floor columns need.

    Args:
        device: the device the workloads run on.
        quick: smaller and fewer measurements.

    Returns:
        The description with the measured limits.
    """
    try:
        load: float | None = os.getloadavg()[0]  # before our own work raises it
    except (AttributeError, OSError):
        load = None
    cuda = device.type == "cuda"
    n = (4096 if quick else 8192) if cuda else (1024 if quick else 2048)
    mib = (1024 if cuda else 64) if quick else (4096 if cuda else 256)
    repeats = 3 if quick else 7
    gemm, copy = _gemm(n, device), _copy(mib, device)
    seconds(gemm, device, repeats=1)  # warm-ups: allocation, kernel selection, thread pool
    seconds(copy, device, repeats=1)
    gemm_s = seconds(gemm, device, repeats)
    copy_s = seconds(copy, device, repeats)

    return Machine(
        device=device.type,
        device_name=torch.cuda.get_device_name(device) if cuda else cpu_model(),
        cpu=cpu_model(),
        cores=_cores(),
        platform=f"{platform.system()} {platform.machine()}",
        python=sys.version.split()[0],
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        gemm_n=n,
        gemm_gflops=2 * n**3 / gemm_s / 1e9,
        copy_mib=mib,
        bandwidth_gbs=2 * mib * 2**20 / copy_s / 1e9,
        load_average=load,
    )
