"""What the integrations need to know about a model handed to a tool: the stacks in it, their
members' count and parameters, and how to write one ``save_pretrained`` folder per member."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from phalanx.core._stack import Stack

STACK_FILE = "phalanx.safetensors"


def stacks_in(module: nn.Module) -> list[Stack]:
    """The stacks in ``module`` (itself, or submodules such as a wrapper's ``self.stack``)."""
    return [m for m in module.modules() if isinstance(m, Stack)]


def num_members(stacks: list[Stack], where: str) -> int:
    """N shared by every stack; raises if the stacks hold different numbers of members."""
    sizes = sorted({s.num_members for s in stacks})
    if len(sizes) != 1:
        raise ValueError(
            f"{where}: the model holds stacks of {sizes} members; every stack in one model must "
            f"hold the same members (one N), as member i of each is one experiment."
        )
    return sizes[0]


def stacked_parameter_ids(stacks: Iterable[Stack]) -> set[int]:
    return {id(p) for s in stacks for p in s.parameters()}


def save_members(module: nn.Module, directory: str | os.PathLike[str]) -> list[str]:
    """Writes one folder per member, ``member_0/``, ...: ``save_pretrained`` of each member (a
    Hugging Face model), else its weights as ``model.safetensors`` (ties kept by
    ``safetensors.torch.save_model``). With several stacks, ``stack_j/member_i/``.

    Returns:
        The folders written.
    """
    from safetensors.torch import save_model

    stacks = stacks_in(module)
    written = []
    for j, stack in enumerate(stacks):
        base = os.fspath(directory) if len(stacks) == 1 else os.path.join(directory, f"stack_{j}")
        for i, member in enumerate(stack.unstack()):
            folder = os.path.join(base, f"member_{i}")
            os.makedirs(folder, exist_ok=True)
            save_pretrained: Any = getattr(member, "save_pretrained", None)
            if callable(save_pretrained):
                save_pretrained(folder)
            else:
                save_model(member, os.path.join(folder, "model.safetensors"))
            written.append(folder)
    return written


def member_axis_first(value: object, n: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n
