"""What a member's randomness is, on each backend.

A member draws its random numbers from the global generators (dropout, ``torch.randn``), or
from a ``torch.Generator`` of its own that it holds as an attribute (reproducible noise per
model). The loop, the reference, runs each member as it runs alone: member i draws from the
global stream after member i - 1, and from its own generator, which the stack keeps per
member (:class:`MemberGenerators`: a copy of each member's, taken at ``phalanx.stack()``).

One vmapped call (``fused``, ``vmap``) draws every member's numbers at once from the global
generators (``randomness="different"``): independent per member and reproducible under a
seed, but other numbers than the loop's. It cannot draw from a ``torch.Generator`` object,
whether the member holds it or makes and seeds it in its forward (it would draw every
member's noise from one stream at once), nor give the noise of a forward that reseeds the
global generator (``torch.manual_seed(k)`` then ``torch.randn``: each member alone draws the
same noise, one vmapped call N different ones). The draw from a generator object is refused
where it happens (``rules.BatchedOps``, before anything is drawn: a generator the member
holds and never draws from costs nothing), the reseed by ``_guard.Guarded``; ``auto`` hands
such a model to the loop.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

Slot = tuple[str, str]
"""Where a module tree holds a generator: (submodule path, attribute name)."""


def generator_slots(module: nn.Module) -> list[Slot]:
    """The attributes of ``module``'s submodules that hold a ``torch.Generator`` (a submodule
    used at several places is listed at each)."""
    return [
        (path, key)
        for path, sub in module.named_modules(remove_duplicate=False)
        for key, value in vars(sub).items()
        if isinstance(value, torch.Generator)
    ]


def copy_generators(
    members: Sequence[nn.Module],
    slots: list[Slot],
    where: str,
    memo: dict[int, Any] | None = None,
    first_index: int = 0,
) -> list[list[torch.Generator]]:
    """Each member's generators, copied (state included); one generator object used by
    several members or slots stays one object (``memo`` carries that across calls), so they
    keep drawing from one stream, as the members alone do."""
    memo = {} if memo is None else memo
    out = []
    for i, m in enumerate(members, start=first_index):
        found = set(generator_slots(m))
        missing = [s for s in slots if s not in found] or [s for s in found if s not in slots]
        if missing:
            path, key = missing[0]
            raise ValueError(
                f"{where}: member {i} and member 0 do not hold their torch.Generator "
                f"attributes at the same places ({f'{path}.{key}' if path else key!r}); give "
                f"every member its generators under the same names."
            )
        out.append([copy.deepcopy(vars(m.get_submodule(path))[key], memo) for path, key in slots])
    return out


class MemberGenerators:
    """The stack's generators, one set per member, put on its module while member i runs.

    Attributes:
        slots: where the member holds them.
        per_member: ``per_member[i][j]`` is member i's generator at ``slots[j]``.
    """

    def __init__(
        self, module: nn.Module, slots: list[Slot], per_member: list[list[torch.Generator]]
    ) -> None:
        self.module = module
        self.slots = slots
        self.per_member = per_member

    def subset(self, chosen: Sequence[int]) -> MemberGenerators:
        return MemberGenerators(self.module, self.slots, [self.per_member[i] for i in chosen])

    def path(self) -> str:
        path, key = self.slots[0]
        return f"{path}.{key}" if path else key

    def run(self, i: int, call: Callable[[], Any]) -> Any:
        """Runs ``call`` with member i's generators on the module, then puts the module's own
        back."""
        owners = [vars(self.module.get_submodule(path)) for path, _ in self.slots]
        own = [d[key] for d, (_, key) in zip(owners, self.slots)]
        for d, (_, key), g in zip(owners, self.slots, self.per_member[i]):
            d[key] = g
        try:
            return call()
        finally:
            for d, (_, key), g in zip(owners, self.slots, own):
                d[key] = g
