"""Module-tree helpers shared across phalanx."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


def copy_modes(source: nn.Module, target: nn.Module) -> None:
    """Gives every module of ``target`` the train/eval mode of its namesake in ``source``.

    The trees may differ below a name (the fused backend replaces a whole ``Sequential`` by
    one batched module); every name of ``target`` must exist in ``source``.
    """
    for name, module in target.named_modules():
        module.training = source.get_submodule(name).training


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s structure whose parameters and buffers live on ``meta``.

    No tensor data is copied, and tensors tied within the module (one parameter object used
    by two submodules) stay tied in the copy.
    """
    memo: dict[int, Any] = {}
    for _, p in module.named_parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for _, b in module.named_buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)
