"""Interleaved timing and peak memory, careful enough for a noisy shared machine.

Contenders are timed round by round: in round r every contender is measured once, so that a
burst of load from another process slows all of them alike instead of one of them. The order
rotates by one each round, so that no contender always runs right after the same other one
(whose leftovers in caches and allocator would then always favour or hurt it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

#: Warm-up stops for a function once its warm-up calls have taken this long.
_WARMUP_CAP_S = 1.0


@dataclass
class Timing:
    """Seconds per call, one sample per round.

    Attributes:
        samples: per-call time of each round, in seconds (each sample is one timed run of
            ``calls_per_round`` back-to-back calls, divided by that number).
        calls_per_round: how many calls each sample averages.
    """

    samples: list[float] = field(default_factory=list)
    calls_per_round: int = 1

    def quantile(self, q: float) -> float:
        """The q-quantile of the samples, linearly interpolated."""
        s = sorted(self.samples)
        pos = q * (len(s) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def iqr(self) -> tuple[float, float]:
        """(first quartile, third quartile)."""
        return self.quantile(0.25), self.quantile(0.75)


def synchronizer(device: torch.device) -> Callable[[], None]:
    """A function that waits for the device's queued work: a no-op on CPU."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    device: torch.device,
    rounds: int,
    min_rounds: int,
    warmup: int,
    target_s: float,
    budget_s: float,
    on_round: Callable[[], None] = lambda: None,
) -> dict[str, Timing]:
    """Times every function round by round, interleaved.

    Each function is first run ``warmup`` times, then once more alone to choose how many
    back-to-back calls make one sample last at least ``target_s`` (so that timer resolution
    and synchronisation cost do not matter). Then, for up to ``rounds`` rounds, every
    function gives one sample per round. Rounds stop early once ``min_rounds`` are done and
    ``budget_s`` has passed, so a slow workload cannot hold the machine for long.

    Args:
        fns: name -> a function running one call.
        device: where the work runs; CUDA work is synchronised around every sample.
        rounds: the most rounds.
        min_rounds: the fewest rounds, whatever the budget.
        warmup: untimed calls per function before calibration (fewer for a function whose
            calls take over a second).
        target_s: the shortest a sample may last.
        budget_s: seconds after which no new round starts (once ``min_rounds`` are done).
        on_round: called after each round (progress bars).

    Returns:
        name -> its timing.
    """
    sync = synchronizer(device)
    names = list(fns)
    spent = dict.fromkeys(names, 0.0)
    for _ in range(warmup):
        for name in names:
            if spent[name] < _WARMUP_CAP_S:  # a call of seconds is warm after one call
                start = time.perf_counter()
                fns[name]()
                sync()
                spent[name] += time.perf_counter() - start
    timings = {}
    for name in names:
        sync()
        start = time.perf_counter()
        fns[name]()
        sync()
        single = max(time.perf_counter() - start, 1e-9)
        timings[name] = Timing(calls_per_round=max(1, math.ceil(target_s / single)))
    gc.collect()
    begin = time.perf_counter()
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, calls = fns[name], timings[name].calls_per_round
            gc.disable()
            try:
                sync()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                sync()
                elapsed = time.perf_counter() - start
            finally:
                gc.enable()
            timings[name].samples.append(elapsed / calls)
        on_round()
        if r + 1 >= min_rounds and time.perf_counter() - begin > budget_s:
            break
    return timings


def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field_name}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if match is None:
        raise OSError(f"/proc/self/status has no {field_name}")
    return int(match.group(1))


def _malloc_trim() -> Callable[[], object]:
    """glibc's ``malloc_trim(0)``: hand freed heap memory back to the OS; else a no-op."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return lambda: None
    return lambda: trim(0)


_trim = _malloc_trim()


def peak_memory(fn: Callable[[], object], device: torch.device) -> tuple[int | None, str]:
    """Peak memory one call of ``fn`` adds on top of what is already held.

    On CUDA: ``torch.cuda.max_memory_allocated`` during the call, less the memory allocated
    before it. On CPU (Linux): the growth of the process's peak resident set size during the
    call, after handing freed heap memory back to the OS (glibc ``malloc_trim``) and resetting
    the peak through ``/proc/self/clear_refs``. Memory the allocator still keeps from earlier
    calls is reused without growing the RSS, so on CPU this is a lower bound.

    Args:
        fn: one call.
        device: where it runs.

    Returns:
        (bytes or None where it cannot be measured, how it was measured).
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, "CUDA max_memory_allocated"
    gc.collect()
    _trim()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak RSS, to the current RSS (Linux >= 4.0)
        before = _proc_status_kib("VmRSS")
        fn()
        return 1024 * max(0, _proc_status_kib("VmHWM") - before), "peak RSS growth (lower bound)"
    except OSError:
        return None, "n/a (needs Linux /proc/self/clear_refs)"
