"""Trial runs that leave no trace: buffers and RNG states saved and restored around them.

``auto`` times backends and the fused backend checks itself against the reference on real
inputs; neither may move a BatchNorm's running statistics or the random stream the user's
own run then sees.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from phalanx._backends import StackView


@contextlib.contextmanager
def preserved(view: StackView) -> Iterator[None]:
    """Runs the block, then puts the stacked buffers and every RNG state back as they were.

    Warnings raised inside (torch's "performance drop" notes from a backend that is only
    being tried) are kept from the user: the trial is phalanx's business, not theirs.
    """
    _, buffers = view.state()
    values = [b.clone() for b in buffers.values()]
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        with torch.no_grad():
            for b, v in zip(buffers.values(), values):
                b.copy_(v)
        torch.set_rng_state(cpu)
        if cuda:
            torch.cuda.set_rng_state_all(cuda)


def seconds(fn: Callable[[], Any], device: torch.device, repeats: int = 2) -> float:
    """The best of ``repeats`` wall times of ``fn()`` in seconds, synchronising on CUDA.

    The one timing helper of the library: ``auto``'s race and the fused layers' choice of
    convolution strategy both use it.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best
