"""CPU memory that stacked tensors and batched activations reuse from step to step.

Every training step allocates gradients and temporaries the size of the stacked weights, and
activations the size of all members' together (N times a member's), and frees them again.
glibc's malloc serves any block over 32 MiB (its largest mmap threshold) with a fresh
``mmap`` and returns it with ``munmap`` when freed; smaller blocks come from its heap, but it
gives the heap's top back to the system (``M_TRIM_THRESHOLD``, twice the largest block it has
mapped) as soon as that much is free, which a step's activations are once the backward has
consumed them. Either way, each step maps, zero-fills and page-faults those megabytes anew,
where the loop's N times smaller temporaries stay in the heap. Measured here (16 members,
1 thread, a busy machine): the EmbeddingBag classifier of the real-model zoo (41 MB stacked
embedding) 44.8 ms a step with glibc's defaults, 27.6-31.1 ms with freed memory kept; the TD3
critic (4 MiB stacked weights, 4 MiB activations) 3600-6200 minor page faults a step against
the loop's none, 0.82x the fused-Adam loop's speed, 0.93x with freed memory kept; W7 of
DESIGN.md (16 CNNs, batch 64), whose weights are small but whose first block's activations
are 44 MB for all members: 87,000 minor faults a step against the loop's 4,000, the whole
difference between the fused step and the loop (benchmarks/notes/TRAIN_STEP.md).

So phalanx asks malloc, once per process, to keep what is freed (``mallopt(M_TRIM_THRESHOLD,
...)``, as PyTorch's CUDA caching allocator does on the GPU), at the level the largest
tensor needs: a stacked tensor when the stack is built, a batched activation when a batching
rule sees one (:func:`note_batched`), by the block malloc serves it from (the tensor's bytes
plus :data:`PADDING`):

- a block of at least :data:`SMALL` (glibc's default mmap threshold): blocks under 32 MiB
  come from the heap (``M_MMAP_THRESHOLD`` fixed at glibc's own largest), larger ones are
  still mapped and returned when freed;
- a block of at least :data:`LARGE`: every block comes from the heap (``M_MMAP_MAX`` 0).

The cost: the process keeps its peak heap instead of returning it to the system. Peak
resident memory of a step measured no different within this machine's noise (W7, fused:
638-670 MiB kept against 597-667 MiB with glibc's defaults, benchmarks/notes/MEMORY.md). Set
``PHALANX_CPU_ALLOCATOR=system`` to keep glibc's defaults.
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

#: glibc's default mmap threshold: tensors above it churn blocks glibc maps or trims.
SMALL = 128 << 10
#: glibc's largest mmap threshold: blocks above it are always mapped.
LARGE = 32 << 20
#: What malloc adds to a tensor's bytes before it compares the block with its mmap threshold:
#: torch asks for 64-byte aligned memory (``posix_memalign``), which glibc serves from a block
#: of the request plus the alignment plus a chunk header (under 128 bytes), rounded here up
#: to a page. Without it a tensor of exactly 32 MiB (2048 x 64 x 64 floats, as common as
#: powers of two are) passed as "up to 32 MiB", and its block was mapped afresh every step.
PADDING = 4 << 10
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_done = 0  # 0: glibc's defaults; 1: blocks up to LARGE kept; 2: every block kept
_unavailable = False  # no glibc mallopt here: not looked up again (find_library is slow)


def reuse_freed_memory(largest_bytes: int) -> bool:
    """Keeps freed CPU memory for reuse when a tensor of ``largest_bytes`` will churn.

    Returns:
        True when malloc now keeps freed memory (set now or earlier in this process).
    """
    global _done, _unavailable
    block = largest_bytes + PADDING
    level = 2 if block >= LARGE else 1 if block >= SMALL else 0
    if level <= _done or _unavailable or os.environ.get("PHALANX_CPU_ALLOCATOR") == "system":
        return _done > 0
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):  # not glibc (macOS, musl): nothing to tune
        _unavailable = True
        return False
    mapped = mallopt(_M_MMAP_MAX, 0) if level == 2 else mallopt(_M_MMAP_THRESHOLD, LARGE)
    if not (mapped and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)):
        _unavailable = _done == 0
        return _done > 0
    _done = level
    logger.info(
        "phalanx: stacked tensors or batched activations of %.1f MB on the CPU: malloc now "
        "keeps freed memory %sfor reuse (PHALANX_CPU_ALLOCATOR=system keeps glibc's defaults)",
        largest_bytes / 1e6,
        "" if level == 2 else f"(blocks up to {LARGE >> 20} MiB) ",
    )
    return True


def note_batched(tensors: Iterable[Any]) -> None:
    """Keeps freed CPU memory for reuse at the level a batched CPU tensor needs.

    Called by the batching rules with the physical tensors (all members') of each call: the
    activations of a vmapped forward are allocated and freed every step like the gradients.
    On every rule call, so it reads only each tensor's size until one is over the next level
    (about 0.3 us a tensor); what it costs to check more is paid at most twice a process.
    """
    if _done == 2 or _unavailable:
        return
    limit = (LARGE if _done else SMALL) - PADDING
    for t in tensors:
        if (
            isinstance(t, torch.Tensor)
            and t.nbytes >= limit
            and t.device.type == "cpu"
            and not t.is_meta
            and not compat.tracing()
        ):
            reuse_freed_memory(t.nbytes)
            if _done == 2 or _unavailable:
                return
            limit = (LARGE if _done else SMALL) - PADDING
