"""What a member's output may be: tensors in a structure torch's pytree can see into.

The backends stack a member's output leaf by leaf (``torch.utils._pytree``): a tensor leaf
becomes ``(N, ...)``, a non-tensor leaf (None, a flag, a string) is the same for every
member and passes through. An object pytree does not know is a leaf too, so tensors inside
it would pass through as if they were a flag: under vmap they are one member's (or
torch.func's batched tensors escaping), in the loop they cannot be compared. Such an output
is refused, naming the registration that makes its tensors visible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from phalanx._torch_compat import pytree


class OpaqueOutput(TypeError):
    """A member's output holds tensors where torch's pytree cannot see them: the user's
    output to change (or register), not a backend's limit, so no backend runs it."""


def refuse_opaque(leaves: Iterable[Any], where: str) -> None:
    """Raises :class:`OpaqueOutput` (a TypeError) for an output leaf that hides tensors.

    Args:
        leaves: the output's pytree leaves.
        where: the call, quoted first in the message.

    Example:
        >>> import dataclasses
        >>> @dataclasses.dataclass
        ... class Out:
        ...     mean: torch.Tensor
        >>> refuse_opaque([torch.zeros(2), None, "tag"], "Stack.forward()")  # fine
        >>> refuse_opaque([Out(torch.zeros(2))], "Stack.forward()")
        Traceback (most recent call last):
        ...
        phalanx.backends._outputs.OpaqueOutput: Stack.forward(): a member returned an instance of Out, a dataclass torch's pytree does not know, ...
    """
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) or not _holds_tensor(leaf):
            continue
        name = type(leaf).__name__
        if dataclasses.is_dataclass(leaf):
            raise OpaqueOutput(
                f"{where}: a member returned an instance of {name}, a dataclass torch's pytree does not know, "
                f"so its tensors cannot be stacked over the members (they would pass through "
                f"as one member's); register it once with "
                f"torch.export.register_dataclass({name})."
            )
        raise OpaqueOutput(
            f"{where}: a member returned an instance of {name} holding tensors in its attributes, which "
            f"torch's pytree cannot see into, so they cannot be stacked over the members; "
            f"return tensors or a tuple, list, dict or registered dataclass of them, or "
            f"register {name} with torch.utils._pytree.register_pytree_node."
        )


def _holds_tensor(leaf: Any) -> bool:
    """Whether an opaque leaf keeps a tensor among its fields or attributes (one level of
    attributes, any pytree below them)."""
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        values = [getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)]
    else:
        try:
            values = list(vars(leaf).values())
        except TypeError:  # no __dict__: an int, a str, None, a slotted object
            return False
    return any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(values))
