"""What a member's forward keeps on its modules between calls, seen by the backends.

A forward may write Python state on ``self`` (a cache of a weight-derived tensor, a counter).
The stack holds one module tree for all members, so that state needs care: the loop keeps one
copy of it per member (:class:`PerMemberAttributes`), and the vmap backends, whose one call
would leave a batched tensor behind, refuse where a forward stores a tensor
(:func:`stored_tensors`). Hooks are the other thing a forward runs besides its own code.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from phalanx import _torch_compat as compat

# nn.Module's own bookkeeping, and torch's (RNNBase re-lists its weights when
# functional_call swaps them): not state a forward keeps.
_INTERNALS = frozenset(nn.Module().__dict__) | {
    "training",
    "_flat_weights",
    "_flat_weight_refs",
}

Snapshot = list[tuple[nn.Module, dict[str, Any]]]


def hooked(module: nn.Module) -> list[str]:
    """The paths of the submodules that hold hooks ('' is the root), global hooks as '*'."""
    found = ["*"] if compat.global_module_hooks() else []
    if any(compat.has_hooks(m) for m in module.modules()):  # names only on a hit
        found += [p for p, m in module.named_modules() if compat.has_hooks(m)]
    return found


def snapshot(module: nn.Module) -> Snapshot:
    """Every submodule's own attributes (not its parameters, buffers or children)."""
    return [
        (m, {k: v for k, v in m.__dict__.items() if k not in _INTERNALS}) for m in module.modules()
    ]


def written(before: Snapshot) -> Iterator[tuple[nn.Module, str, Any]]:
    """The attributes set or replaced since ``before``: (module, name, value before or a
    missing marker)."""
    for m, old in before:
        now = m.__dict__
        for k, v in now.items():
            if k in _INTERNALS:
                continue
            if k not in old:
                yield m, k, _MISSING
            elif old[k] is not v:
                yield m, k, old[k]


class _Missing:
    def __repr__(self) -> str:
        return "<missing>"


_MISSING = _Missing()


def put_back(changes: list[tuple[nn.Module, str, Any]]) -> None:
    for m, k, old in changes:
        if old is _MISSING:
            m.__dict__.pop(k, None)
        else:
            m.__dict__[k] = old


def holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple)):
        return any(holds_tensor(v) for v in value)
    if isinstance(value, dict):
        return any(holds_tensor(v) for v in value.values())
    return False


def stored_tensors(before: Snapshot) -> list[tuple[nn.Module, str, Any]]:
    """The attributes set or replaced since ``before`` that now hold a tensor."""
    return [c for c in written(before) if holds_tensor(c[0].__dict__.get(c[1]))]


class PerMemberAttributes:
    """One copy per member of the attributes a forward writes on its modules (the loop's).

    Before member i runs, the attributes the forward wrote during member i's previous calls
    are put in place; after it, what it wrote is kept for member i and the attributes are put
    back as they were, so that member i + 1 does not read member i's cache.
    """

    def __init__(self) -> None:
        self.kept: dict[int, list[tuple[nn.Module, str, Any]]] = {}

    def run(self, i: int, module: nn.Module, call: Any) -> Any:
        mine = self.kept.get(i, [])
        before_mine = [(m, k, m.__dict__.get(k, _MISSING)) for m, k, _ in mine]
        for m, k, v in mine:
            m.__dict__[k] = v
        before = snapshot(module)
        try:
            return call()
        finally:
            changes = list(written(before))
            if changes or mine:
                kept = {(id(m), k): (m, k, m.__dict__.get(k, _MISSING)) for m, k, _ in mine}
                for m, k, _ in changes:
                    kept[(id(m), k)] = (m, k, m.__dict__.get(k, _MISSING))
                self.kept[i] = [e for e in kept.values() if e[2] is not _MISSING]
                put_back(changes)
                put_back(before_mine)


class RemappedAttributes:
    """The loop's per-member attributes for a view of some members (a subset call, a chunk):
    the view's member i is the stack's member ``members[i]``."""

    def __init__(self, attributes: PerMemberAttributes, members: list[int]) -> None:
        self.attributes, self.members = attributes, members

    def run(self, i: int, module: nn.Module, call: Any) -> Any:
        return self.attributes.run(self.members[i], module, call)
