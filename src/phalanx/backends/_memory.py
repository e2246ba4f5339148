"""CPU memory that large stacked tensors reuse from step to step instead of faulting in afresh.

Every training step allocates gradients and temporaries the size of the stacked weights, and
activations the size of all members' together, and frees them again. glibc's malloc serves any block over 32 MiB (its largest mmap threshold)
with a fresh ``mmap`` and returns it with ``munmap`` when freed, so each step maps, zero-fills
and page-faults those megabytes anew. Measured here on the EmbeddingBag classifier of the
real-model zoo (16 members, 41 MB stacked embedding, 1 thread, a busy machine): a training
step of 44.8 ms with glibc's defaults, 27.6-31.1 ms with freed memory kept for reuse; and on
W7 of DESIGN.md (16 CNNs, batch 64), whose weights are small but whose first block's
activations are 44 MB for all members, the page faults were the whole difference between the
fused step and the loop (the same user time; 87,000 minor faults a step against the loop's
4,000, docs/TRAIN_STEP.md). A stack whose stacked tensors are that large (checked when it is
built), or whose batched activations are (checked by the batching rules, :func:`note_batched`),
therefore asks malloc, once per process, to serve large blocks from its heap and keep what is
freed
(``mallopt(M_MMAP_MAX, 0)``, ``mallopt(M_TRIM_THRESHOLD, ...)``), as PyTorch's CUDA caching
allocator does on the GPU. The cost: the process keeps its peak memory instead of returning
it to the system. Set ``PHALANX_CPU_ALLOCATOR=system`` to keep glibc's defaults.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from phalanx import _torch_compat as compat

logger = logging.getLogger("phalanx")

LARGE = 32 << 20  # glibc's largest mmap threshold: blocks above it are always mmapped
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_done = False
_unavailable = False  # no glibc mallopt here: not looked up again (find_library is slow)


def reuse_freed_memory(largest_bytes: int) -> bool:
    """Keeps freed CPU memory for reuse when a tensor of ``largest_bytes`` will churn.

    Returns:
        True when malloc now keeps freed memory (set now or earlier in this process).
    """
    global _done, _unavailable
    if _done:
        return True
    if (
        _unavailable
        or largest_bytes <= LARGE
        or os.environ.get("PHALANX_CPU_ALLOCATOR") == "system"
    ):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl): nothing to tune
        _unavailable = True
        return False
    if not (mallopt(_M_MMAP_MAX, 0) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        _unavailable = True
        return False
    _done = True
    logger.info(
        "phalanx: stacked tensors or batched activations of %.0f MB on the CPU: malloc now "
        "keeps freed memory for reuse (PHALANX_CPU_ALLOCATOR=system keeps glibc's defaults)",
        largest_bytes / 1e6,
    )
    return True


def note_batched(tensors: Iterable[Any]) -> None:
    """Keeps freed CPU memory for reuse once a batched CPU tensor over ``LARGE`` is seen.

    Called by the batching rules with the physical tensors (all members') of each call: the
    activations of a vmapped forward are allocated and freed every step like the gradients.
    """
    if _done or compat.tracing():
        return
    largest = max(
        (
            t.numel() * t.element_size()
            for t in tensors
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta
        ),
        default=0,
    )
    if largest > LARGE:
        reuse_freed_memory(largest)
