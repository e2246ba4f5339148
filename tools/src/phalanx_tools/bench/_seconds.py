"""The one timing helper of the library (the bench's machine measurements use it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def seconds(fn: Callable[[], Any], device: torch.device, repeats: int = 2) -> float:
    """The best of ``repeats`` wall times of ``fn()`` in seconds, synchronising on CUDA."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best
