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


def unshare_submodules(module: nn.Module) -> list[str]:
    """Gives every place a submodule object is used at its own module object, in place.

    A member may use one submodule at several places (``nn.ModuleList([layer] * 3)``, as
    ALBERT shares one block). ``torch.func.functional_call`` swaps tensors in by path and
    puts them back in the same order, so with one object under several paths the last
    restore wins and the module is left holding a member's tensors. Each further place gets
    a copy whose parameters and buffers are the very tensor objects of the first (tied, as
    ``functional_call`` handles ties): the member computes as before, one stacked tensor per
    shared weight, used at each place. Returns the paths that were given copies.
    """
    copied: list[str] = []
    while True:
        seen: set[int] = set()
        again = None
        for path, sub in module.named_modules(remove_duplicate=False):
            if id(sub) in seen:
                again = path, sub
                break
            seen.add(id(sub))
        if again is None:
            return copied
        path, sub = again
        parent_path, _, leaf = path.rpartition(".")
        memo: dict[int, Any] = {id(t): t for t in [*sub.parameters(), *sub.buffers()]}
        setattr(module.get_submodule(parent_path), leaf, copy.deepcopy(sub, memo))
        copied.append(path)
