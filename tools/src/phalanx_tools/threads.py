"""torch's intra-op thread setting for one block (the bench, the demo and tests use it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """Runs with ``count`` intra-op threads (None: torch's setting), then restores it."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
