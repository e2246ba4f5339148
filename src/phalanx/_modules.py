"""Small helpers shared across phalanx: module trees and torch's thread setting."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def copy_modes(source: nn.Module, target: nn.Module) -> None:
    """Gives every module of ``target`` the train/eval mode of its namesake in ``source``.

    The trees may differ below a name (the fused backend replaces a whole ``Sequential`` by
    one batched module); every name of ``target`` must exist in ``source``.
    """
    for name, module in target.named_modules():
        module.training = source.get_submodule(name).training


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
