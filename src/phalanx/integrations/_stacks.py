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


def split_reasons(groups: list[list[nn.Module]]) -> list[str]:
    """Why the networks of a batch formed ``len(groups)`` stacks: how each group's first
    network differs from the first group's (``architecture_differences``' lines, member
    indices dropped), the most frequent first."""
    from phalanx.core._validate import architecture_differences

    counts: dict[str, int] = {}
    for nets in groups[1:]:
        for line in architecture_differences(groups[0][0], nets[0], 1):
            line = line.removeprefix("member 1 ").replace(", member 0 has", ", another has")
            counts[line] = counts.get(line, 0) + 1
    return sorted(counts, key=lambda k: -counts[k])


def describe_split(groups: list[list[nn.Module]], where: str) -> str | None:
    """The warning for a batch of networks that fell apart for architecture reasons, at
    least half of them into stacks of one member (a few stacks, one per width of a
    categorical choice, are what the user asked for); else None. Names the differences and,
    where a setting such as a dropout rate differs, how to keep it from splitting the batch."""
    sizes = [len(g) for g in groups]
    total = sum(sizes)
    if len(groups) < 2 or 2 * sum(s == 1 for s in sizes) < total:
        return None
    reasons = split_reasons(groups)
    shown = "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else "")
    ones = sum(s == 1 for s in sizes)
    head = (
        f"{where}: a batch of {total} trials made {len(groups)} stacks"
        + (f" ({ones} of one member)" if ones else "")
        + f", sizes {sizes}: their networks differ in a setting, not only in weights ({shown})."
    )
    if any("Dropout" in r or "dropout" in r for r in reasons):
        head += (
            " An AlphaDropout's rate is a module setting (nn.Dropout's and Dropout1d/2d/3d's "
            "are per member and never split a batch): each distinct value is its own stack, so "
            "a rate from suggest_float gives every trial its own. Use nn.Dropout, suggest the "
            "rate from a few values (trial.suggest_categorical('dropout', [0.0, 0.1, 0.2])), "
            "or fix it."
        )
    else:
        head += (
            " Each stack costs about what the whole batch would: suggest such values from a "
            "few choices (suggest_categorical), or name them in group_by= to make the split "
            "explicit."
        )
    return head
