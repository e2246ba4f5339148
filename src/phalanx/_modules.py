"""Module-tree helpers shared across phalanx."""

from __future__ import annotations

from torch import nn


def copy_modes(source: nn.Module, target: nn.Module) -> None:
    """Gives every module of ``target`` the train/eval mode of its namesake in ``source``.

    The trees may differ below a name (the fused backend replaces a whole ``Sequential`` by
    one batched module); every name of ``target`` must exist in ``source``.
    """
    for name, module in target.named_modules():
        module.training = source.get_submodule(name).training
